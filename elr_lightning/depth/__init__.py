"""Token-level depth tasks where loops pay: labelled at every position, fresh samples at every step.

* :mod:`~elr_lightning.depth.tasks`: prefix parity, find-the-root over a forest of chains and
  multi-operand addition, each with its alphabet and a difficulty knob, and the held-out split.
* :mod:`~elr_lightning.depth.datamodule`: :class:`DepthDataModule`, labelled batches
  ``{"input_ids", "labels"}`` drawn at every step from ``(seed, step, row)``.
* :mod:`~elr_lightning.depth.score`: exact match per difficulty and k, its table and heatmap, and
  the same through the serving decoder with depth per token.
"""

from elr_lightning.depth.datamodule import DepthDataModule
from elr_lightning.depth.tasks import TASKS, DepthTask, FindRoot, MultiAddition, PrefixParity, get_task, is_heldout

__all__ = ["TASKS", "DepthDataModule", "DepthTask", "FindRoot", "MultiAddition", "PrefixParity", "get_task", "is_heldout"]
