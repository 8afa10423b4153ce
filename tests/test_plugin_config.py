"""Plug-ins saved as ``class_path`` + ``init_args``: checkpoints load with ``weights_only=True``; old ones convert once."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional

import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from elr_lightning.callbacks.delayed_mixed_depth import DelayedSampler, load_weights_where_present
from elr_lightning.checkpoints.io import AtomicCheckpointIO, upgrade_checkpoint
from elr_lightning.cli import main
from elr_lightning.conditioning import LoopConditioner
from elr_lightning.inference.generate import load_model
from elr_lightning.hf.export import save_module_checkpoint
from elr_lightning.module import ELRModule
from elr_lightning.checkpoints.schema import build_plugin
from elr_lightning.plugin_config import PluginConfigError, plugin_config
from elr_lightning.checkpoints.safe_load import UnsafeCheckpointError
from elr_lightning.sampling import LoopSampler, OneLoopOverride, Synchronized
from elr_lightning.tokenizers import ByteTokenizer
from elr_lightning.checkpoints.trust import TRUST_ENV, UntrustedModuleError
from elr_lightning.updates import FixedDelta, StateUpdate

from conftest import quiet_trainer, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))


class ScaledDelta(FixedDelta):
    """A user's own rule in their own module: a keyword-only argument beside the parent's."""

    def __init__(self, beta: float = 0.5, *, scale: float = 1.0) -> None:
        super().__init__(beta)
        self.scale = scale

    def forward(self, s_prev: Tensor, r: Tensor, s_tilde: Tensor) -> Tensor:
        return super().forward(s_prev, r, s_tilde) * self.scale


class EveryOther(LoopSampler):
    """A user's sampler that takes another plug-in: k = 1 on odd steps, else ``inner``'s."""

    def __init__(self, inner: LoopSampler, note: Optional[list[str]] = None) -> None:
        self.inner, self.note, self.max_loops = inner, note, inner.max_loops

    def schedule(self, seed: int, step: int, num_shards: int) -> list[int]:
        return [1] * num_shards if step % 2 else self.inner.schedule(seed, step, num_shards)


class TensorArgument(StateUpdate):
    """A rule that takes a tensor, which a config cannot hold."""

    def __init__(self, scale: Tensor) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, s_prev: Tensor, r: Tensor, s_tilde: Tensor) -> Tensor:
        return r * self.scale


def _logits(module: ELRModule) -> dict[int, Tensor]:
    with torch.no_grad():
        return {k: module.model.eval()(IDS, k) for k in (1, 3)}


def _perturbed(module: ELRModule) -> ELRModule:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return module


def test_a_fit_checkpoint_loads_with_weights_only_and_rebuilds_every_plugin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Trainer.fit with a nested sampler, a conditioner, a user's rule and a tokenizer: no pickled object."""
    monkeypatch.setenv(TRUST_ENV, __name__)  # the user's rules live here
    torch.manual_seed(0)
    sampler = DelayedSampler(EveryOther(OneLoopOverride(4, 0.5), note=["a"]), switch_step=1)
    module = ELRModule(
        arch=tiny_config(), update=ScaledDelta(0.3, scale=0.9), sampler=sampler,
        conditioner=LoopConditioner(d_cond=8, rank=2, n_freqs=2), betas=(0.9, 0.99),
    )
    module.tokenizer = ByteTokenizer()
    trainer = quiet_trainer(max_steps=2)  # fmt: skip
    trainer.fit(module, DataLoader(torch.randint(0, 64, (4, 9)), batch_size=4))
    _perturbed(module)
    trainer.save_checkpoint(tmp_path / "fit.ckpt")

    raw = torch.load(tmp_path / "fit.ckpt", weights_only=True)
    hp = raw["hyper_parameters"]
    assert hp["update"] == {"class_path": f"{__name__}.ScaledDelta", "init_args": {"beta": 0.3, "scale": 0.9}}
    assert hp["sampler"]["init_args"]["after"] == {
        "class_path": f"{__name__}.EveryOther",
        "init_args": {"inner": {"class_path": "elr_lightning.sampling.OneLoopOverride",
                                "init_args": {"max_loops": 4, "override_fraction": 0.5}}, "note": ["a"]},
    }  # fmt: skip
    assert hp["arch"]["d_model"] == 32 and hp["betas"] == [0.9, 0.99]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no old-format fallback
        loaded = ELRModule.load_from_checkpoint(tmp_path / "fit.ckpt", weights_only=True)
    assert type(loaded.model.update) is ScaledDelta and loaded.model.update.scale == 0.9
    assert isinstance(loaded.sampler.after, EveryOther) and loaded.sampler.after.inner.override_fraction == 0.5
    assert [loaded.sampler.schedule(0, s, 4) for s in range(4)] == [sampler.schedule(0, s, 4) for s in range(4)]
    assert isinstance(loaded.tokenizer, ByteTokenizer)
    for k, logits in _logits(module).items():
        torch.testing.assert_close(_logits(loaded)[k], logits, rtol=0, atol=0)


