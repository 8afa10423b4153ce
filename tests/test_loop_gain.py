"""``val/gain_kK`` and the fraction of it each k captures, logged at every validation."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lightning.pytorch import Trainer

from conftest import tiny_config
from elr_lightning.data import TextDataModule
from elr_lightning.module import ELRModule, loop_gains


def test_paper_fractions():
    """Losses whose k = 2, 3 gains are 79% and 96% of the k = 4 gain (paper §4.2, 4B)."""
    gains = loop_gains({1: 2.0, 2: 2.0 - 0.079, 3: 2.0 - 0.096, 4: 1.9}, 4)
    assert gains["gain_kK"] == pytest.approx(0.1)
    assert gains["gain_frac_k2"] == pytest.approx(0.79) and gains["gain_frac_k3"] == pytest.approx(0.96)
    assert set(gains) == {"gain_kK", "gain_frac_k2", "gain_frac_k3"}


@given(losses=st.lists(st.floats(0.5, 5.0), min_size=2, max_size=6))
def test_gain_is_loss_1_minus_loss_K_and_fractions_interpolate(losses):
    by_k = dict(enumerate(losses, start=1))
    k_max = len(losses)
    gains = loop_gains(by_k, k_max)
    assert gains["gain_kK"] == losses[0] - losses[-1]
    for k in range(2, k_max):
        frac = gains[f"gain_frac_k{k}"]
        if gains["gain_kK"] == 0:
            assert math.isnan(frac)
        else:
            assert frac * gains["gain_kK"] == pytest.approx(losses[0] - losses[k - 1], abs=1e-9)


def test_no_gain_without_k1_and_kK():
    assert loop_gains({1: 2.0}, 1) == {}
    assert loop_gains({1: 2.0, 3: 1.9}, 4) == {}
    assert set(loop_gains({1: 2.0, 4: 1.9, 6: 1.8}, 4)) == {"gain_kK", "gain_frac_k6"}


def test_validation_logs_the_gain_beside_the_per_k_figures(tmp_path):
    module = ELRModule(arch=tiny_config(vocab_size=256, max_loops=3))
    data = TextDataModule(seq_len=32, batch_size=4, max_bytes=20_000, cache_dir=str(tmp_path / "c"), val_batches=2)
    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    metrics = trainer.validate(module, datamodule=data, verbose=False)[0]
    assert metrics["val/gain_kK"] == pytest.approx(metrics["val/loss_k1"] - metrics["val/loss_k3"], abs=1e-6)
    assert metrics["val/gain_frac_k2"] == pytest.approx(
        (metrics["val/loss_k1"] - metrics["val/loss_k2"]) / metrics["val/gain_kK"], rel=1e-4
    )
    assert {"val/bpb_k1", "val/bpb_k2", "val/bpb_k3"} <= set(metrics)
