"""Which modules a checkpoint may name: checked without importing, and the user's ways to trust their own."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import elr_lightning.trust as trust
from elr_lightning.cli import main
from elr_lightning.config import ModelConfig
from elr_lightning.generation import load_model
from elr_lightning.hf.export import save_module_checkpoint
from elr_lightning.module import ELRModule
from elr_lightning.trust import UntrustedModuleError, check_checkpoint_names, trust_modules, untrusted_import
from elr_lightning.updates import FixedDelta

ROOT = Path(__file__).resolve().parents[1]
ARCH = dict(vocab_size=256, d_model=16, n_heads=2, n_in=1, n_rec=1, n_out=0, max_seq_len=32, max_loops=2)

#: First components of the names drawn: imported or not, importable or not, packages with a
#: ``__main__`` (importing ``unittest.__main__`` runs a test discovery) and modules whose import acts.
HEADS = ["this", "antigravity", "unittest", "json", "os", "elr_lightning", "collections", "no_such_module_x", "xml",
         "tkinter", "http", "email", "torch", "idlelib", "pydoc_data", "lib2to3", "sqlite3"]  # fmt: skip
TAILS = ["__main__", "tool", "server", "path", "updates", "abc", "dom", "minidom", "Foo", "mime", "text", "nn",
         "idle", "topics", "dbapi2", "main"]  # fmt: skip


@given(st.sampled_from(HEADS), st.lists(st.sampled_from(TAILS), min_size=1, max_size=3))
def test_checking_a_name_imports_nothing_and_finds_what_an_import_would_run(head: str, tails: list[str]) -> None:
    name = ".".join([head, *tails])
    before = set(sys.modules)
    found = untrusted_import(name, ["elr_lightning"])
    new = set(sys.modules) - before
    assert all(importlib.util.find_spec(m).origin is None for m in new), new  # namespace packages run nothing
    if found is not None:
        assert name == found or name.startswith(found + ".")
        assert found not in sys.modules and importlib.util.find_spec(found) is not None
        assert all(".".join(name.split(".")[:i]) in sys.modules for i in range(1, found.count(".") + 1))
    elif not name.startswith("elr_lightning."):
        # Every prefix is imported, or the first one that is not cannot be found: no import would run code.
        prefixes = [".".join(name.split(".")[:i]) for i in range(1, len(name.split(".")) + 1)]
        first = next((p for p in prefixes if p not in sys.modules), None)
        assert first is None or _unfindable(first)


def _unfindable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError, AttributeError):
        return True


def test_a_package_main_module_is_refused_though_its_package_is_imported() -> None:
    assert "unittest" in sys.modules  # pytest imports it
    assert untrusted_import("unittest.__main__.main", []) == "unittest.__main__"
    assert untrusted_import("this.Foo", []) == "this"
    assert untrusted_import("os.path.join", []) is None
    assert untrusted_import("elr_lightning.no.such.Thing", ["elr_lightning"]) is None


def test_lightning_checkpoints_name_only_their_allowed_instantiator(tmp_path: Path) -> None:
    """A LightningCLI checkpoint names ``lightning.pytorch.cli.instantiate_module``, which Lightning
    allows by that exact name; it is accepted even before ``lightning.pytorch.cli`` is imported, and
    any other instantiator is checked like every other name."""
    script = (
        "import sys; from elr_lightning.trust import check_checkpoint_names, UntrustedModuleError\n"
        "assert 'lightning.pytorch.cli' not in sys.modules\n"
        "hp = {'_instantiator': 'lightning.pytorch.cli.instantiate_module', '_class_path': 'elr_lightning.ELRModule'}\n"
        "check_checkpoint_names({'hyper_parameters': hp}, 'x.ckpt')\n"
        "try:\n"
        "    check_checkpoint_names({'hyper_parameters': {'_instantiator': 'lightning.pytorch.cli.other'}}, 'x.ckpt')\n"
        "except UntrustedModuleError as err:\n"
        "    print(err)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "would import the module 'lightning.pytorch.cli'" in out.stdout


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
    "{class_path: elr_lightning.X, init_args: {a: [this.Foo]}}",  # deeper in
    "- x\n- {class_path: this.Foo}",
])  # fmt: skip
def test_a_class_path_hidden_in_a_yaml_string_is_found(hidden: str) -> None:
    assert "this" not in sys.modules
    data = {"hyper_parameters": {"sampler": {"class_path": "elr_lightning.X", "init_args": {"after": hidden}}}}
    with pytest.raises(UntrustedModuleError, match=r"would import the module 'this'"):
        check_checkpoint_names(data, "x.ckpt")


def test_strings_that_name_nothing_importable_pass(tmp_path: Path) -> None:
    """Data that merely looks dotted (file names, numbers) is not a class path anyone could import."""
    check_checkpoint_names({"hyper_parameters": {"a": "corpus.txt", "b": "1.5", "c": ["x.y.z", {"d": "torch.float32"}]}}, "x")
