"""The YAML `elr retrofit` writes trains under DDP on 2 processes (slow: two `elr fit` subprocesses)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("transformers")

from _bpe import stdlib_text  # noqa: E402
from test_resume import STRATEGIES, finish, free_port, launch  # noqa: E402
from test_retrofit import save_tiny  # noqa: E402
from elr_lightning.cli import run  # noqa: E402

STEPS = 4


@pytest.mark.slow
def test_retrofitted_qwen3_trains_under_ddp_on_two_processes(tmp_path: Path) -> None:
    source = save_tiny(tmp_path, "qwen3")
    run(["retrofit", "--hf", str(source), "--out", str(tmp_path / "r"), "--max_loops", "3", "--steps", str(STEPS),
         "--switch_fraction", "0.5", "--no_verify"])
    (tmp_path / "corpus.txt").write_text(stdlib_text(), encoding="utf-8")
    fit = yaml.safe_load((tmp_path / "r" / "retrofit.yaml").read_text())
    fit["trainer"].update(
        accelerator="cpu", devices=2, precision=32, logger=False, enable_progress_bar=False, val_check_interval=2,
        num_sanity_val_steps=0, strategy=STRATEGIES["ddp"], default_root_dir=str(tmp_path / "runs"),
    )
    fit["trainer"]["callbacks"] = [cb for cb in fit["trainer"]["callbacks"] if "LearningRateMonitor" not in cb["class_path"]]
    fit["trainer"]["callbacks"][0]["init_args"].update(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=STEPS)
    fit["model"]["init_args"]["virtual_ranks"] = 2
    fit["data"]["init_args"].update(
        sources=str(tmp_path / "corpus.txt"), seq_len=32, batch_size=4, val_batches=1, cache_dir=str(tmp_path / "cache")
    )
    config = tmp_path / "fit.yaml"
    config.write_text(yaml.safe_dump(fit))
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "NODE_RANK": "0", "OMP_NUM_THREADS": "1"}
    procs = [launch(config, env={**env, "LOCAL_RANK": str(r)}) for r in range(2)]
    try:
        logs = [finish(proc, timeout=240) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert "newly initialised: none" in logs[0]  # every weight, gate and heads included, came from the retrofit
    assert "k = 1 until step 2" in logs[0]
    last = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    start = torch.load(tmp_path / "r" / "retrofit.ckpt", weights_only=True)["state_dict"]
    assert last["global_step"] == STEPS
    trained = last["state_dict"]
    assert all(torch.isfinite(v).all() for v in trained.values() if v.is_floating_point())
    moved = [k for k in start if start[k].is_floating_point() and not torch.equal(start[k], trained[k])]
    assert "model.core.layers.0.attn.q_norm.weight" in moved and "model.core.update.gamma" in moved
