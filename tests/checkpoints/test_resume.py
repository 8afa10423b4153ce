"""Exact resume through the delayed switch, refusal of unfit or damaged checkpoints, atomic checkpoint writes."""

from __future__ import annotations

import copy
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import pytest
import torch
import yaml

from elr_lightning.callbacks import AtomicModelCheckpoint, DelayedMixedDepth, ZeroInitConditioning
from elr_lightning.checkpoints.io import AtomicCheckpointIO, CorruptCheckpointError
from conftest import REPO_ROOT, SWITCH_ARCH, quiet_trainer, switch_module
from elr_lightning.data import TextDataModule
from elr_lightning.module import ELRModule

ROOT = REPO_ROOT
ARCH = SWITCH_ARCH
#: The kill-and-resume run's model: a Gated DeltaProduct recurrent layer between attention layers.
HYBRID_ARCH = {**SWITCH_ARCH, "token_pattern": {"in": ["attention"], "rec": ["gdp"], "out": ["attention"]}}


def make_module(conditioner: bool = True, **arch: Any) -> ELRModule:
    """The shared switch-test module (see conftest)."""
    return switch_module(conditioner, **arch)


def fit(module: ELRModule, tmp_path: Path, max_steps: int, ckpt_path: Optional[str] = None) -> pl.Trainer:
    callbacks = [AtomicModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True, every_n_train_steps=1)]
    if module.model.conditioner is not None:
        callbacks += [DelayedMixedDepth(switch_step=1), ZeroInitConditioning()]
    trainer = quiet_trainer(max_steps=max_steps, limit_val_batches=0, callbacks=callbacks, enable_checkpointing=True)
    data = TextDataModule(seq_len=16, batch_size=4, max_bytes=20000, cache_dir=str(tmp_path / "cache"))
    trainer.fit(module, data, ckpt_path=ckpt_path, weights_only=True)
    return trainer


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """``last.ckpt`` of a two-step run of the tiny model with conditioning, through the switch at step 1."""
    fit(make_module(), tmp_path, max_steps=2)
    return tmp_path / "ckpt" / "last.ckpt"


# ---- refusals ----------------------------------------------------------------------------------
def test_a_checkpoint_of_another_architecture_is_refused(saved, tmp_path):
    with pytest.raises(ValueError, match=r"arch\.d_model: checkpoint 32, this model 64") as err:
        fit(make_module(d_model=64), tmp_path / "b", max_steps=3, ckpt_path=str(saved))
    assert "differ in shape" in str(err.value)
    with pytest.raises(ValueError, match=r"arch\.max_loops: checkpoint 3, this model 4"):
        fit(make_module(max_loops=4), tmp_path / "c", max_steps=3, ckpt_path=str(saved))


def test_heads_into_a_model_without_them_and_back_are_refused(saved, tmp_path):
    with pytest.raises(ValueError, match=r"checkpoint has \d+ conditioning tensor\(s\) this model lacks"):
        fit(make_module(conditioner=False), tmp_path / "b", max_steps=3, ckpt_path=str(saved))
    relaxed = make_module(conditioner=False)
    relaxed.strict_loading = False
    relaxed.on_load_checkpoint(torch.load(saved, weights_only=True))
    fit(make_module(conditioner=False), tmp_path / "plain", max_steps=1)
    plain = tmp_path / "plain" / "ckpt" / "last.ckpt"
    with pytest.raises(ValueError, match=r"this model has \d+ conditioning tensor\(s\) the checkpoint lacks"):
        fit(make_module(), tmp_path / "c", max_steps=3, ckpt_path=str(plain))


def test_a_truncated_checkpoint_is_refused_clearly(saved, tmp_path):
    broken = tmp_path / "broken.ckpt"
    data = saved.read_bytes()
    broken.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match="truncated or corrupt"):
        fit(make_module(), tmp_path / "b", max_steps=3, ckpt_path=str(broken))
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    broken.write_bytes(bytes(flipped))
    with pytest.raises(CorruptCheckpointError, match="broken.ckpt"):
        AtomicCheckpointIO().load_checkpoint(broken, weights_only=True)