def test_build_plugin_builds_only_trusted_subclasses_of_the_seam(monkeypatch: pytest.MonkeyPatch) -> None:
    config = plugin_config(ScaledDelta(scale=2.0), "update")
    with pytest.raises(UntrustedModuleError, match=rf"names '{__name__}.ScaledDelta' \(model.init_args.update.class_path\)"):
        build_plugin(config, StateUpdate, "model.init_args.update")
    monkeypatch.setenv(TRUST_ENV, __name__)
    assert build_plugin(config, StateUpdate, "model.init_args.update").scale == 2.0
    with pytest.raises(ValueError, match=r"model.init_args.sampler.class_path=.* names ScaledDelta, which is not a LoopSampler"):
        build_plugin(config, LoopSampler, "model.init_args.sampler")


def test_a_plugin_that_cannot_be_described_warns_at_construction_and_is_refused_at_save(tmp_path: Path) -> None:
    class Local(FixedDelta):
        pass

    with pytest.warns(UserWarning, match=r"model.init_args.update: .*Local is defined in a function.*top level"):
        module = ELRModule(arch=tiny_config(), update=Local())
    with pytest.raises(PluginConfigError, match=r"model.init_args.update: .*Local is defined in a function"):
        save_module_checkpoint(module, tmp_path / "x.ckpt")
    assert not (tmp_path / "x.ckpt").exists()
    with pytest.warns(UserWarning, match=r"model.init_args.update.init_args.scale is a Tensor.*state_dict"):
        ELRModule(arch=tiny_config(), update=TensorArgument(torch.ones(())))


def test_an_unrecorded_plugin_is_read_back_from_its_attributes_only_when_they_rebuild_it() -> None:
    old = FixedDelta.__new__(FixedDelta)  # as unpickled from an old checkpoint: no recorded arguments
    old.__dict__.update(FixedDelta(0.25).__dict__)
    del old.__dict__["_elr_init_args"]
    assert plugin_config(old, "update") == {"class_path": "elr_lightning.updates.FixedDelta", "init_args": {"beta": 0.25}}
    odd = Synchronized.__new__(Synchronized)
    odd.__dict__.update(max_loops=3, weights=[1.0, 1.0, 1.0])  # weights its constructor would normalise
    with pytest.raises(PluginConfigError, match=r"sampler: Synchronized rebuilt from the attributes .* differs in weights"):
        plugin_config(odd, "sampler")
    half = DelayedSampler.__new__(DelayedSampler)
    half.__dict__.update(switch_step=2)  # no ``after``
    with pytest.raises(PluginConfigError, match=r"sampler: the constructor arguments of DelayedSampler cannot be"):
        plugin_config(half, "sampler")


