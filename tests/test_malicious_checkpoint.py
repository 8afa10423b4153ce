"""A checkpoint is data: hostile files through every entry point run none of their code.

Each hostile file (:mod:`_malicious`) leaves a marker file behind if any of its code runs: a pickle
whose ``__reduce__`` runs code; checkpoints that name a module whose import runs code, as a plug-in,
as a layer and inside a YAML string; sharded folders whose DCP index or ``meta.pt`` is such a
pickle; an ``elr export`` folder whose ``config.json`` names such a module. The Python loaders run
in this process; the ``elr`` commands run as a user runs them, in subprocesses (slow). No marker may
appear, and each refusal is one line naming what was refused and the way out.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import _malicious as hostile
from test_cli_errors import TINY_CONFIG
from elr_lightning.callbacks.delayed_mixed_depth import load_weights_where_present
from elr_lightning.checkpoint_io import AtomicCheckpointIO, read_sharded_checkpoint, upgrade_checkpoint, verify_checkpoint_path
from elr_lightning.config import ModelConfig
from elr_lightning.generation import load_model
from elr_lightning.hf.export import export_hf, import_hf
from elr_lightning.model import LoopedLM
from elr_lightning.module import ELRModule
from elr_lightning.safe_load import UnsafeCheckpointError
from elr_lightning.tokenizers import ByteTokenizer
from elr_lightning.trust import UntrustedModuleError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every hostile file, in one folder that also holds the module they name and an ``elr fit`` config."""
    root = tmp_path_factory.mktemp("hostile")
    hostile.write_evil_module(root)
    (root / "tiny.yaml").write_text(TINY_CONFIG)
    (root / "corpus.txt").write_text("".join(f"line {i}: {i * 7919 % 1000}\n" for i in range(300)))
    torch.manual_seed(0)
    export = export_hf(LoopedLM(ModelConfig(**hostile.ARCH)), ByteTokenizer(), root / "export")
    return {
        "root": root,
        "pickle": hostile.pickled_payload(root / "pickle.ckpt"),
        "plugin": hostile.untrusted_plugin(root / "plugin.ckpt"),
        "mixer": hostile.untrusted_mixer(root / "mixer.ckpt"),
        "in_a_string": hostile.untrusted_in_a_string(root / "in_a_string.ckpt"),
        "sharded_index": hostile.sharded(root / "sharded_index", "metadata"),
        "sharded_meta": hostile.sharded(root / "sharded_meta", "meta"),
        "hf_config": hostile.hf_export_naming_untrusted_mixer(root / "hf_evil", export),
    }