def test_a_write_cut_short_leaves_the_old_checkpoint_intact(saved, monkeypatch):
    before = saved.read_bytes()
    real_save = torch.save

    def dies_halfway(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        real_save(obj, f, *args, **kwargs)
        f.truncate(f.tell() // 2)
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(1000)}}, saved)
    assert saved.read_bytes() == before
    assert os.listdir(saved.parent) == [saved.name] or all(not n.startswith(".") for n in os.listdir(saved.parent))
    monkeypatch.undo()
    AtomicCheckpointIO().save_checkpoint({"w": torch.ones(3)}, saved)
    assert torch.equal(torch.load(saved)["w"], torch.ones(3))


def test_last_link_survives_the_removal_of_its_target(tmp_path):
    checkpoint = AtomicModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last="link", every_n_train_steps=1)
    trainer = quiet_trainer(max_steps=3, limit_val_batches=0, callbacks=[checkpoint], enable_checkpointing=True)
    module = make_module(conditioner=False)
    trainer.fit(module, TextDataModule(seq_len=16, batch_size=4, max_bytes=20000, cache_dir=str(tmp_path / "cache")))
    assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    last, target = tmp_path / "ckpt" / "last.ckpt", tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    assert not last.is_symlink() and os.path.samefile(last, target)
    target.unlink()  # what top-k bookkeeping does just before relinking
    assert torch.load(last, weights_only=True)["global_step"] == 3


# ---- a real run killed twice and resumed -------------------------------------------------------
RECORDER = '''
"""Test helper loaded by the `elr fit` subprocesses of tests/checkpoints/test_resume.py."""
import faulthandler
import json
import os
import time

import torch
from lightning.pytorch.callbacks import Callback

from elr_lightning.callbacks.zero_init_conditioning import conditioning_parameters


class StopAt(Callback):
    """Ends the run after optimizer step ``step`` (its checkpoint written), as a kill would, without
    shortening max_steps (which sets the LR schedule and the switch)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.step:
            trainer.should_stop = True


class Recorder(Callback):
    """One JSON line per step and rank; final weights per rank; a watchdog against hangs."""

    def __init__(self, out: str, pause: float = 0.0, watchdog_s: float = 120.0) -> None:
        self.out, self.pause = out, pause
        faulthandler.dump_traceback_later(watchdog_s, exit=True)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.step = trainer.global_step
        conditioner = pl_module.model.conditioner
        self.active = conditioner.active
        optimizer = trainer.optimizers[0]
        self.cond_state = sum(p in optimizer.state for p in conditioning_parameters(pl_module))
        self.switch_equal = None
        if self.active and self.cond_state == 0:
            probe = torch.arange(24).reshape(2, 12) % 200
            with torch.no_grad():
                on = [pl_module(probe, k) for k in (1, 2, 3)]
                conditioner.set_active(False)
                off = [pl_module(probe, k) for k in (1, 2, 3)]
                conditioner.set_active(True)
            self.switch_equal = all(torch.equal(a, b) for a, b in zip(on, off))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        line = {
            "step": self.step,
            "rank": trainer.global_rank,
            "loss": float(outputs["loss"]),
            "multiplier": float(trainer.callback_metrics["train/compute_multiplier"]),
            "loops": pl_module.local_loops(self.step),
            "active": self.active,
            "cond_state": self.cond_state,
            "switch_equal": self.switch_equal,
        }
        with open(os.path.join(self.out, f"steps.rank{trainer.global_rank}.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\\n")
            f.flush()
            os.fsync(f.fileno())
        time.sleep(self.pause)

    def on_train_end(self, trainer, pl_module):
        state = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in pl_module.model.state_dict().items()
        }
        torch.save(state, os.path.join(self.out, f"final.rank{trainer.global_rank}.pt"))
        faulthandler.cancel_dump_traceback_later()
'''