def _old_format_checkpoint(path: Path, tmp_path: Path) -> ELRModule:
    """A checkpoint as the code before class_path + init_args wrote it: the plug-ins pickled as objects."""
    module = _perturbed(ELRModule(
        arch=tiny_config(), update=FixedDelta(0.3), conditioner=LoopConditioner(d_cond=8, rank=2, n_freqs=2),
        sampler=DelayedSampler(OneLoopOverride(4, 0.25), switch_step=3),
    ))  # fmt: skip
    save_module_checkpoint(module, tmp_path / "new.ckpt")
    raw = torch.load(tmp_path / "new.ckpt", weights_only=True)
    old_objects = {}
    for name, value in module.hparams.items():
        if isinstance(value, dict) and "class_path" in value:
            old_objects[name] = build_plugin(value, {"update": StateUpdate, "sampler": LoopSampler}.get(
                name, LoopConditioner), name)  # fmt: skip
    for plugin in old_objects.values():  # unpickled objects carry no recorded arguments
        for obj in (plugin, getattr(plugin, "after", None)):
            if obj is not None:
                vars(obj).pop("_elr_init_args")
    raw["hyper_parameters"].update(old_objects, arch=module.arch)
    torch.save(raw, path)
    return module


def test_an_old_format_checkpoint_is_refused_and_upgraded_by_one_command(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """No loader unpickles an old checkpoint; `elr upgrade-checkpoint OLD NEW --trust` converts it, same logits."""
    old, new = tmp_path / "old.ckpt", tmp_path / "upgraded.ckpt"
    module = _old_format_checkpoint(old, tmp_path)
    with pytest.raises(Exception, match="Weights only load failed"):
        torch.load(old, weights_only=True)
    fresh = ELRModule(arch=tiny_config(), update=FixedDelta(0.3), conditioner=LoopConditioner(d_cond=8, rank=2, n_freqs=2))
    refusal = r"old.ckpt' holds a pickled object \(elr_lightning\..*\).*elr upgrade-checkpoint .*old.ckpt .*old.upgraded.ckpt --trust"
    for load in (
        lambda: load_model(str(old)),
        lambda: ELRModule.load_from_checkpoint(old),
        lambda: AtomicCheckpointIO().load_checkpoint(old),  # Lightning's default weights_only=None, as when resuming
        lambda: load_weights_where_present(fresh.model, str(old)),  # DelayedMixedDepth(init_from=...)
    ):
        with pytest.raises(UnsafeCheckpointError, match=refusal):
            load()

    with pytest.raises(SystemExit) as refused:  # it runs code from the file: only with --trust
        main(["upgrade-checkpoint", str(old), str(new)])
    assert refused.value.code == 1 and not new.exists()
    assert capsys.readouterr().err.count("elr upgrade-checkpoint: error: OLD") == 1
    main(["upgrade-checkpoint", str(old), str(new), "--trust"])
    assert "it loads without running code" in capsys.readouterr().out
    raw = torch.load(new, weights_only=True)
    assert raw["hyper_parameters"]["sampler"]["init_args"]["after"]["init_args"]["override_fraction"] == 0.25
    _, upgraded = load_model(str(new))
    for k, logits in _logits(module).items():
        torch.testing.assert_close(_logits(upgraded)[k], logits, rtol=0, atol=0)
    assert upgraded.model.update.beta == 0.3 and upgraded.sampler.switch_step == 3

    main(["upgrade-checkpoint", str(new), str(tmp_path / "again.ckpt")])  # nothing to convert, no --trust needed
    assert "already loads without running code" in capsys.readouterr().err and not (tmp_path / "again.ckpt").exists()
    before = new.read_bytes()
    with pytest.raises(SystemExit):
        main(["upgrade-checkpoint", str(old), str(new), "--trust"])
    assert "exists; elr upgrade-checkpoint never replaces a file" in capsys.readouterr().err
    with pytest.raises(FileExistsError):
        upgrade_checkpoint(str(old), str(new), trust=True)
    assert new.read_bytes() == before
