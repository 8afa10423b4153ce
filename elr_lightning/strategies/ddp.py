"""``OneLoopOverrideDDPStrategy``: Lightning's DDP for ranks that run different loop counts."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.types import STEP_OUTPUT
from typing_extensions import override

from elr_lightning.parameter_usage import first_unused
from elr_lightning.strategies.common import find_looped_lm, verify_loop_schedule


class OneLoopOverrideDDPStrategy(DDPStrategy):
    """DDP for mixed-depth training: every process is one data-parallel rank (DESIGN §6).

    Rank ``r`` of ``W`` owns shards ``r * virtual_ranks ...`` of the ``W * virtual_ranks`` shards
    of each step; the module's sampler gives every shard its k from the pure schedule (eq. 3 for
    :class:`~elr_lightning.sampling.OneLoopOverride`), so no rank talks to another about loop
    counts. Gradients are averaged as usual, so the step's loss is the token mean over all shards.

    ``find_unused_parameters`` defaults to ``True``: the conditioning heads take no part in the
    forward pass before the delayed switch (DESIGN §5), and DDP without it then fails at the second
    step (or hangs, when only some ranks skip a parameter). ``False`` is faster and is allowed when
    every parameter takes part at every k; setup checks that on a two-token probe and raises if not.

    Args:
        find_unused_parameters: Let DDP's reducer skip parameters without a gradient.
        check_schedule_every_n_steps: Every this many optimizer steps, gather the loop counts the
            ranks run and raise if they are not one shared schedule (``0``: never); see
            :func:`~elr_lightning.strategies.common.verify_loop_schedule`.
        **kwargs: Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy` arguments
            (``timeout``, ``process_group_backend``, ``start_method``, ...) and those of torch's
            ``DistributedDataParallel``.
    """

    def __init__(
        self, find_unused_parameters: bool = True, check_schedule_every_n_steps: int = 100, **kwargs: Any
    ) -> None:
        if check_schedule_every_n_steps < 0:
            raise ValueError(
                f"check_schedule_every_n_steps={check_schedule_every_n_steps} must be >= 0 (0 turns the check off)"
            )
        super().__init__(find_unused_parameters=find_unused_parameters, **kwargs)
        self.find_unused_parameters = find_unused_parameters
        self.check_schedule_every_n_steps = check_schedule_every_n_steps

    @property
    def data_parallel_rank(self) -> int:
        """This process' data-parallel rank: its global rank."""
        return self.global_rank

    @property
    def data_parallel_size(self) -> int:
        """Number of data-parallel ranks: the world size."""
        return self.world_size

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        if not self.find_unused_parameters:
            self._require_every_parameter_used()
        super().setup(trainer)

    def _require_every_parameter_used(self) -> None:
        model = find_looped_lm(self.lightning_module)
        unused = first_unused(model)
        if unused is not None:
            raise ValueError(
                f"{type(self).__name__}(find_unused_parameters=False) needs every parameter in the loss at every k, "
                f"but {unused}; set find_unused_parameters: true"
            )

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        verify_loop_schedule(self, self.check_schedule_every_n_steps)
        return super().training_step(*args, **kwargs)