#: The ELR strategies under test, as YAML ``trainer.strategy`` entries (short collective timeouts).
STRATEGIES = {
    "ddp": {
        "class_path": "elr_lightning.strategies.OneLoopOverrideDDPStrategy",
        "init_args": {"timeout": "0:00:30", "check_schedule_every_n_steps": 1},
    },
    "fsdp": {
        "class_path": "elr_lightning.strategies.OneLoopOverrideFSDPStrategy",
        "init_args": {"timeout": "0:00:30", "check_schedule_every_n_steps": 1, "save_distributed_checkpoint": False},
    },
}


def write_run(
    folder: Path,
    steps: int,
    switch: int,
    devices: int = 1,
    pause: float = 0.0,
    strategy: str = "ddp",
    switch_at_step: bool = False,
    sharded: bool = False,
    arch: Optional[dict[str, Any]] = None,
    cpu_offload: bool = False,
) -> Path:
    """A YAML for ``elr fit``: tiny model, delayed switch, checkpoints every step, a recorder.

    ``switch_at_step`` gives the switch as ``switch_step`` (not a fraction of ``steps``), so a run
    may stop before it and be resumed with more steps; ``sharded`` has the FSDP strategy write
    sharded (folder) checkpoints, ``cpu_offload`` offload its shards to the host."""
    folder.mkdir(parents=True)
    (folder / "elr_test_recorder.py").write_text(RECORDER)
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": devices,
            "precision": 32,
            "deterministic": True,
            "max_steps": steps,
            "val_check_interval": 4,
            "check_val_every_n_epoch": None,
            "num_sanity_val_steps": 0,
            "logger": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "callbacks": [
                {
                    "class_path": "elr_lightning.callbacks.AtomicModelCheckpoint",
                    "init_args": {"dirpath": str(folder / "ckpt"), "save_last": "link", "every_n_train_steps": 1},
                },
                {
                    "class_path": "elr_lightning.callbacks.DelayedMixedDepth",
                    "init_args": {"switch_step": switch} if switch_at_step else {"switch_fraction": switch / steps},
                },
                {"class_path": "elr_lightning.callbacks.ZeroInitConditioning"},
                {"class_path": "elr_lightning.callbacks.ComputeAccounting"},
                {"class_path": "elr_test_recorder.Recorder", "init_args": {"out": str(folder), "pause": pause}},
            ],
        },
        "model": {
            "class_path": "elr_lightning.ELRModule",
            "init_args": {
                "arch": ARCH if arch is None else arch,
                "sampler": {
                    "class_path": "elr_lightning.sampling.OneLoopOverride",
                    "init_args": {"max_loops": 3, "override_fraction": 0.5},
                },
                "conditioner": {
                    "class_path": "elr_lightning.conditioning.LoopConditioner",
                    "init_args": {"d_cond": 8, "rank": 2, "n_freqs": 2},
                },
                "virtual_ranks": 2 // devices,
                "warmup_steps": 2,
                "lr": 0.01,
            },
        },
        "data": {
            "class_path": "elr_lightning.data.TextDataModule",
            "init_args": {
                "seq_len": 16,
                "batch_size": 4 // devices,
                "max_bytes": 700,
                "val_batches": 1,
                "cache_dir": str(folder.parent / "cache"),
            },
        },
    }
    if devices > 1:
        config["trainer"]["strategy"] = copy.deepcopy(STRATEGIES[strategy])
        if sharded:
            config["trainer"]["strategy"]["init_args"]["save_distributed_checkpoint"] = True
        if cpu_offload:
            config["trainer"]["strategy"]["init_args"]["cpu_offload"] = True
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def launch(
    config: Path, ckpt_path: Optional[Path] = None, env: Optional[dict[str, str]] = None, extra: Optional[list[str]] = None
) -> subprocess.Popen:
    args = [sys.executable, "-m", "elr_lightning.cli", "fit", "--config", str(config), *(extra or [])]
    if ckpt_path is not None:
        args += ["--ckpt_path", str(ckpt_path)]
    full_env = {**os.environ, "PYTHONPATH": f"{config.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    full_env.update(env or {})
    return subprocess.Popen(
        args, cwd=config.parent, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )


def finish(proc: subprocess.Popen, timeout: float = 120) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"elr fit hung:\n{out.decode()[-4000:]}") from None
    text = out.decode()
    assert proc.returncode == 0, text[-4000:]
    return text


