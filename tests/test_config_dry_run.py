"""Every shipped config's first steps, run the way its own run will, at a test's size (issue 47).

Each ``config/*.yaml`` is read at test time and run through ``elr fit`` with its own strategy,
precision, activation checkpointing, ``cpu_offload``, ``meta_init``, gradient accumulation, delayed
switch and callbacks, the sanity check and a validation between steps (Lightning choosing the
evaluation context as on NCCL, :func:`_dist_worker.evaluation_as_on_nccl`), and a checkpoint at the
end. What changes is only what a CPU test needs: narrower and shallower models, a byte vocabulary and
a short standard-library corpus for text, fla's kernels left to ``auto`` (the torch path on CPU), the
CPU as accelerator and a 30 s collective timeout. A config meant for accelerators (``devices`` not
1) runs on two gloo ranks; a CPU config runs in this process, as it ships.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import _dist_worker
from elr_lightning.cli import run
from test_strategies import _free_port, wait_for

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "config").glob("*.yaml"))
WORKER = Path(__file__).resolve().parent / "_config_worker.py"
#: Optimizer steps: the delayed switch at 75% falls inside them, so both phases run.
STEPS = 4
WATCHDOG_S = 200
LAUNCH_TIMEOUT_S = 240


def _on_accelerators(config: dict[str, Any]) -> bool:
    return config["trainer"].get("devices", "auto") != 1


def _shrink_arch(arch: dict[str, Any], text: bool) -> None:
    """The config's layers, mixers, patterns and loop budget at width 32, each block cut to one period of its
    patterns, with at least 2 recurrent layers (``arch.token_pattern`` must divide each block's layer count)."""
    arch.update(d_model=32, n_heads=2)
    for block, key, least in (("in", "n_in", 1), ("rec", "n_rec", 2), ("out", "n_out", 1)):
        lengths = [len(p if isinstance(p, list) else p.get(block, [None])) for p in
                   (arch.get("token_pattern"), arch.get("channel_pattern")) if p]
        period = math.lcm(*lengths) if lengths else 1
        arch[key] = min(arch[key], period * -(-least // period))
    for key, value in (("n_kv_heads", 1), ("d_ff", 64)):
        if key in arch:
            arch[key] = value
    arch.pop("head_size", None)
    if text:
        arch.update(vocab_size=256, max_seq_len=64)
    for mixer in arch.get("mixers", {}).values():
        args = mixer.setdefault("init_args", {})
        if mixer["class_path"].endswith("GatedDeltaProduct"):
            args.update(num_heads=2, head_dim=16, kernels="auto")
        elif mixer["class_path"].endswith("MoE"):
            args.update(num_experts=min(args.get("num_experts", 8), 8), top_k=min(args.get("top_k", 2), 2), expert_dim=16)
            if args.get("shared_expert_dim"):
                args["shared_expert_dim"] = 16


def reduced(path: Path, out: Path, corpus: Path, devices: int) -> Path:
    """``path``'s config at a test's size, writing into ``out``; the YAML's path."""
    config = yaml.safe_load(path.read_text())
    trainer, model = config["trainer"], config["model"]["init_args"]
    data = config["data"].setdefault("init_args", {})
    accumulate = int(trainer.get("accumulate_grad_batches", 1))
    trainer.update(
        accelerator="cpu", devices=devices, num_nodes=1, max_steps=STEPS, limit_val_batches=1, num_sanity_val_steps=1,
        val_check_interval=2 * accumulate, log_every_n_steps=1, enable_progress_bar=False, default_root_dir=str(out),
    )
    if isinstance(trainer.get("strategy"), dict):
        trainer["strategy"].setdefault("init_args", {})["timeout"] = "0:00:30"
    if isinstance(trainer.get("logger"), dict):
        trainer["logger"].setdefault("init_args", {})["save_dir"] = str(out)
    callbacks = trainer.setdefault("callbacks", [])
    for callback in callbacks:
        args = callback.setdefault("init_args", {})
        if callback["class_path"].endswith("ModelCheckpoint"):
            args.update(every_n_train_steps=STEPS, dirpath=str(out / "checkpoints"))
        elif callback["class_path"].endswith("DepthAccuracy"):
            args["n"] = 8
    callbacks.append({"class_path": "_config_worker.DryRunRecord", "init_args": {"path": str(out / "record")}})
    # byte tokens and short windows for text; the synthetic tasks keep their vocabulary and lengths (a depth
    # task names its task, a reasoning instance may take the config's whole window)
    text = "task" not in data and "examples_per_level" not in data
    _shrink_arch(model["arch"], text)
    if model.get("conditioner"):
        model["conditioner"].setdefault("init_args", {}).update(d_cond=16, rank=4)
    model["warmup_steps"] = 1
    if "task" not in data:  # text: a short corpus, byte tokens, one validation batch
        data.update(tokenizer="byte", val_batches=1)
        if text:
            data["seq_len"] = min(data.get("seq_len", 64), 64)
        if "path" in data:  # prompt/completion pairs shipped beside the config
            data["path"] = str(ROOT / data["path"])
        else:
            data.update(sources=[str(corpus)], cache_dir=str(out / "cache"))
        if "examples_per_level" in data:
            data.update(examples_per_level=20, text_bytes=20_000)
    yaml_path = out / f"{path.stem}.yaml"
    yaml_path.write_text(yaml.safe_dump(config))
    return yaml_path


@pytest.fixture(scope="module")
def text_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dry_run") / "corpus.txt"
    path.write_text(inspect.getsource(argparse)[:30000], encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def accelerator_runs(text_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every accelerator config on two gloo ranks in one launch; ``{config: {"out", "errors"}}``."""
    root = tmp_path_factory.mktemp("accelerator_runs")
    configs = [p for p in CONFIGS if _on_accelerators(yaml.safe_load(p.read_text()))]
    cases = []
    for path in configs:
        (root / path.stem).mkdir()
        cases.append({"name": path.stem, "config": str(reduced(path, root / path.stem, text_corpus, devices=2))})
    spec_path = root / "spec.json"
    spec_path.write_text(json.dumps({"out": str(root), "watchdog_s": WATCHDOG_S, "cases": cases}))
    port, procs, logs = _free_port(), [], []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0", LOCAL_RANK=str(rank),
                   OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(WORKER.parent), env.get("PYTHONPATH", "")]))
        log = open(root / f"rank{rank}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(spec_path)], env=env, stdout=log, stderr=log,
                                      start_new_session=True, cwd=str(root)))
    wait_for(procs, logs, LAUNCH_TIMEOUT_S, "the shipped configs' dry run")
    return {
        case["name"]: {
            "out": root / case["name"],
            "errors": [json.loads((root / f"{case['name']}.error{r}.json").read_text())["error"] for r in range(2)],
        }
        for case in cases
    }


def _assert_ran(name: str, out: Path, ranks: int) -> None:
    for rank in range(ranks):
        record = json.loads((out / f"record.rank{rank}.json").read_text())
        assert record["steps"] == STEPS, (name, record["steps"])
        assert record["losses"] and all(math.isfinite(loss) for loss in record["losses"]), (name, record["losses"])
        sanity = [s for s, _ in record["evaluations"]]
        assert sanity[:1] == [True] and False in sanity, f"{name}: no sanity check, or no validation between steps"
        assert not any(inference for _, inference in record["evaluations"]), f"{name}: validated under inference mode"
    assert list((out / "checkpoints").glob("*.ckpt")), f"{name}: no checkpoint written"


@pytest.mark.slow
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_shipped_config_runs_its_first_steps(path: Path, text_corpus: Path, request, tmp_path) -> None:
    if _on_accelerators(yaml.safe_load(path.read_text())):
        run_ = request.getfixturevalue("accelerator_runs")[path.stem]
        for rank, error in enumerate(run_["errors"]):
            assert error is None, f"{path.name} failed on rank {rank}:\n{error}"
        _assert_ran(path.name, run_["out"], 2)
        return
    config = reduced(path, tmp_path, text_corpus, devices=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run; two threads on a busy machine spin many times slower
    try:
        with _dist_worker.evaluation_as_on_nccl():
            run(["fit", "--config", str(config)])
    finally:
        torch.set_num_threads(threads)
    _assert_ran(path.name, tmp_path, 1)
