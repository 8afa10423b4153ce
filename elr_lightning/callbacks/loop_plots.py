"""TensorBoard pictures of elastic depth: loop-count and expert-load histograms, validation loss against k."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from typing_extensions import override


class LoopCountPlots(Callback):
    """Adds two TensorBoard pictures to the scalars an ``ELRModule`` logs (rank 0, TensorBoard loggers only).

    * ``train/loops`` (histogram): the loop counts of every shard of the steps since the last one
      (every ``trainer.log_every_n_steps`` optimizer steps).
    * ``train/moe_load/layer{j}`` (histogram, one bucket per expert): the expert load of each routed
      layer at that step, from the module's ``expert_loads`` (models with a mixture of experts).
    * ``val/loss_vs_loops`` (image): the validation loss ``val/loss_k{k}`` against k after each
      validation (not the sanity check), with a dotted line at the loop budget K.

    Reads the module's ``step_schedule()``, ``val_loops`` and ``arch.max_loops``; without a
    TensorBoard logger it does nothing.
    """

    def __init__(self) -> None:
        self._loops: list[int] = []

    @staticmethod
    def _tensorboards(trainer: "pl.Trainer") -> list[TensorBoardLogger]:
        if not trainer.is_global_zero:
            return []
        return [logger for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._tensorboards(trainer):
            self._loops.extend(pl_module.step_schedule())

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step % trainer.log_every_n_steps or not self._loops:
            return
        values = torch.tensor(self._loops, dtype=torch.float32)
        for logger in self._tensorboards(trainer):
            logger.experiment.add_histogram("train/loops", values, trainer.global_step, bins="auto")
            for layer, load in getattr(pl_module, "expert_loads", {}).items():
                _add_load_histogram(logger, f"train/moe_load/layer{layer}", load, trainer.global_step)
        self._loops.clear()

    @override
    def on_validation_end(self, trainer: "pl.Trainer", pl_module: Any) -> None:
        tensorboards = self._tensorboards(trainer)
        if trainer.sanity_checking or not tensorboards:
            return
        metrics = trainer.callback_metrics
        losses = {k: float(metrics[f"val/loss_k{k}"]) for k in pl_module.val_loops if f"val/loss_k{k}" in metrics}
        if not losses:
            return
        from matplotlib.figure import Figure  # only when drawing: matplotlib is slow to import

        fig = Figure(figsize=(4, 3), dpi=100)
        ax = fig.add_subplot()
        ax.plot(list(losses), list(losses.values()), marker="o")
        ax.set_xlabel("loops k")
        ax.set_ylabel("validation loss")
        ax.set_title(f"step {trainer.global_step}")
        ax.axvline(pl_module.arch.max_loops, color="grey", linestyle=":", linewidth=1)
        fig.tight_layout()
        for logger in tensorboards:
            logger.experiment.add_figure("val/loss_vs_loops", fig, trainer.global_step)


def _add_load_histogram(logger: TensorBoardLogger, tag: str, load: torch.Tensor, step: int) -> None:
    """Expert load ``[E]`` as a histogram over expert indices (one bucket per expert)."""
    counts = load.double().cpu()
    experts = torch.arange(len(counts), dtype=torch.float64)
    logger.experiment.add_histogram_raw(
        tag,
        min=0.0,
        max=float(len(counts) - 1),
        num=float(counts.sum()),
        sum=float((experts * counts).sum()),
        sum_squares=float((experts**2 * counts).sum()),
        bucket_limits=(experts + 0.5).tolist(),
        bucket_counts=counts.tolist(),
        global_step=step,
    )