def read_steps(folder: Path, rank: int = 0) -> list[dict[str, Any]]:
    path = folder / f"steps.rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def kill_after(proc: subprocess.Popen, folder: Path, step: int, delay: float, timeout: float = 120) -> None:
    """SIGKILL the run ``delay`` seconds after it has logged ``step``."""
    deadline = time.monotonic() + timeout
    while not any(line["step"] >= step for line in read_steps(folder)):
        assert proc.poll() is None, f"the run ended before step {step}: {proc.communicate()[0].decode()[-3000:]}"
        assert time.monotonic() < deadline, "the run did not reach the kill step in time"
        time.sleep(0.005)
    time.sleep(delay)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def by_step(lines: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """One record per step; a step re-run after a kill must repeat its record exactly."""
    steps: dict[int, dict[str, Any]] = {}
    for line in lines:
        if line["step"] in steps:
            assert steps[line["step"]] == line, f"step {line['step']} differs when re-run after a kill"
        steps[line["step"]] = line
    return steps


@pytest.mark.slow
def test_a_run_killed_before_and_after_the_switch_resumes_exactly(tmp_path):
    """With a hybrid model (GDP recurrent layer, attention input and output layers)."""
    steps, switch = 16, 8
    straight = write_run(tmp_path / "straight", steps, switch, arch=HYBRID_ARCH)
    finish(launch(straight))
    reference = by_step(read_steps(straight.parent))
    assert sorted(reference) == list(range(steps))

    rng = random.Random(2024)
    kills = [rng.randint(2, switch - 3), rng.randint(switch + 1, steps - 3)]
    killed = write_run(tmp_path / "killed", steps, switch, pause=0.15, arch=HYBRID_ARCH)
    last = killed.parent / "ckpt" / "last.ckpt"
    resumed_from = []
    for i, kill in enumerate(kills):
        proc = launch(killed, last if i else None)
        kill_after(proc, killed.parent, kill, delay=rng.uniform(0.0, 0.2))
        resumed_from.append(torch.load(last, weights_only=True)["global_step"])
    finish(launch(killed, last))
    assert resumed_from[0] < switch < resumed_from[1], resumed_from

    replay = by_step(read_steps(killed.parent))
    assert sorted(replay) == list(range(steps))
    for step in range(steps):
        assert replay[step] == reference[step], f"step {step}: {replay[step]} != {reference[step]}"
    assert [reference[s]["active"] for s in range(steps)] == [s >= switch for s in range(steps)]
    assert reference[switch]["switch_equal"] is True
    assert all(reference[s]["loops"] == [1, 1] for s in range(switch))
    a = torch.load(straight.parent / "final.rank0.pt")
    b = torch.load(killed.parent / "final.rank0.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def single_process_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The two-process runs' reference: one process, the same global batch as two virtual ranks."""
    single = write_run(tmp_path_factory.mktemp("single") / "run", 8, 4)
    finish(launch(single))
    return single.parent


@pytest.mark.slow
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_the_switch_under_two_processes(strategy, single_process_run, tmp_path):
    steps, switch = 8, 4
    run = write_run(tmp_path / strategy, steps, switch, devices=2, strategy=strategy)
    port = str(free_port())
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2", "NODE_RANK": "0", "OMP_NUM_THREADS": "1"}
    procs = [launch(run, env={**env, "LOCAL_RANK": str(r)}) for r in range(2)]
    try:
        for proc in procs:
            finish(proc)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)

    reference = by_step(read_steps(single_process_run))
    for rank in range(2):
        lines = by_step(read_steps(run.parent, rank))
        assert [lines[s]["active"] for s in range(steps)] == [s >= switch for s in range(steps)]
        assert all(lines[s]["cond_state"] == 0 for s in range(switch + 1)), "heads got AdamW state before the switch"
        assert lines[switch]["switch_equal"] is True
        for s in range(steps):
            assert lines[s]["loops"] == reference[s]["loops"][rank : rank + 1], f"step {s}: rank {rank}'s k"
    states = [torch.load(run.parent / f"final.rank{r}.pt") for r in range(2)]
    reference_state = torch.load(single_process_run / "final.rank0.pt")
    for key, value in states[0].items():
        assert torch.equal(value, states[1][key]), f"{key} drifted apart between the ranks"
        assert torch.allclose(value.float(), reference_state[key].float(), atol=2e-5), key
    heads = [k for k in states[0] if k.endswith(("film.weight", "omega.weight"))]
    assert heads and all(torch.count_nonzero(states[0][k]) > 0 for k in heads)


def _two_processes(run: Path, *extra: str, ckpt_path: Optional[Path] = None) -> None:
    port = str(free_port())
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2", "NODE_RANK": "0", "OMP_NUM_THREADS": "1"}
    procs = [launch(run, ckpt_path, env={**env, "LOCAL_RANK": str(r)}, extra=list(extra)) for r in range(2)]
    try:
        for proc in procs:
            finish(proc)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)


