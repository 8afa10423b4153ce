"""Cumulative training FLOPs and the compute multiplier over an all-k = 1 run (eq. 5)."""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning_utilities.core.rank_zero import rank_zero_info
from typing_extensions import override

from elr_lightning.batches import Batch, batch_dims
from elr_lightning.callbacks.delayed_mixed_depth import DelayedMixedDepth, DelayedSampler
from elr_lightning.flops import compute_multiplier, flops_multiplier, train_flops_per_token


def _adapter_rank(pl_module: "pl.LightningModule") -> int:
    return int(getattr(pl_module.model.conditioner, "rank", 0))


def step_flops(pl_module: "pl.LightningModule", batch: Batch, schedule: list[int]) -> tuple[float, float]:
    """Training FLOPs of one micro-batch over all shards of the step on all ranks, and the same at k = 1.

    Each shard of ``schedule`` (the k of every shard, :meth:`~elr_lightning.ELRModule.step_schedule`)
    counts ``rows x T x train_flops_per_token(arch, k)`` (k-aware; a mixture of experts counts its
    active experts), with the conditioning adapters while conditioning is on. The second figure
    counts every shard at k = 1 without conditioning.
    """
    arch = pl_module.arch
    batch_rows, seq_len = batch_dims(batch)
    rows = [len(part) for part in torch.arange(batch_rows).tensor_split(pl_module.virtual_ranks)]
    gate = any(p.ndim >= 2 for p in pl_module.model.update.parameters())
    conditioner = pl_module.model.conditioner
    rank = _adapter_rank(pl_module) if conditioner is not None and conditioner.active else 0
    flops = baseline = 0.0
    for shard, k in enumerate(schedule):
        tokens = rows[shard % len(rows)] * seq_len
        flops += tokens * train_flops_per_token(arch, k, seq_len, gate=gate, adapter_rank=rank)
        baseline += tokens * train_flops_per_token(arch, 1, seq_len, gate=gate)
    return flops, baseline


class ComputeAccounting(Callback):
    """Log ``train/flops`` and ``train/compute_multiplier``; compare with eq. (5) at the end of fit.

    Every micro-batch adds the training FLOPs of all shards of the step, on all ranks (the loop
    schedule is known everywhere): ``rows x T x train_flops_per_token(arch, k)`` per shard, with
    the conditioning adapters counted while conditioning is on (:mod:`elr_lightning.flops`). The
    multiplier divides by what the same tokens cost at k = 1 without conditioning, i.e. by an
    all-k = 1 run. At the end of fit it prints the measured multiplier beside eq. (5)'s prediction
    ``(1 - rho) + rho D_eff(mean k) / D_eff(1)`` and its FLOP-count analogue, with rho the mixed
    fraction of the planned steps (from :class:`DelayedMixedDepth`, else 1) and mean k the mixed
    sampler's ``expected_mean_loops()`` (else the measured mean over mixed shards).

    The totals are saved in the callback state, so a resumed run keeps counting.
    """

    def __init__(self) -> None:
        self.flops = 0.0
        self.baseline_flops = 0.0
        self.mixed_loops = 0
        self.mixed_shards = 0
        self._schedule: list[int] = []
        self._mixed = False

    @override
    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        self._schedule = pl_module.step_schedule()
        sampler = pl_module.sampler
        self._mixed = not isinstance(sampler, DelayedSampler) or trainer.global_step >= sampler.switch_step

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        flops, baseline = step_flops(pl_module, batch, self._schedule)
        self.flops += flops
        self.baseline_flops += baseline
        if self._mixed:
            self.mixed_loops += sum(self._schedule)
            self.mixed_shards += len(self._schedule)
        pl_module.log("train/flops", self.flops)
        pl_module.log("train/compute_multiplier", self.multiplier)

    @property
    def multiplier(self) -> float:
        """Training FLOPs so far over those of the same tokens at k = 1 (1.0 before any step)."""
        return self.flops / self.baseline_flops if self.baseline_flops else 1.0

    def predicted(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> Optional[dict[str, float]]:
        """Eq. (5) for this run: ``rho``, ``mean_loops``, ``eq5`` (layers) and ``flops`` (FLOP counts)."""
        partner = [cb for cb in trainer.callbacks if isinstance(cb, DelayedMixedDepth)]
        total = trainer.estimated_stepping_batches
        rho = 1.0
        if partner and partner[0].switch_step is not None and total > 0:
            rho = max(0.0, total - partner[0].switch_step) / total
        sampler = pl_module.sampler
        after = sampler.after if isinstance(sampler, DelayedSampler) else sampler
        expected = getattr(after, "expected_mean_loops", None)
        if expected is not None:
            mean_loops = float(expected())
        elif self.mixed_shards:
            mean_loops = self.mixed_loops / self.mixed_shards
        else:
            return None
        conditioner = pl_module.model.conditioner
        rank = _adapter_rank(pl_module) if conditioner is not None else 0
        gate = any(p.ndim >= 2 for p in pl_module.model.update.parameters())
        seq_len = getattr(getattr(trainer, "datamodule", None), "seq_len", None)
        return {
            "rho": rho,
            "mean_loops": mean_loops,
            "eq5": compute_multiplier(pl_module.arch, rho, mean_loops),
            "flops": flops_multiplier(pl_module.arch, rho, mean_loops, seq_len, gate=gate, adapter_rank=rank),
        }

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        prediction = self.predicted(trainer, pl_module)
        measured = f"compute multiplier over an all-k = 1 run: measured {self.multiplier:.3f}x ({self.flops:.3e} FLOPs)"
        if prediction is None:
            rank_zero_info(measured)
            return
        rank_zero_info(
            f"{measured}; eq. (5) predicts {prediction['eq5']:.3f}x (layers) / {prediction['flops']:.3f}x (FLOPs) "
            f"for rho = {prediction['rho']:.3f}, mean k = {prediction['mean_loops']:.3f}"
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "flops": self.flops,
            "baseline_flops": self.baseline_flops,
            "mixed_loops": self.mixed_loops,
            "mixed_shards": self.mixed_shards,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.flops = float(state_dict["flops"])
        self.baseline_flops = float(state_dict["baseline_flops"])
        self.mixed_loops = int(state_dict["mixed_loops"])
        self.mixed_shards = int(state_dict["mixed_shards"])
