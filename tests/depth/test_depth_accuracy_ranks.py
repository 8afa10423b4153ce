"""``DepthAccuracy`` in a run of two processes: every rank scores, so a sharded model never waits for a partner."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO_ROOT

ROOT = REPO_ROOT

STRATEGIES = {
    "ddp": "elr_lightning.strategies.OneLoopOverrideDDPStrategy",
    "fsdp": "elr_lightning.strategies.OneLoopOverrideFSDPStrategy",
}


def _config(folder: Path, strategy: str) -> Path:
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 2,
            "max_steps": 2,
            "val_check_interval": 2,
            "check_val_every_n_epoch": None,
            "limit_val_batches": 1,
            "num_sanity_val_steps": 0,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "enable_checkpointing": False,
            "default_root_dir": str(folder),
            "strategy": {"class_path": STRATEGIES[strategy], "init_args": {"timeout": "0:00:30"}},
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(folder)}},
            "callbacks": [
                {"class_path": "elr_lightning.callbacks.DepthAccuracy", "init_args": {"n": 4, "loops": [1, 2]}}
            ],
        },
        "model": {
            "class_path": "elr_lightning.ELRModule",
            "init_args": {
                "arch": {"vocab_size": 13, "d_model": 16, "n_heads": 2, "n_in": 0, "n_rec": 1, "n_out": 0,
                         "max_seq_len": 32, "max_loops": 2},  # fmt: skip
                "sampler": {"class_path": "elr_lightning.sampling.OneLoopOverride", "init_args": {"max_loops": 2}},
                "warmup_steps": 1,
            },
        },
        "data": {
            "class_path": "elr_lightning.depth.DepthDataModule",
            "init_args": {"task": "root", "difficulty": 2, "batch_size": 8, "val_batches": 1},
        },
    }
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_depth_accuracy_scores_on_every_rank_without_a_hang(tmp_path: Path, strategy: str) -> None:
    config = _config(tmp_path, strategy)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "elr_lightning.cli", "fit", "--config", str(config)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"the run hung:\n{proc.communicate()[0].decode()[-3000:]}") from None
    assert proc.returncode == 0, out.decode()[-3000:]
    (metrics,) = tmp_path.glob("lightning_logs/version_*/metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    scored = [row for row in rows if row.get("val_depth/d2/exact_k2")]
    assert len(scored) == 1 and 0.0 <= float(scored[0]["val_depth/d2/exact_k1"]) <= 100.0
