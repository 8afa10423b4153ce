"""Kill -9 and resume: ``elr prepare`` keeps its finished shards and ends byte-identical to a run
straight through; a 2-process DDP run on a prepared two-source mixture gets the same per-step losses
on every rank as a run straight through."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import torch
import yaml

from elr_lightning.data import PreparedFolder, prepare_corpus
from elr_lightning.tokenizers import ByteTokenizer
from test_prepare import tree
from test_resume import by_step, finish, free_port, launch, read_steps, write_run

STEPS, SWITCH, KILL_AFTER = 10, 5, 3


def prepared_sources(root: Path) -> list[str]:
    """'prose' (the stdlib's docstring-heavy modules as jsonl) and 'code' (other stdlib files), prepared."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prose = root / "prose.jsonl"
    prose.write_text(
        "".join(json.dumps({"text": (stdlib / n).read_text()[:3000]}) + "\n" for n in ("textwrap.py", "string.py")),
        encoding="utf-8",
    )
    folders = []
    for name, sources in (("prose", [str(prose)]), ("code", [str(stdlib / "bisect.py"), str(stdlib / "keyword.py")])):
        prepare_corpus(sources, str(root / name), val_fraction=0.0, shard_bytes=2000, progress=False)
        folders.append(str(root / name))
    return folders


def mixture_run(folder: Path, folders: list[str], pause: float) -> Path:
    """The shared test run of ``test_resume`` (2 processes, DDP), reading the weighted mixture."""
    config_path = write_run(folder, STEPS, SWITCH, devices=2, pause=pause)
    config = yaml.safe_load(config_path.read_text())
    config["trainer"]["limit_val_batches"] = 0
    config["data"] = {
        "class_path": "elr_lightning.data.PreparedDataModule",
        "init_args": {"folders": folders, "weights": [0.7, 0.3], "seq_len": 16, "batch_size": 2},
    }
    config_path.write_text(yaml.safe_dump(config))
    return config_path


def start(run: Path, ckpt_path: Path | None = None) -> list[subprocess.Popen]:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "NODE_RANK": "0"}
    return [launch(run, ckpt_path, env={**env, "OMP_NUM_THREADS": "1", "LOCAL_RANK": str(r)}) for r in range(2)]


def kill_all(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.slow
def test_a_killed_two_process_mixture_run_resumes_with_the_same_losses(tmp_path: Path) -> None:
    folders = prepared_sources(tmp_path)
    straight = mixture_run(tmp_path / "straight", folders, pause=0.0)
    procs = start(straight)
    try:
        for proc in procs:
            finish(proc, timeout=600)
    finally:
        kill_all(procs)

    killed = mixture_run(tmp_path / "killed", folders, pause=0.3)
    procs = start(killed)
    try:
        deadline = time.monotonic() + 600
        while not any(line["step"] >= KILL_AFTER for line in read_steps(killed.parent)):
            assert all(p.poll() is None for p in procs), "the run ended before the kill"
            assert time.monotonic() < deadline, "the run did not reach the kill step in time"
            time.sleep(0.01)
    finally:
        kill_all(procs)
    last = killed.parent / "ckpt" / "last.ckpt"
    resumed_from = torch.load(last, weights_only=True)["global_step"]
    assert KILL_AFTER <= resumed_from < STEPS, resumed_from
    procs = start(killed, last)
    try:
        for proc in procs:
            finish(proc, timeout=600)
    finally:
        kill_all(procs)

    for rank in range(2):
        reference = by_step(read_steps(straight.parent, rank))
        replay = by_step(read_steps(killed.parent, rank))  # a step re-run after the kill must repeat exactly
        assert sorted(reference) == sorted(replay) == list(range(STEPS))
        assert [replay[s]["loss"] for s in range(STEPS)] == [reference[s]["loss"] for s in range(STEPS)]


@pytest.mark.slow
def test_a_prepare_killed_with_sigkill_resumes_to_the_same_folder(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(300):
        (corpus / f"{i:03d}.txt").write_text(f"file {i}\n" + "".join(f"line {j} of {i}\n" for j in range(200)))
    command = "from elr_lightning.data.command import prepare_command; import sys; prepare_command(sys.argv[1:])"
    args = [sys.executable, "-c", command, str(corpus), "--shard_mb", "0.004", "--val_fraction", "0.1"]
    out = tmp_path / "killed"
    proc = subprocess.Popen([*args, "--out", str(out)], stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (out / "shards" / "00020.json").exists():
            assert proc.poll() is None, "prepare ended before the kill"
            assert time.monotonic() < deadline, "prepare did not reach shard 20 in time"
            time.sleep(0.005)
    finally:
        kill_all([proc])
    assert not (out / "index.json").exists(), "the kill came after the prepare had finished"
    with pytest.raises(ValueError, match=r"did not finish \(no index\.json\)"):
        PreparedFolder(str(out), ByteTokenizer())
    kept = {p.name: p.stat().st_mtime_ns for p in (out / "shards").glob("000[01]*.train.bin")}
    subprocess.run([*args, "--out", str(out), "--workers", "2"], check=True, capture_output=True, timeout=600)
    subprocess.run([*args, "--out", str(tmp_path / "straight")], check=True, capture_output=True, timeout=600)
    assert tree(out) == tree(tmp_path / "straight")
    assert len(kept) == 20 and all((out / "shards" / n).stat().st_mtime_ns == t for n, t in kept.items())
