"""Which code a checkpoint may name: trusted modules only, checked before any import, and the user's ways to trust their own."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import elr_lightning.checkpoints.trust as trust
from elr_lightning.checkpoints.schema import CheckpointConfigError, module_arguments
from elr_lightning.cli import main
from elr_lightning.config import ModelConfig
from elr_lightning.inference.generate import load_model
from elr_lightning.hf.export import save_module_checkpoint
from elr_lightning.module import ELRModule
from elr_lightning.checkpoints.trust import UntrustedModuleError, named_packages, trust_modules, trusted_class
from elr_lightning.updates import FixedDelta, StateUpdate
from conftest import REPO_ROOT

ROOT = REPO_ROOT
ARCH = dict(vocab_size=256, d_model=16, n_heads=2, n_in=1, n_rec=1, n_out=0, max_seq_len=32, max_loops=2)

#: First components of the names drawn: imported or not, importable or not, packages with a
#: ``__main__`` (importing ``unittest.__main__`` runs a test discovery) and modules whose import acts.
HEADS = ["this", "antigravity", "unittest", "json", "os", "subprocess", "logging", "collections", "no_such_module_x",
         "xml", "tkinter", "http", "email", "torch", "idlelib", "pydoc_data", "sqlite3", "elr_lightningx"]  # fmt: skip
TAILS = ["__main__", "tool", "server", "path", "updates", "abc", "dom", "minidom", "Foo", "mime", "text", "nn",
         "idle", "topics", "dbapi2", "main", "Popen", "system", "FileHandler"]  # fmt: skip


@given(st.sampled_from(HEADS), st.lists(st.sampled_from(TAILS), min_size=1, max_size=3))
def test_a_name_outside_the_trusted_modules_is_refused_without_importing_anything(head: str, tails: list[str]) -> None:
    """Imported or not (``os``, ``subprocess``, ``logging`` always are), a module outside the trusted ones is refused."""
    name = ".".join([head, *tails])
    before = set(sys.modules)
    with pytest.raises(UntrustedModuleError, match=rf"names '{name}' \(f\), and resolving it would import the module '{head}'"):
        trusted_class(name, StateUpdate, "f", "x.ckpt")
    assert set(sys.modules) == before


@pytest.mark.parametrize("name, says", [
    ("elr_lightning.updates.FixedDelta", None),
    ("elr_lightning.sampling.OneLoopOverride", "names OneLoopOverride, which is not a StateUpdate subclass"),
    ("elr_lightning.updates.no_such.Thing", "names nothing importable"),
    ("elr_lightning.checkpoints.trust.os.PathLike", "names PathLike, which is not a StateUpdate subclass"),
    ("elr_lightning.updates.math", "names a module, not a class"),
    ("not a class path", "is not a class path"),
])  # fmt: skip
def test_a_trusted_name_must_be_a_subclass_of_the_seam(name: str, says: str | None) -> None:
    if says is None:
        assert trusted_class(name, StateUpdate, "f", "x.ckpt") is FixedDelta
    else:
        with pytest.raises(ValueError, match=says):
            trusted_class(name, StateUpdate, "f", "x.ckpt")


def test_a_long_class_path_is_checked_like_any_other() -> None:
    """The trust check once skipped names over 512 characters: ``this.AAA...`` imported ``this``."""
    assert "this" not in sys.modules
    with pytest.raises(UntrustedModuleError, match=r"would import the module 'this'") as info:
        trusted_class("this." + "A" * 600, StateUpdate, "hyper_parameters.update.class_path", "x.ckpt")
    assert "this" not in sys.modules and len(str(info.value)) < 600  # the name is shown cut, on one line


def test_lightning_checkpoints_name_only_their_allowed_instantiator() -> None:
    """A LightningCLI checkpoint names ``lightning.pytorch.cli.instantiate_module``; the schema accepts it (and
    never calls it) even before ``lightning.pytorch.cli`` is imported, and refuses any other instantiator."""
    script = (
        "import sys; from elr_lightning.checkpoints.schema import module_arguments, CheckpointConfigError\n"
        "from elr_lightning.module import ELRModule\n"
        "assert 'lightning.pytorch.cli' not in sys.modules\n"
        "hp = {'_instantiator': 'lightning.pytorch.cli.instantiate_module', '_class_path': 'elr_lightning.ELRModule'}\n"
        "cls, args = module_arguments({'hyper_parameters': hp}, ELRModule, 'x.ckpt')\n"
        "assert cls is ELRModule and '_instantiator' not in args and 'lightning.pytorch.cli' not in sys.modules\n"
        "try:\n"
        "    module_arguments({'hyper_parameters': {'_instantiator': 'os.system'}}, ELRModule, 'x.ckpt')\n"
        "except CheckpointConfigError as err:\n"
        "    print(err)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "hyper_parameters._instantiator: 'os.system' is not Lightning's instantiator" in out.stdout


def test_an_untrusted_module_subclass_is_refused_by_class_path() -> None:
    with pytest.raises(UntrustedModuleError, match=r"hyper_parameters._class_path"):
        module_arguments({"hyper_parameters": {"_class_path": "my_lab.MyModule"}}, ELRModule, "x.ckpt")


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A user's own plug-in module (not yet imported), on ``sys.path``; untrusted until a test trusts it."""
    name = f"user_rules_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "from elr_lightning.updates import FixedDelta\n\nclass Update(FixedDelta):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(trust, "_trusted", set())
    monkeypatch.delenv(trust.TRUST_ENV, raising=False)
    yield name
    sys.modules.pop(name, None)


