"""Tests of the layer seams: token/channel mixers, the loop context, the layer patterns, key stability."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import Tensor, nn
from typing_extensions import override

from conftest import perturbed_model, tiny_config
from elr_lightning.conditioning import LoopConditioner
from elr_lightning.config import ModelConfig
from elr_lightning.context import LoopContext
from elr_lightning.mixers import ChannelMixer, SwiGLU, TokenMixer
from elr_lightning.model import LoopedLM

pytestmark = pytest.mark.usefixtures("one_thread")


class ShiftMixer(TokenMixer):
    """A user token mixer: each position sees itself and its predecessor (causal), no cache needed."""

    def __init__(self, config: ModelConfig, scale: float = 1.0) -> None:
        super().__init__(config)
        self.scale = scale
        self.proj = nn.Linear(config.d_model, config.d_model, bias=False)

    @override
    def forward(self, x: Tensor, ctx: LoopContext, layer: int) -> Tensor:
        prev = torch.cat((torch.zeros_like(x[:, :1]), x[:, :-1]), dim=1)
        return self.scale * self.proj(x + prev)


class ReplayMixer(ChannelMixer):
    """Keeps a per-token tensor from loop 1 and replays it at later loops; adds an auxiliary loss."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.inner = SwiGLU(config)
        self.seen: list[tuple[int, int, bool]] = []

    @override
    def forward(self, x: Tensor, ctx: LoopContext, layer: int) -> Tensor:
        if ctx.loop <= 1:
            ctx.scratch(layer)["route"] = x.argmax(-1)
        route = ctx.scratch(layer, min(ctx.loop, 1))["route"]
        self.seen.append((layer, ctx.loop, bool(torch.equal(route, ctx.scratch(layer, min(ctx.loop, 1))["route"]))))
        ctx.add_aux_loss("balance", x.pow(2).mean())
        return self.inner(x, ctx, layer)


def _pre_refactor_keys(config: ModelConfig, conditioner: LoopConditioner) -> list[str]:
    """The state-dict names of the dense model as the pre-seam ``Block`` (attn/mlp, norms, modulators) named them."""
    layer = ["attn_norm.weight", "attn.q.weight", "attn.kv.weight", "attn.o.weight"]
    layer += ["mlp_norm.weight", "mlp.up.weight", "mlp.down.weight"]
    modulator = list(conditioner.make_modulator(config.d_model).state_dict())
    modulated = layer + [f"{m}.{k}" for m in ("attn_mod", "mlp_mod") for k in modulator]
    from elr_lightning.updates import AdaptiveDelta

    update = AdaptiveDelta()
    update.build(config.d_model)
    keys = ["embed.weight"] + [f"input_layers.{j}.{k}" for j in range(config.n_in) for k in layer]
    keys += [f"core.update.{k}" for k in update.state_dict()]
    keys += [f"core.conditioner.{k}" for k in conditioner.state_dict()]
    keys += [f"core.layers.{j}.{k}" for j in range(config.n_rec) for k in modulated]
    keys += [f"output_layers.{j}.{k}" for j in range(config.n_out) for k in modulated]
    return keys + ["norm.weight", "head.weight"]


def test_state_dict_keys_of_the_dense_model_are_unchanged() -> None:
    config = tiny_config(n_rec=2)
    conditioner = LoopConditioner(d_cond=8, rank=2)
    model = LoopedLM(config, conditioner=conditioner)
    assert list(model.state_dict()) == _pre_refactor_keys(config, conditioner)


def test_layer_numbering_is_one_place() -> None:
    cfg = tiny_config(n_in=2, n_rec=3, n_out=1)
    model = LoopedLM(cfg)
    indices = [b.index for b in (*model.input_layers, *model.core.layers, *model.output_layers)]
    assert indices == list(range(6))
    calls = list(cfg.layer_calls(2))
    expected = [(0, 0), (1, 0), (2, 1), (3, 1), (4, 1), (2, 2), (3, 2), (4, 2), (5, 0)]
    assert [(layer, loop) for layer, loop, _ in calls] == expected


def test_user_token_mixer_by_class_path_and_pattern() -> None:
    cfg = tiny_config(
        n_rec=2,
        token_pattern=["shift", "attention"],
        n_in=2,
        n_out=2,
        mixers={"shift": {"class_path": f"{__name__}.ShiftMixer", "init_args": {"scale": 0.5}}},
    )
    model = LoopedLM(cfg)
    kinds = [type(b.attn).__name__ for b in model.core.layers]
    assert kinds == ["ShiftMixer", "Attention"] and model.core.layers[0].attn.scale == 0.5
    x = torch.randint(0, cfg.vocab_size, (2, 9))
    full = model(x, 3)
    assert torch.allclose(model(x[:, :5], 3), full[:, :5], atol=1e-5)  # causal


