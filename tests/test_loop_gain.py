"""``val/gain_kK`` and the fraction of it each k captures, against losses recomputed from the model's outputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import perturbed_model, quiet_trainer, tiny_config
from elr_lightning.conditioning import LoopConditioner
from elr_lightning.data import TextDataModule
from elr_lightning.module import ELRModule
from elr_lightning.step_logging import loop_gains


def test_validation_gain_is_the_recomputed_loss_drop_from_k1_to_K(tmp_path):
    """Token-mean cross-entropy of the model's own logits per k, over the same validation batches."""
    config = tiny_config(vocab_size=256, max_loops=4)
    module = ELRModule(arch=config, conditioner=LoopConditioner(d_cond=8, rank=2), val_loops=[1, 2, 3, 4, 6])
    module.model.load_state_dict(perturbed_model(config, seed=5).state_dict())  # every gate and head acts
    data = TextDataModule(seq_len=32, batch_size=4, max_bytes=20_000, cache_dir=str(tmp_path / "c"), val_batches=2)
    trainer = quiet_trainer()
    logged = trainer.validate(module, datamodule=data, verbose=False)[0]

    losses = {}
    with torch.no_grad():
        for k in module.val_loops:
            nll, tokens = 0.0, 0
            for batch in data.val_dataloader():
                logits = module.model(batch[:, :-1], k)
                nll += F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").item()
                tokens += batch[:, 1:].numel()
            losses[k] = nll / tokens
    gain = losses[1] - losses[4]
    assert abs(gain) > 1e-3, f"the loops barely change the loss ({losses}); the comparison proves nothing"
    assert logged["val/gain_kK"] == pytest.approx(gain, abs=1e-5)
    for k in (2, 3, 6):  # k above K = 4 extrapolates and is reported too
        assert logged[f"val/gain_frac_k{k}"] == pytest.approx((losses[1] - losses[k]) / gain, rel=1e-3, abs=1e-4)
    assert {key for key in logged if "gain" in key} == {"val/gain_kK", "val/gain_frac_k2", "val/gain_frac_k3", "val/gain_frac_k6"}


def test_no_gain_without_k1_and_kK():
    assert loop_gains({1: 2.0}, 1) == {}
    assert loop_gains({1: 2.0, 3: 1.9}, 4) == {}
