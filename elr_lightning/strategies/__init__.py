"""Distributed strategies for mixed-depth training (DESIGN §6).

Both subclass Lightning's own strategies and name them by ``class_path`` in YAML::

    trainer:
      strategy:
        class_path: elr_lightning.strategies.OneLoopOverrideDDPStrategy   # or ...FSDPStrategy
        init_args: {timeout: "0:30:00"}

They expose ``data_parallel_rank`` and ``data_parallel_size`` (:class:`DataParallelLayout`), from
which the module derives its shard indices; the loop schedule itself is a pure function that
every rank evaluates alone (:mod:`elr_lightning.sampling`).
"""

from elr_lightning.strategies.common import DataParallelLayout
from elr_lightning.strategies.ddp import OneLoopOverrideDDPStrategy
from elr_lightning.strategies.fsdp import OneLoopOverrideFSDPStrategy, shard_looped_lm

__all__ = ["DataParallelLayout", "OneLoopOverrideDDPStrategy", "OneLoopOverrideFSDPStrategy", "shard_looped_lm"]
