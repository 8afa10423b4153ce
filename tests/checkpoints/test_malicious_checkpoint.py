"""A checkpoint is data: hostile files through every entry point run none of their code.

Each hostile file (:mod:`_malicious`) leaves a marker file behind if any of its code runs: a pickle
whose ``__reduce__`` runs code; checkpoints that name a module whose import runs code, as a plug-in,
as a layer and inside a YAML string; sharded folders whose DCP index or ``meta.pt`` is such a
pickle; an ``elr export`` folder whose ``config.json`` names such a module. The Python loaders run
in this process; the ``elr`` commands run as a user runs them, in subprocesses (slow). No marker may
appear, and each refusal is one line naming what was refused and the way out.
"""

from __future__ import annotations

import copy
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightning.pytorch.callbacks import ModelCheckpoint

import _malicious as hostile
from _forked_cli import run_commands
from conftest import REPO_ROOT, quiet_trainer, switch_module
from test_cli_errors import TINY_CONFIG
from elr_lightning.callbacks import AtomicModelCheckpoint
from elr_lightning.callbacks.delayed_mixed_depth import load_weights_where_present
from elr_lightning.checkpoints.io import AtomicCheckpointIO, read_sharded_checkpoint, upgrade_checkpoint, verify_checkpoint_path
from elr_lightning.config import ModelConfig
from elr_lightning.data import TextDataModule
from elr_lightning.inference.generate import load_model
from elr_lightning.hf.export import export_hf, import_hf
from elr_lightning.model import LoopedLM
from elr_lightning.module import ELRModule
from elr_lightning.checkpoints.safe_load import UnsafeCheckpointError
from elr_lightning.tokenizers import ByteTokenizer
from elr_lightning.checkpoints.schema import CheckpointConfigError
from elr_lightning.checkpoints.trust import UntrustedModuleError

ROOT = REPO_ROOT


