"""What both ELR strategies share: the data-parallel layout protocol, the schedule check and the
parameter-usage checks (DESIGN §6; the probe itself is :mod:`elr_lightning.parameter_usage`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional, Protocol, runtime_checkable

import torch
from lightning.pytorch.strategies import ParallelStrategy
from torch import nn

from elr_lightning.model import LoopedLM
from elr_lightning.module import ELRModule
from elr_lightning.parameter_usage import unused_parameters


@runtime_checkable
class DataParallelLayout(Protocol):
    """A strategy that tells the module where this process sits among the data-parallel ranks.

    :meth:`ELRModule.data_parallel_layout <elr_lightning.module.ELRModule.data_parallel_layout>`
    reads these two properties when the trainer's strategy has them; shard ``s`` of a step is
    ``data_parallel_rank * virtual_ranks + slice`` out of ``data_parallel_size * virtual_ranks``.
    Ranks that only split the model (tensor-parallel peers) share a data-parallel rank, so they
    run the same k.
    """

    @property
    def data_parallel_rank(self) -> int:
        """This process' index among the data-parallel ranks."""

    @property
    def data_parallel_size(self) -> int:
        """Number of data-parallel ranks."""


def find_looped_lm(module: nn.Module) -> LoopedLM:
    """The one :class:`~elr_lightning.model.LoopedLM` inside ``module``.

    Raises:
        TypeError: ``module`` holds no ``LoopedLM`` or more than one.
    """
    found = [m for m in module.modules() if isinstance(m, LoopedLM)]
    if len(found) != 1:
        raise TypeError(
            f"the ELR strategies train a module holding exactly one LoopedLM; {type(module).__name__} holds "
            f"{len(found)}"
        )
    return found[0]


def verify_loop_schedule(strategy: ParallelStrategy, every_n_steps: int, group: Optional[Any] = None) -> None:
    """Check that every rank runs its slice of one shared loop schedule (all ranks must call this).

    The module logs ``train/p1``, ``train/loops_mean`` and the ``train/loops`` histogram from the
    pure schedule (DESIGN §4), which every rank computes alone. Every ``every_n_steps`` optimizer
    steps (``0``: never) this gathers the k that each rank is about to run together with each
    rank's view of the whole schedule, and raises on every rank if they differ, so the logged
    values are the realised ones across ranks. One small all-gather; no effect on training.

    Args:
        strategy: The running strategy.
        every_n_steps: Check period in optimizer steps.
        group: Process group of the data-parallel ranks (``None``: all ranks).

    Raises:
        RuntimeError: A rank runs loop counts other than the shared schedule gives it (different
            seeds, samplers or ``virtual_ranks`` across ranks).
    """
    module = strategy.lightning_module
    if every_n_steps <= 0 or not isinstance(module, ELRModule):
        return
    step = module.trainer.global_step
    if step % every_n_steps:
        return
    expected = module.step_schedule()
    local = module.local_loops()
    mine = torch.tensor(local + expected, dtype=torch.long, device=strategy.root_device)
    # [ranks, n] (without a process group, Lightning returns the tensor as it is: one row)
    gathered = strategy.all_gather(mine, group=group).reshape(-1, mine.numel()).tolist()
    realised = [k for row in gathered for k in row[: len(local)]]
    views = [row[len(local) :] for row in gathered]
    if any(view != realised for view in views):
        raise RuntimeError(
            f"loop schedule disagrees across ranks at step {step}: ranks run {realised}, their views of the "
            f"schedule are {views}; give every rank the same loop_seed (or seed_everything), sampler and "
            "virtual_ranks"
        )


def loop_dependent_parameters(model: LoopedLM, loops: Iterable[int]) -> dict[str, list[int]]:
    """Parameters whose use depends on k: ``{name: loop counts that leave it out}`` (empty if none).

    Under FSDP2 such a parameter makes ranks at different k reduce-scatter different amounts of
    gradient, which aborts (gloo) or hangs (NCCL). Parameters left out at every k (the conditioning
    heads before the switch) are not listed: every rank skips them alike.
    """
    loops = list(loops)
    usage = unused_parameters(model, loops)
    dependent: dict[str, list[int]] = {}
    for active in {a for a, _ in usage}:
        per_k = {k: set(usage[(active, k)]) for k in loops}
        everywhere = set.intersection(*per_k.values())
        for k, names in per_k.items():
            for name in sorted(names - everywhere):
                dependent.setdefault(name, []).append(k)
    return {name: sorted(set(ks)) for name, ks in sorted(dependent.items())}
