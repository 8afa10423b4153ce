"""Accuracy per difficulty and loop count on held-out depth instances, logged at every validation."""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from typing_extensions import override


class DepthAccuracy(Callback):
    """After each validation (not the sanity check), score the depth task's held-out instances.

    Needs a :class:`~elr_lightning.depth.DepthDataModule` (its ``task`` and ``eval_difficulties``);
    with another data module it does nothing. Every rank scores the same ``n`` instances per
    difficulty at every k of ``loops`` (:func:`~elr_lightning.depth.score.score`), so a sharded model
    (FSDP) runs the same gathers in the same order on all of them; rank 0 logs, to every logger,
    ``val_depth/d{difficulty}/exact_k{k}`` (the instance exact match) and, to TensorBoard, the image
    ``val_depth/heatmap`` (difficulty x k) and the same table as text, ``val_depth/table``.

    Args:
        loops: Loop counts; default 1..2K (K = ``arch.max_loops``, so K+1..2K extrapolate), 1 alone for the
            non-recurrent baseline.
        n: Held-out instances per difficulty.
        seed: Seed of the held-out draw (``elr eval`` scores the same instances with ``--seed``).
    """

    def __init__(self, loops: Optional[list[int]] = None, n: int = 128, seed: int = 0) -> None:
        if loops is not None and (not loops or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in loops)):
            raise ValueError(f"DepthAccuracy.loops={loops!r} must list loop counts >= 1, or be null for 1..2K")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"DepthAccuracy.n={n!r} must be an integer >= 1")
        self.loops, self.n, self.seed = loops, n, seed

    @override
    def on_validation_end(self, trainer: "pl.Trainer", pl_module: Any) -> None:
        datamodule = getattr(trainer, "datamodule", None)
        if trainer.sanity_checking or not hasattr(datamodule, "eval_difficulties"):
            return
        # Lazy hook: scoring decodes (the inference layer, above the callbacks), only on a depth task's validation.
        from elr_lightning.depth.score import default_loops, format_table, heatmap, score

        max_loops = pl_module.arch.max_loops
        loops = self.loops or default_loops(pl_module.model)
        table = score(pl_module.model, datamodule.task, datamodule.eval_difficulties, loops, self.n, self.seed)
        if not trainer.is_global_zero:
            return
        metrics = {f"val_depth/d{d}/exact_k{k}": cell["exact"] for d, row in table.items() for k, cell in row.items()}
        step = trainer.global_step
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
            if isinstance(logger, TensorBoardLogger):
                title = f"{datamodule.task.name}: exact match (%), step {step}"
                logger.experiment.add_figure("val_depth/heatmap", heatmap(table, title=title, max_loops=max_loops), step)
                logger.experiment.add_text("val_depth/table", format_table(table, "exact", datamodule.task), step)