@pytest.fixture
def marker(files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The marker file of one test; the hostile module is importable (on ``sys.path``), as on a user's machine."""
    path = tmp_path / "MARKER"
    monkeypatch.setenv(hostile.MARKER_ENV, str(path))
    monkeypatch.syspath_prepend(str(files["root"]))
    monkeypatch.delenv("ELR_TRUST_MODULES", raising=False)
    yield path
    assert not path.exists(), "code from a hostile file ran"
    assert hostile.EVIL_MODULE not in sys.modules


#: The refusal each kind of hostile file gets, as (exception type, a string of its message).
REFUSED = {
    "pickle": (UnsafeCheckpointError, "holds a pickled object (exec)"),
    "plugin": (UntrustedModuleError, "names 'elr_evil_plugin.Update' (hyper_parameters.update.class_path)"),
    "mixer": (UntrustedModuleError, "names 'elr_evil_plugin.Mixer' (hyper_parameters.arch.mixers.attention)"),
    "in_a_string": (
        UntrustedModuleError, "names 'elr_evil_plugin.Sampler' (hyper_parameters.sampler.init_args.after.class_path)"
    ),
    "sharded_index": (UnsafeCheckpointError, "its .metadata names builtins.exec"),
    "sharded_meta": (UnsafeCheckpointError, "holds a pickled object (exec)"),
}

#: The Python entry points: name -> (loader, the hostile files it takes).
FILES = ("pickle", "plugin", "mixer", "in_a_string")
FOLDERS = ("sharded_index", "sharded_meta")
LOADERS: dict[str, tuple[Callable[[Path], Any], tuple[str, ...]]] = {
    "load_model": (lambda p: load_model(str(p)), FILES + FOLDERS),
    "load_model(meta=True)": (lambda p: load_model(str(p), meta=True), FILES + FOLDERS),
    "ELRModule.load_from_checkpoint": (ELRModule.load_from_checkpoint, FILES),
    "AtomicCheckpointIO.load_checkpoint": (lambda p: AtomicCheckpointIO().load_checkpoint(p), ("pickle",)),
    "read_sharded_checkpoint": (lambda p: read_sharded_checkpoint(str(p)), FOLDERS),
    "verify_checkpoint_path": (lambda p: verify_checkpoint_path(str(p)), ("sharded_index",)),
    "init_from": (
        lambda p: load_weights_where_present(LoopedLM(ModelConfig(**hostile.ARCH)), str(p)), ("pickle",)
    ),
    "upgrade_checkpoint without trust": (lambda p: upgrade_checkpoint(str(p), str(p) + ".new"), ("pickle",)),
}
CASES = [(loader, kind) for loader, (_, kinds) in LOADERS.items() for kind in kinds]


@pytest.mark.parametrize("loader, kind", CASES, ids=[f"{loader}-{kind}" for loader, kind in CASES])
def test_python_loaders_refuse_a_hostile_checkpoint_without_running_it(
    loader: str, kind: str, files: dict[str, Path], marker: Path
) -> None:
    error, says = REFUSED[kind]
    with pytest.raises(error) as info:
        LOADERS[loader][0](files[kind])
    message = str(info.value)
    assert says in message and "\n" not in message
    assert ("elr upgrade-checkpoint" in message) == (kind in ("pickle", "sharded_meta"))
    if error is UntrustedModuleError:
        assert "--trust_module elr_evil_plugin" in message and "ELR_TRUST_MODULES=elr_evil_plugin" in message


def test_an_export_naming_an_untrusted_layer_is_refused_before_importing_it(
    files: dict[str, Path], marker: Path
) -> None:
    with pytest.raises(UntrustedModuleError, match=r"config.json' names 'elr_evil_plugin.Mixer' \(elr_arch.mixers.attention\)"):
        import_hf(files["hf_config"])


def test_an_explicit_weights_only_false_is_the_callers_trust(files: dict[str, Path], marker: Path) -> None:
    """Lightning's own switch still unpickles when a caller passes it (no loader of the library does)."""
    ELRModule.load_from_checkpoint(files["pickle"], weights_only=False)
    assert marker.read_text() == "code from the file ran"
    marker.unlink()  # the fixture checks that nothing else ran


def test_the_fsdp_strategy_resumes_from_no_hostile_checkpoint(files: dict[str, Path], marker: Path) -> None:
    """``OneLoopOverrideFSDPStrategy.load_checkpoint`` (``fit --ckpt_path`` under FSDP) in a one-rank group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from elr_lightning.strategies import OneLoopOverrideFSDPStrategy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        for kind in ("pickle", "sharded_index", "sharded_meta"):
            module = ELRModule(arch=ModelConfig(**hostile.ARCH))
            fully_shard(module.model, mesh=mesh)
            strategy = OneLoopOverrideFSDPStrategy()
            strategy._lightning_module = module
            strategy.model = module
            error, says = REFUSED[kind]
            with pytest.raises(error, match=re.escape(says)):
                strategy.load_checkpoint(files[kind])
    finally:
        dist.destroy_process_group()


# ---- the elr commands, as a user runs them ----------------------------------------------------------

CLI = [sys.executable, "-m", "elr_lightning.cli"]
INIT_FROM = "{class_path: elr_lightning.callbacks.DelayedMixedDepth, init_args: {init_from: %s}}"


def _commands(path: str, port: int, config: str) -> dict[str, list[str]]:
    return {
        "generate": ["generate", "--ckpt_path", path, "--prompt", "ab", "--max_new_tokens", "2"],
        "serve": ["serve", "--ckpt_path", path, "--port", str(port)],
        "eval": ["eval", "--ckpt_path", path, "--loops", "1", "--limit", "1", "--output_dir", "evalout"],
        "export": ["export", "--ckpt_path", path, "--out", "exp"],
        "fit --ckpt_path": ["fit", "--config", config, "--ckpt_path", path],
        "validate --ckpt_path": ["validate", "--config", config, "--ckpt_path", path],
        "fit init_from": ["fit", "--config", config, "--trainer.callbacks+", INIT_FROM % path],
        "upgrade-checkpoint": ["upgrade-checkpoint", path, "new.ckpt"],
        "import --hf": ["import", "--hf", path, "--out", "x.ckpt"],
    }


#: (command, hostile file) pairs: the pickle through every command that opens a checkpoint, each
#: other kind through the commands that resolve what it names (and one that only resumes from it).
COMMAND_CASES = [
    *((command, "pickle") for command in (
        "generate", "serve", "eval", "export", "fit --ckpt_path", "validate --ckpt_path", "fit init_from",
        "upgrade-checkpoint",
    )),
    *((command, "plugin") for command in ("generate", "serve", "eval", "export")),
    *((command, "mixer") for command in ("generate", "serve", "export")),
    ("generate", "in_a_string"),
    *((command, "sharded_index") for command in ("generate", "serve", "fit --ckpt_path")),
    *((command, "sharded_meta") for command in ("generate", "serve", "export")),
    ("import --hf", "hf_config"),
]  # fmt: skip


def _run(root: Path, command: str, kind: str, path: Path, port: int) -> tuple[subprocess.CompletedProcess, bool]:
    cwd = root / "runs" / f"{command}-{kind}".replace(" ", "_").replace("-", "_")
    cwd.mkdir(parents=True)
    (cwd / "corpus.txt").write_text((root / "corpus.txt").read_text())
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{root}", "OMP_NUM_THREADS": "1",
           hostile.MARKER_ENV: str(cwd / "MARKER")}  # fmt: skip
    for name in ("ELR_DEBUG", "ELR_TRUST_MODULES"):
        env.pop(name, None)
    args = _commands(str(path), port, str(root / "tiny.yaml"))[command]
    proc = subprocess.run([*CLI, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    return proc, (cwd / "MARKER").exists()


@pytest.fixture(scope="module")
def command_results(files: dict[str, Path]) -> dict[tuple[str, str], tuple[subprocess.CompletedProcess, bool]]:
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            (command, kind): pool.submit(_run, files["root"], command, kind, files[kind], 18700 + i)
            for i, (command, kind) in enumerate(COMMAND_CASES)
        }
        return {case: future.result() for case, future in futures.items()}


@pytest.mark.slow
@pytest.mark.parametrize("command, kind", COMMAND_CASES, ids=[f"{c}-{k}" for c, k in COMMAND_CASES])
def test_every_command_refuses_a_hostile_checkpoint_in_one_line_without_running_it(
    command: str, kind: str, command_results: dict[tuple[str, str], tuple[subprocess.CompletedProcess, bool]]
) -> None:
    proc, ran = command_results[(command, kind)]
    assert not ran, f"code from the file ran: {proc.stderr[-2000:]}"
    said = [line for line in proc.stderr.splitlines() if line.startswith("elr")]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout and "looks like a bug" not in proc.stderr
    assert len(said) == 1, proc.stderr[-3000:]
    refused = {"hf_config": "names 'elr_evil_plugin.Mixer' (elr_arch.mixers.attention)"}.get(kind) or REFUSED[kind][1]
    if command == "upgrade-checkpoint":
        refused = "holds a pickled object (exec): converting it runs code from the file. Add --trust"
    assert refused in said[0]
