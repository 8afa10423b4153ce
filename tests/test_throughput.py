"""``TrainingThroughput``: tokens/s, FLOP/s from our FLOP accounting, MFU where a peak is known, peak memory."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import CSVLogger

from conftest import SWITCH_ARCH
from elr_lightning.callbacks import TrainingThroughput
from elr_lightning.conditioning import LoopConditioner
from elr_lightning.config import ModelConfig
from elr_lightning.data import TextDataModule
from elr_lightning.flops import train_flops_per_token
from elr_lightning.module import ELRModule
from elr_lightning.sampling import FixedLoops


def fit(tmp_path: Path, callback: TrainingThroughput, loops: int = 2) -> tuple[pl.Trainer, list[dict[str, str]]]:
    pl.seed_everything(0)
    module = ELRModule(
        ModelConfig(**SWITCH_ARCH), sampler=FixedLoops(loops),
        conditioner=LoopConditioner(d_cond=8, rank=2, n_freqs=2), virtual_ranks=2, warmup_steps=2,
    )  # fmt: skip
    trainer = pl.Trainer(
        max_steps=6, accelerator="cpu", devices=1, logger=CSVLogger(tmp_path / "logs"), log_every_n_steps=2,
        enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0, callbacks=[callback],
    )  # fmt: skip
    data = TextDataModule(seq_len=16, batch_size=4, max_bytes=20000, cache_dir=str(tmp_path / "cache"))
    trainer.fit(module, data)
    path = next((tmp_path / "logs").rglob("metrics.csv"))
    with open(path) as f:
        rows = [row for row in csv.DictReader(f) if row.get("throughput/tokens_per_s")]
    return trainer, rows


def test_flops_per_token_are_our_accounting_and_cpu_mfu_is_not_known(tmp_path: Path) -> None:
    trainer, rows = fit(tmp_path, TrainingThroughput())
    assert len(rows) >= 2  # every logging step after the first (a rate needs two)
    per_token = train_flops_per_token(trainer.lightning_module.arch, 2, 16, adapter_rank=2)
    for row in rows:
        tokens, flops = float(row["throughput/tokens_per_s"]), float(row["throughput/device/flops_per_s"])
        assert tokens > 0 and math.isclose(flops / tokens, per_token, rel_tol=1e-5)  # logged as float32
        assert float(row["throughput/device/peak_memory_gib"]) > 0
        assert not row.get("throughput/device/mfu")  # no peak FLOP/s known for a CPU
    assert "throughput/tokens_per_s" in trainer.progress_bar_metrics


def test_a_given_peak_gives_mfu(tmp_path: Path) -> None:
    trainer, rows = fit(tmp_path, TrainingThroughput(peak_flops=1e12))
    for row in rows:
        assert math.isclose(float(row["throughput/device/mfu"]), float(row["throughput/device/flops_per_s"]) / 1e12, rel_tol=1e-5)
    assert "throughput/device/mfu" in trainer.progress_bar_metrics


@pytest.mark.parametrize("peak", [0.0, -1.0])
def test_a_peak_that_is_not_positive_is_refused(peak: float) -> None:
    with pytest.raises(ValueError, match="peak_flops"):
        TrainingThroughput(peak_flops=peak)