def _stop_at(run: Path, step: int) -> list[str]:
    """Command-line arguments that add ``StopAt(step)`` to ``run``'s callbacks."""
    stop = run.parent / f"stop{step}.yaml"
    stop.write_text(yaml.safe_dump({"trainer": {"callbacks+": [{"class_path": "elr_test_recorder.StopAt",
                                                                  "init_args": {"step": step}}]}}))  # fmt: skip
    return ["--config", str(stop)]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sharded", "stops", "cpu_offload"),
    [(True, (4, 6), False), (False, (2,), False), (True, (6,), True)],
    ids=["sharded", "full", "sharded_offloaded"],
)
def test_fsdp_resumes_exactly_from_a_checkpoint(sharded, stops, cpu_offload, single_process_run, tmp_path):
    """Stop a 2-process FSDP run before the switch at 4 (the heads have no AdamW state yet): with
    sharded checkpoints at step 4 and again at step 6 after it, with a full checkpoint at step 2
    (its resumed steps 2 and 3 run before ``ZeroInitConditioning`` clears the heads' state at the
    switch), and with the shards and AdamW's state offloaded to the host (``cpu_offload``), a
    sharded checkpoint at step 6. Resume each time from that checkpoint and finish at step 8: the
    same loop counts and final weights as one process run straight through, and no AdamW state for
    the heads until their first gradient."""
    run = write_run(
        tmp_path / "run", 8, 4, devices=2, strategy="fsdp", switch_at_step=True, sharded=sharded, cpu_offload=cpu_offload
    )
    ckpt_path = None
    for step in stops:
        _two_processes(run, *_stop_at(run, step), ckpt_path=ckpt_path)
        ckpt_path = run.parent / "ckpt" / f"epoch=0-step={step}.ckpt"
        written = (ckpt_path / ".metadata").is_file() if sharded else ckpt_path.is_file()
        assert written, sorted(p.name for p in (run.parent / "ckpt").iterdir())
    _two_processes(run, ckpt_path=ckpt_path)
    reference = by_step(read_steps(single_process_run))
    for rank in range(2):
        lines = by_step(read_steps(run.parent, rank))
        assert sorted(lines) == list(range(8))
        assert [lines[s]["active"] for s in range(8)] == [s >= 4 for s in range(8)]
        assert all(lines[s]["cond_state"] == 0 for s in range(5)), "heads got AdamW state before their first gradient"
        assert lines[4]["switch_equal"] is True
        assert all(lines[s]["cond_state"] > 0 for s in range(5, 8))
        for s in range(8):
            assert lines[s]["loops"] == reference[s]["loops"][rank : rank + 1], f"step {s}: rank {rank}'s k"
    states = [torch.load(run.parent / f"final.rank{r}.pt") for r in range(2)]
    reference_state = torch.load(single_process_run / "final.rank0.pt")
    for key, value in states[0].items():
        assert torch.equal(value, states[1][key]), f"{key} drifted apart between the ranks"
        assert torch.allclose(value.float(), reference_state[key].float(), atol=2e-5), key
