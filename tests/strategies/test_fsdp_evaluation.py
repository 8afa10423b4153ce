"""The FSDP strategy evaluates under ``no_grad``, so a model validated first still trains (issue 47).

Lightning validates, tests and predicts under ``torch.inference_mode`` unless the process group is
gloo or the strategy is its own ``FSDPStrategy``. On NCCL an FSDP2 forward under inference mode left
the units' gather buffers as inference tensors, and the first training forward after it failed
("Inplace update to inference tensor outside InferenceMode"). The tests run on gloo with Lightning's
choice made as on NCCL (:func:`_dist_worker.evaluation_as_on_nccl`).
"""

from __future__ import annotations

import math

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

import _dist_worker
from test_strategies import corpus, launch  # noqa: F401 - corpus is a fixture

CASES = {
    "layer": {"strategy": "fsdp", "recurrent_units": "layer", "virtual_ranks": 1, "nccl_evaluation": True},
    "core_offload": {
        "strategy": "fsdp", "recurrent_units": "core", "cpu_offload": True, "virtual_ranks": 2, "nccl_evaluation": True,
    },
}
STEPS = 2


class _Modes(Callback):
    def __init__(self) -> None:
        self.inference: list[bool] = []

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self.inference.append(torch.is_inference_mode_enabled())


def test_the_forcing_makes_lightning_validate_under_inference_mode():
    """Without the strategy's say, Lightning's validate picks inference mode under the forcing (what NCCL gets)."""
    modes = _Modes()
    trainer = Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=1, callbacks=[modes],
    )
    with _dist_worker.evaluation_as_on_nccl():
        trainer.validate(BoringModel(), verbose=False)
    assert modes.inference == [True]


@pytest.mark.slow
def test_fsdp_validates_first_then_trains_with_inference_mode_as_on_nccl(corpus, tmp_path):  # noqa: F811
    results = launch("fsdp", corpus, tmp_path / "runs", CASES, timeout_s=240, steps=STEPS)
    for name, ranks in results.items():
        for result in ranks:
            stages = [(fn, sanity) for fn, sanity, _ in result["evaluation_modes"]]
            # trainer.validate, the sanity check, then a validation after each training step
            assert stages == [("validate", False), ("fit", True)] + [("fit", False)] * STEPS, (name, stages)
            assert not any(inference for _, _, inference in result["evaluation_modes"]), (name, result["evaluation_modes"])
            assert len(result["losses"]) == STEPS and all(math.isfinite(loss) for loss in result["losses"]), name
        # the root unit (embedding, final norm) stays gathered after validation: its optimizer state must be the shards'
        for key in ("embed.weight", "norm.weight", "core.layers.0.mlp.up.weight"):
            moved = (ranks[0]["state"][key] - ranks[0]["initial"][key]).abs().max().item()
            assert moved > 1e-3, f"{name}: training after validation left {key} where it was"