def _checkpoint_naming(module: str, path: Path) -> Path:
    """A checkpoint at ``path`` whose update rule is ``module.Update``; returns one of the same weights
    whose rule is the library's ``FixedDelta`` (the parent class), to compare logits with."""
    torch.manual_seed(0)
    save_module_checkpoint(ELRModule(arch=ModelConfig(**ARCH), update=FixedDelta(0.5)), path)
    raw = torch.load(path, weights_only=True)
    reference = path.with_suffix(".reference.ckpt")
    torch.save(raw, reference)
    raw["hyper_parameters"]["update"]["class_path"] = f"{module}.Update"
    torch.save(raw, path)
    return reference


def _same_logits(reference: Path, path: Path) -> None:
    ids = torch.arange(8)[None]
    model, module = load_model(str(path))
    assert type(module.model.update).__name__ == "Update" and module.model.update.beta == 0.5
    with torch.no_grad():
        torch.testing.assert_close(model(ids, 2), load_model(str(reference))[0](ids, 2), rtol=0, atol=0)


def test_a_users_own_plugin_loads_once_trusted_in_python(user_module: str, tmp_path: Path) -> None:
    path = tmp_path / "mine.ckpt"
    reference = _checkpoint_naming(user_module, path)
    with pytest.raises(UntrustedModuleError, match=rf"would import the module '{user_module}'.*--trust_module {user_module}"):
        load_model(str(path))
    assert user_module not in sys.modules
    trust_modules(user_module)
    _same_logits(reference, path)


def test_a_users_own_plugin_loads_once_trusted_by_environment(
    user_module: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "mine.ckpt"
    reference = _checkpoint_naming(user_module, path)
    monkeypatch.setenv(trust.TRUST_ENV, f"other, {user_module}")
    _same_logits(reference, path)


def test_generate_takes_trust_module(
    user_module: str, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "mine.ckpt"
    _checkpoint_naming(user_module, path)
    args = ["generate", "--ckpt_path", str(path), "--prompt", "ab", "--max_new_tokens", "3", "--seed", "1"]
    with pytest.raises(SystemExit):
        main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"add --trust_module {user_module}" in err[0]
    assert user_module not in sys.modules
    monkeypatch.setenv(trust.TRUST_ENV, "")  # registered, so the value the flag exports is undone afterwards
    main([*args, "--trust_module", user_module])
    assert capsys.readouterr().out.startswith("ab") and os.environ[trust.TRUST_ENV] == user_module


def test_a_name_that_is_not_a_module_name_is_refused() -> None:
    with pytest.raises(ValueError, match=r"trust_modules: 'my lab' is not a module name"):
        trust_modules("my lab")


@pytest.mark.parametrize("hidden", [
    "class_path: this.Foo",                                    # YAML, as jsonargparse reads a string
    '{"class_path": "this.Foo", "init_args": {}}',            # JSON
])  # fmt: skip
def test_a_class_path_in_a_string_is_data_where_a_seam_belongs_it_is_refused(hidden: str) -> None:
    """No string is ever read as YAML: in a seam's field it is refused, elsewhere it stays a string."""
    data = {"hyper_parameters": {"sampler": {
        "class_path": "elr_lightning.callbacks.delayed_mixed_depth.DelayedSampler",
        "init_args": {"after": hidden, "switch_step": 1},
    }}}  # fmt: skip
    with pytest.raises(CheckpointConfigError, match=r"sampler.init_args.after: a LoopSampler is given as \{class_path"):
        module_arguments(data, ELRModule, "x.ckpt")
    _, args = module_arguments({"hyper_parameters": {"activation_checkpointing": hidden}}, ELRModule, "x.ckpt")
    assert args["activation_checkpointing"] == hidden and "this" not in sys.modules


def test_named_packages_lists_every_package_a_config_names_as_code() -> None:
    config = {"update": {"class_path": "my_lab.rules.Update"}, "arch": {"mixers": {"conv": "other_lab.Conv"},
              "token_pattern": ["attention", "third.Mixer"]}, "sampler": {"class_path": "elr_lightning.sampling.X"}}  # fmt: skip
    assert named_packages(config) == ["my_lab", "other_lab", "third"]


class WithExtra(ELRModule):
    """A user's module that passes the library's arguments on through ``**kwargs``."""

    def __init__(self, extra: int = 1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.extra = extra


def test_a_subclass_taking_kwargs_has_them_checked_by_the_base_class(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(trust.TRUST_ENV, __name__)
    torch.manual_seed(0)
    save_module_checkpoint(WithExtra(extra=3, arch=ModelConfig(**ARCH), update=FixedDelta(0.5)), tmp_path / "x.ckpt")
    raw = torch.load(tmp_path / "x.ckpt", weights_only=True)
    raw["hyper_parameters"]["_class_path"] = f"{__name__}.WithExtra"
    torch.save(raw, tmp_path / "x.ckpt")
    loaded = ELRModule.load_from_checkpoint(tmp_path / "x.ckpt")
    assert type(loaded) is WithExtra and loaded.extra == 3 and loaded.model.update.beta == 0.5
    raw["hyper_parameters"]["arch"]["rope_scaling"] = {"payload": {"class_path": "subprocess.Popen"}}
    torch.save(raw, tmp_path / "x.ckpt")
    with pytest.raises(CheckpointConfigError, match=r"hyper_parameters.arch.rope_scaling.payload: a mapping where"):
        ELRModule.load_from_checkpoint(tmp_path / "x.ckpt")