#: What the victim file outside every run folder holds; no entry point may change it.
VICTIM_TEXT = "a file of the user's, outside every run folder\n"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every hostile file, in one folder that also holds the module they name and an ``elr fit`` config."""
    root = tmp_path_factory.mktemp("hostile")
    hostile.write_evil_module(root)
    (root / "tiny.yaml").write_text(TINY_CONFIG)
    (root / "corpus.txt").write_text("".join(f"line {i}: {i * 7919 % 1000}\n" for i in range(300)))
    victim = root / "victim.txt"
    victim.write_text(VICTIM_TEXT)
    torch.manual_seed(0)
    export = export_hf(LoopedLM(ModelConfig(**hostile.ARCH)), ByteTokenizer(), root / "export")
    return {
        "root": root,
        "victim": victim,
        "pickle": hostile.pickled_payload(root / "pickle.ckpt"),
        "plugin": hostile.untrusted_plugin(root / "plugin.ckpt"),
        "mixer": hostile.untrusted_mixer(root / "mixer.ckpt"),
        "in_a_string": hostile.untrusted_in_a_string(root / "in_a_string.ckpt"),
        "popen_in_mixers": hostile.any_typed(root / "popen_in_mixers.ckpt", "mixers", hostile.popen()),
        "popen_in_rope": hostile.any_typed(root / "popen_in_rope.ckpt", "rope_scaling", hostile.popen()),
        "file_handler": hostile.any_typed(root / "file_handler.ckpt", "rope_scaling", hostile.file_handler(victim)),
        "long_class_path": hostile.long_class_path(root / "long_class_path.ckpt"),
        "legacy_hparams": hostile.legacy_key(root / "legacy_hparams.ckpt", "hparams"),
        "legacy_module_arguments": hostile.legacy_key(root / "legacy_module_arguments.ckpt", "module_arguments"),
        "sharded_index": hostile.sharded(root / "sharded_index", "metadata"),
        "sharded_meta": hostile.sharded(root / "sharded_meta", "meta"),
        "sharded_os_system": hostile.sharded_os_system(root / "sharded_os_system"),
        "sharded_bytes_entry": hostile.sharded_bytes_entry(root / "sharded_bytes_entry"),
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
    assert files["victim"].read_text() == VICTIM_TEXT, "a file outside the run folder was changed"


#: The refusal each kind of hostile file gets, as (exception type, a string of its message).
REFUSED = {
    "pickle": (UnsafeCheckpointError, "holds a pickled object (exec)"),
    "plugin": (UntrustedModuleError, "names 'elr_evil_plugin.Update' (hyper_parameters.update.class_path)"),
    "mixer": (UntrustedModuleError, "names 'elr_evil_plugin.Mixer' (hyper_parameters.arch.mixers.attention)"),
    "in_a_string": (CheckpointConfigError, "hyper_parameters.sampler.init_args.after: a LoopSampler is given as"),
    "popen_in_mixers": (
        UntrustedModuleError, "names 'subprocess.Popen' (hyper_parameters.arch.mixers.payload.class_path)"
    ),
    "popen_in_rope": (CheckpointConfigError, "hyper_parameters.arch.rope_scaling.payload: a mapping where a free-form"),
    "file_handler": (CheckpointConfigError, "hyper_parameters.arch.rope_scaling.payload: a mapping where a free-form"),
    "long_class_path": (
        UntrustedModuleError, "(hyper_parameters.update.class_path), and resolving it would import the module 'elr_evil_plugin'"
    ),
    "legacy_hparams": (UntrustedModuleError, "names 'elr_evil_plugin.Update' (hparams.update.class_path)"),
    "legacy_module_arguments": (
        UntrustedModuleError, "names 'elr_evil_plugin.Update' (module_arguments.update.class_path)"
    ),
    "sharded_index": (UnsafeCheckpointError, "its .metadata names builtins.exec"),
    "sharded_meta": (UnsafeCheckpointError, "holds a pickled object (exec)"),
    "sharded_os_system": (UnsafeCheckpointError, "its .metadata names torch.distributed.checkpoint.metadata.os.system"),
    "sharded_bytes_entry": (UnsafeCheckpointError, "its entry 'state_dict.model.embed.weight' holds a pickled object (exec)"),
}

#: The Python entry points: name -> (loader, the hostile files it takes).
FILES = (
    "pickle", "plugin", "mixer", "in_a_string", "popen_in_mixers", "popen_in_rope", "file_handler", "long_class_path",
    "legacy_hparams", "legacy_module_arguments",
)  # fmt: skip
FOLDERS = ("sharded_index", "sharded_meta", "sharded_os_system")
LOADERS: dict[str, tuple[Callable[[Path], Any], tuple[str, ...]]] = {
    "load_model": (lambda p: load_model(str(p)), FILES + FOLDERS),
    "load_model(meta=True)": (lambda p: load_model(str(p), meta=True), FILES + FOLDERS),
    "ELRModule.load_from_checkpoint": (ELRModule.load_from_checkpoint, FILES),
    "lm-eval adapter": (lambda p: _lm_eval_adapter()(ckpt_path=str(p)), FILES + FOLDERS),
    "AtomicCheckpointIO.load_checkpoint": (lambda p: AtomicCheckpointIO().load_checkpoint(p), ("pickle",)),
    "read_sharded_checkpoint": (lambda p: read_sharded_checkpoint(str(p)), FOLDERS),
    "verify_checkpoint_path": (lambda p: verify_checkpoint_path(str(p)), ("sharded_index", "sharded_os_system")),
    "init_from": (
        lambda p: load_weights_where_present(LoopedLM(ModelConfig(**hostile.ARCH)), str(p)), ("pickle",)
    ),
    "upgrade_checkpoint without trust": (lambda p: upgrade_checkpoint(str(p), str(p) + ".new"), ("pickle",)),
}
CASES = [(loader, kind) for loader, (_, kinds) in LOADERS.items() for kind in kinds]


def _lm_eval_adapter() -> Any:
    pytest.importorskip("lm_eval")
    from elr_lightning.eval.adapter import ELRLM

    return ELRLM


@pytest.mark.parametrize("loader, kind", CASES, ids=[f"{loader}-{kind}" for loader, kind in CASES])
def test_python_loaders_refuse_a_hostile_checkpoint_without_running_it(
    loader: str, kind: str, files: dict[str, Path], marker: Path
) -> None:
    error, says = REFUSED[kind]
    with pytest.raises(error) as info:
        LOADERS[loader][0](files[kind])
    message = str(info.value)
    assert says in message and "\n" not in message and len(message) < 700
    assert ("elr upgrade-checkpoint" in message) == (kind in ("pickle", "sharded_meta"))
    if error is UntrustedModuleError and "elr_evil_plugin" in says:
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
        for kind in ("pickle", "sharded_index", "sharded_meta", "sharded_os_system", "sharded_bytes_entry"):
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
    *((command, "popen_in_mixers") for command in ("generate", "serve", "eval", "export")),
    *((command, "file_handler") for command in ("generate", "serve", "eval", "export")),
    *((command, kind) for kind in ("popen_in_rope", "long_class_path", "legacy_hparams", "legacy_module_arguments")
      for command in ("generate",)),
    *((command, "sharded_os_system") for command in (
        "generate", "serve", "eval", "export", "fit --ckpt_path", "validate --ckpt_path", "upgrade-checkpoint",
    )),
]  # fmt: skip


@pytest.fixture(scope="module")
def command_results(files: dict[str, Path]) -> dict[tuple[str, str], tuple[subprocess.CompletedProcess, bool]]:
    """Each case's command in its own process and folder (forked from one that imported the CLI once: 42 imports of
    Lightning took 6 minutes of CPU time), its hostile module importable from the folder of the files."""
    root = files["root"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{root}", "OMP_NUM_THREADS": "1"}
    for name in ("ELR_DEBUG", "ELR_TRUST_MODULES", hostile.MARKER_ENV):
        env.pop(name, None)
    jobs = []
    for i, (command, kind) in enumerate(COMMAND_CASES):
        cwd = root / "runs" / f"{command}-{kind}".replace(" ", "_").replace("-", "_")
        cwd.mkdir(parents=True)
        (cwd / "corpus.txt").write_text((root / "corpus.txt").read_text())
        args = _commands(str(files[kind]), 18700 + i, str(root / "tiny.yaml"))[command]
        jobs.append({"args": args, "cwd": cwd, "env": {hostile.MARKER_ENV: str(cwd / "MARKER")}})
    procs = run_commands(jobs, env)
    return {case: (proc, (job["cwd"] / "MARKER").exists()) for case, proc, job in zip(COMMAND_CASES, procs, jobs)}


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
    if command == "upgrade-checkpoint" and kind == "pickle":
        refused = "holds a pickled object (exec): converting it runs code from the file. Add --trust"
    # serve reads the library's own record of the architecture first: the same value, under elr.arch
    assert refused in said[0] or (command == "serve" and refused.replace("hyper_parameters.arch", "elr.arch") in said[0])


@pytest.mark.slow
def test_no_command_changed_a_file_outside_its_run_folder(
    files: dict[str, Path], command_results: dict[tuple[str, str], tuple[subprocess.CompletedProcess, bool]]
) -> None:
    """The FileHandler payload would empty the victim file: after every command above it holds what it held."""
    assert len(command_results) == len(COMMAND_CASES)
    assert files["victim"].read_text() == VICTIM_TEXT


# ---- files a checkpoint's state names ---------------------------------------------------------------


def _resume_trainer(dirpath: Path, callback_class: type, max_steps: int, top_k: int) -> pl.Trainer:
    callback = callback_class(dirpath=str(dirpath), monitor="step", mode="max", every_n_train_steps=1,
                              save_top_k=top_k, save_last=True)  # fmt: skip
    return quiet_trainer(max_steps=max_steps, limit_val_batches=0, callbacks=[callback], enable_checkpointing=True)


@pytest.mark.parametrize("callback_class", [ModelCheckpoint, AtomicModelCheckpoint])
def test_a_resumed_run_never_deletes_a_file_its_checkpoint_names_outside_the_run_folder(
    tmp_path: Path, callback_class: type
) -> None:
    """Checkpoint-callback state naming ``<run>/checkpoints/../../victim.txt`` deleted it at the end of ``fit``."""
    ckpt_dir = tmp_path / "run" / "checkpoints"
    data = TextDataModule(seq_len=16, batch_size=4, max_bytes=20000, cache_dir=str(tmp_path / "cache"))
    _resume_trainer(ckpt_dir, callback_class, 4, -1).fit(switch_module(conditioner=False), data)
    victims = [tmp_path / f"victim{i}.txt" for i in range(4)]
    for victim in victims:
        victim.write_text(VICTIM_TEXT)
    raw = torch.load(ckpt_dir / "epoch=0-step=2.ckpt", weights_only=True)
    (state,) = [v for k, v in raw["callbacks"].items() if "Checkpoint" in k]
    dotted = [str(ckpt_dir / ".." / ".." / victim.name) for victim in victims]  # lexically below the folder
    state.update(last_model_path=dotted[0], best_model_path=dotted[1], kth_best_model_path=dotted[2],
                 best_k_models={dotted[2]: torch.tensor(0.0), dotted[3]: torch.tensor(1.0)})  # fmt: skip
    hostile_path = tmp_path / "hostile.ckpt"
    torch.save(raw, hostile_path)
    with pytest.warns(UserWarning, match=r"names 4 file\(s\) outside the run's checkpoint folder .*ignored") as seen:
        _resume_trainer(ckpt_dir, callback_class, 4, 1).fit(switch_module(conditioner=False), data, ckpt_path=hostile_path)
    assert all("\n" not in str(w.message) for w in seen if "outside the run" in str(w.message))
    assert [victim.read_text() for victim in victims] == [VICTIM_TEXT] * 4
    assert (ckpt_dir / "last.ckpt").is_file()


# ---- a real checkpoint's configuration, mutated at random ----------------------------------------------

#: Names a mutation draws from: modules imported or not, whose import or call acts, and the library's own.
HEADS = ["this", "antigravity", "subprocess", "os", "logging", "builtins", "unittest", "http", hostile.EVIL_MODULE,
         "elr_lightning", "torch", "collections"]  # fmt: skip
TAILS = ["Popen", "system", "FileHandler", "exec", "__main__", "server", "Update", "Mixer", "Sampler", "updates",
         "sampling", "FixedDelta", "OneLoopOverride", "path", "nn", "Module"]  # fmt: skip
CLASS_PATHS = st.one_of(
    st.lists(st.sampled_from(HEADS), min_size=1, max_size=1).flatmap(
        lambda head: st.lists(st.sampled_from(TAILS), min_size=1, max_size=3).map(lambda tail: ".".join(head + tail))
    ),
    st.integers(min_value=513, max_value=3000).map(lambda n: f"{hostile.EVIL_MODULE}." + "A" * n),
    st.sampled_from(["subprocess.Popen", "os.system", "builtins.exec", "logging.FileHandler",
                     f"{hostile.EVIL_MODULE}.Update", "elr_lightning.updates.FixedDelta"]),  # fmt: skip
)
SPECS = st.recursive(
    st.builds(lambda path: {"class_path": path, "init_args": {}}, CLASS_PATHS),
    lambda inner: st.builds(
        lambda path, nested: {"class_path": path, "init_args": {"after": nested, "inner": [nested], "beta": 0.5}},
        CLASS_PATHS, inner,
    ),
    max_leaves=4,
)
VALUES = st.one_of(
    SPECS,
    CLASS_PATHS,
    CLASS_PATHS.map(lambda path: f"class_path: {path}"),  # a YAML string naming a class
    st.dictionaries(st.sampled_from(["payload", "rope_type", "factor", "class_path"]), SPECS | CLASS_PATHS, max_size=2),
    st.lists(CLASS_PATHS | SPECS, max_size=2),
)
#: Where a mutation writes: every place Lightning or the library reads a class or a value from.
WHERE = [
    ("hyper_parameters", "update"), ("hyper_parameters", "sampler"), ("hyper_parameters", "conditioner"),
    ("hyper_parameters", "sampler", "init_args", "after"), ("hyper_parameters", "arch", "mixers", "x"),
    ("hyper_parameters", "arch", "mixers", "attention"), ("hyper_parameters", "arch", "rope_scaling"),
    ("hyper_parameters", "arch", "token_pattern"), ("hyper_parameters", "lr_scale"), ("hyper_parameters", "val_loops"),
    ("hyper_parameters", "_class_path"), ("hyper_parameters", "_instantiator"), ("hparams", "update"),
    ("module_arguments", "sampler"), ("elr", "arch", "mixers", "attention"), ("elr", "arch", "channel_pattern"),
    ("elr", "tokenizer"), ("hyper_parameters", "unknown_key"),
]  # fmt: skip


@pytest.fixture(scope="module")
def real_checkpoint(files: dict[str, Path]) -> dict[str, Any]:
    raw = hostile.cli_checkpoint(files["root"] / "real.ckpt")
    raw["hyper_parameters"]["sampler"] = {
        "class_path": "elr_lightning.callbacks.delayed_mixed_depth.DelayedSampler",
        "init_args": {"after": {"class_path": "elr_lightning.sampling.OneLoopOverride", "init_args": {"max_loops": 2}},
                      "switch_step": 1},
    }  # fmt: skip
    torch.save(raw, files["root"] / "real.ckpt")
    load_model(str(files["root"] / "real.ckpt"), meta=True)  # the library's own modules, imported once
    return raw


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.sampled_from(WHERE), value=VALUES)
def test_a_mutated_checkpoint_imports_nothing_outside_the_library(
    where: tuple[str, ...], value: Any, real_checkpoint: dict[str, Any], files: dict[str, Path], marker: Path
) -> None:
    raw = copy.deepcopy(real_checkpoint)
    node = raw
    for key in where[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            return
    node[where[-1]] = value
    path = files["root"] / "mutated.ckpt"
    torch.save(raw, path)
    before = set(sys.modules)
    try:
        load_model(str(path), meta=True)
    except (CheckpointConfigError, UntrustedModuleError) as err:
        assert "\n" not in str(err) and len(str(err)) < 1000
    except ValueError:
        pass  # a value the schema allows that a constructor refuses: still data, nothing imported
    new = set(sys.modules) - before
    assert all(name == "elr_lightning" or name.startswith("elr_lightning.") for name in new), new
    assert not marker.exists() and hostile.EVIL_MODULE not in sys.modules