def test_channel_mixer_state_across_loops_and_aux_loss() -> None:
    cfg = tiny_config(channel_pattern=[f"{__name__}.ReplayMixer"])
    model = LoopedLM(cfg)
    aux: dict[str, Tensor] = {}
    model(torch.randint(0, cfg.vocab_size, (1, 5)), 3, aux_losses=aux)
    rec = model.core.layers[0].mlp
    assert [(layer, loop) for layer, loop, _ in rec.seen] == [(1, 1), (1, 2), (1, 3)]
    assert all(same for *_, same in rec.seen)
    assert set(aux) == {"balance"} and aux["balance"].requires_grad and aux["balance"] > 0


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(token_pattern=["nope"]), "unknown mixer 'nope'"),
        (dict(token_pattern=["no.such.Class"]), "unknown mixer"),
        (dict(token_pattern=["attention", "attention"], n_in=2, n_rec=3, n_out=2), "arch.n_rec=3"),
        (dict(channel_pattern=["attention"]), "arch.channel_pattern"),
        (dict(token_pattern=["swiglu"]), "arch.token_pattern"),
        (dict(token_pattern=[]), "arch.token_pattern"),
        (dict(mixers={"x": {"class_path": "a.b", "bad": 1}}, token_pattern=["x"]), "arch.mixers.x"),
    ],
)
def test_bad_patterns_name_the_field(overrides: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field) as err:
        tiny_config(**overrides)
    assert "\n" not in str(err.value)


def test_bad_init_args_name_the_field() -> None:
    cfg = tiny_config(mixers={"shift": {"class_path": f"{__name__}.ShiftMixer", "init_args": {"scal": 1}}})
    with pytest.raises(ValueError, match=r"arch.mixers.shift.init_args"):
        LoopedLM(replace(cfg, token_pattern=["shift"]))


def test_folded_user_mixer_refuses_clearly() -> None:
    from elr_lightning.inference.fold import fold_conditioning

    cfg = tiny_config(mixers={"shift": f"{__name__}.ShiftMixer"}, token_pattern=["shift"])
    model = LoopedLM(cfg, conditioner=LoopConditioner(d_cond=8, rank=2))
    with pytest.raises(NotImplementedError, match="ShiftMixer"):
        fold_conditioning(model, 2)


def test_dense_model_output_is_unchanged_by_the_seams() -> None:
    """The per-loop cached forward equals the cache-free one (the single numbering drives both)."""
    from elr_lightning.inference.cache import PerLoopCache

    model = perturbed_model()
    x = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        full = model(x, 3)
        cache = PerLoopCache(8)
        first = model(x[:, :6], 3, cache=cache)
        rest = model(x[:, 6:], 3, cache=cache)
    assert torch.allclose(torch.cat((first, rest), 1), full, atol=1e-5)


def _documented_block(language: str, first_line: str) -> str:
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "extending.md").read_text()
    blocks = re.findall(rf"```{language}\n(.*?)```", page, flags=re.S)
    return next(b for b in blocks if b.startswith(first_line))


@pytest.mark.slow
def test_the_documented_mixer_trains_from_yaml_and_decodes(tmp_path, monkeypatch) -> None:
    """The extending guide's user mixer, from its own package, trained by ``elr fit`` from the guide's YAML."""
    import sys

    import yaml

    from elr_lightning.cli import main
    from elr_lightning.inference.generate import generate, load_model

    (tmp_path / "my_lab").mkdir()
    (tmp_path / "my_lab" / "__init__.py").write_text("")
    (tmp_path / "my_lab" / "mixers.py").write_text(_documented_block("python", "# my_lab/mixers.py"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("ELR_TRUST_MODULES", "my_lab")  # loading the checkpoint imports the user's layer, as documented
    for name in [m for m in sys.modules if m == "my_lab" or m.startswith("my_lab.")]:  # another test's my_lab
        monkeypatch.delitem(sys.modules, name)
    head = "model:\n  class_path: elr_lightning.ELRModule\n  init_args:\n    arch:"
    arch = yaml.safe_load(_documented_block("yaml", head))
    arch = arch["model"]["init_args"]["arch"]
    arch.update(vocab_size=256, d_model=32, n_heads=2, n_in=2, n_rec=2, n_out=2, max_seq_len=32, max_loops=2)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 200)
    config = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "max_steps": 3, "limit_val_batches": 1, "val_check_interval": 3,
                    "logger": False, "enable_progress_bar": False, "enable_model_summary": False,
                    "default_root_dir": str(tmp_path / "run")},
        "model": {"class_path": "elr_lightning.ELRModule", "init_args": {"arch": arch, "warmup_steps": 1,
                  "sampler": {"class_path": "elr_lightning.sampling.UniformLoops", "init_args": {"max_loops": 2}}}},
        "data": {"class_path": "elr_lightning.data.TextDataModule",
                 "init_args": {"sources": [str(corpus)], "seq_len": 16, "batch_size": 4, "val_batches": 1,
                               "cache_dir": str(tmp_path / "cache")}},
    }  # fmt: skip
    try:
        path = tmp_path / "run.yaml"
        path.write_text(yaml.safe_dump(config))
        main(["fit", "--config", str(path)])
        ckpt = next((tmp_path / "run").rglob("*.ckpt"))
        model, _ = load_model(str(ckpt))
        assert type(model.core.layers[0].attn).__name__ == "CausalConv"
        assert model.core.layers[0].attn.kernel.abs().sum() > 0
        out = generate(model, [[1, 2, 3, 4, 5]], loops=2, max_new_tokens=6, greedy=True, output_logits=True)
        with torch.no_grad():
            full = model(out.sequences[:, :-1], 2)[:, 4:]
        torch.testing.assert_close(out.logits, full, atol=1e-4, rtol=0)
        assert out.cache.state_nbytes() > 0
    finally:  # leave no my_lab behind for other tests (test_plugins has its own)
        for name in [m for m in sys.modules if m == "my_lab" or m.startswith("my_lab.")]:
            del sys.modules[name]
