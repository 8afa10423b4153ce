"""What :class:`~elr_lightning.module.ELRModule` logs per optimizer step: means over shards, micro-batches and ranks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Mapping

import math

import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch import Tensor


def add_weighted(into: dict[str, Tensor], values: Mapping[str, Tensor], weight: float) -> None:
    """Add ``weight * value`` to ``into[name]`` (absent: zero) for every ``name, value`` of ``values``."""
    for name, value in values.items():
        into[name] = into[name] + value * weight if name in into else value * weight


class StepMeans:
    """Per name, the mean of the values given over the micro-batches of the current optimizer step (detached).

    Lightning logs a step's metrics after its last micro-batch only, with the value logged last;
    logging this running mean makes ``train/loss`` the token mean over all shards of the step
    under gradient accumulation too (every micro-batch holds the same number of tokens).
    """

    def __init__(self) -> None:
        # name -> (optimizer step, sum, count) of the micro-batches of that step
        self._sums: dict[str, tuple[int, Tensor, int]] = {}

    def __call__(self, name: str, value: Tensor, step: int) -> Tensor:
        """Add ``value`` to ``name``'s sum of optimizer step ``step`` (a new step starts afresh); its mean so far."""
        value = value.detach().float()
        saved = self._sums.get(name)
        if saved is None or saved[0] != step:
            saved = (step, torch.zeros_like(value), 0)
        total, count = saved[1] + value, saved[2] + 1
        self._sums[name] = (step, total, count)
        return total / count


def log_update_stats(module: Any, stats: Mapping[str, Tensor], means: StepMeans) -> None:
    """Log the update rule's statistics as the mean over the step's shards, micro-batches and ranks.

    Each rank's value is the token-weighted mean over its shards (``ELRModule.shard_loss``) and the
    step's micro-batches (``means``); ranks count equally. Only on the steps Lightning logs (every
    rank takes them alike) are the ranks averaged by one small all-reduce; the other steps log the
    rank-local value, which Lightning never writes, without a collective.

    Args:
        module: The training ``LightningModule``; logs ``train/<name>``.
        stats: The rule's statistics of this micro-batch, by name.
        means: The module's running means of the step.
    """
    trainer, every = module.trainer, module.trainer.log_every_n_steps
    logs = bool(trainer.fast_dev_run) or (every > 0 and (trainer.global_step + 1) % every == 0)
    for name, value in stats.items():
        mean = means(f"update/{name}", value, trainer.global_step)
        if logs:
            mean = trainer.strategy.reduce(mean.to(module.device), reduce_op="mean")
        module.log(f"train/{name}", mean)


def rank_utilisation(
    schedules: Sequence[Sequence[int]], ranks: int, depth: Callable[[int], int], waits_per_shard: bool = True
) -> float:
    """Load balance of an optimizer step: the layer applications the ranks did over ``ranks`` times the step's wall.

    The ranks wait for each other at every *slot* of the step: at every shard's forward where the
    strategy gathers sharded parameters in each forward (FSDP, ``waits_per_shard``), or once per
    micro-batch otherwise (DDP: the step's logged values are reduced over the ranks at the end of
    each micro-batch, while a rank runs its own shards of one micro-batch back to back). A slot
    takes as long as its deepest rank's work in it, so the step's wall is the sum over slots of the
    most any rank does in that slot, not the most any rank does over the whole step: ranks at
    ``[1, 4]`` and ``[4, 1]`` (two shards each) both pad both shards to 4 under FSDP.

    Args:
        schedules: The loop count of every shard of each micro-batch of the step, all ranks, rank
            ``r`` owning the ``r``-th of ``ranks`` equal slices of each (``ELRModule.step_schedule``).
        ranks: The data-parallel ranks.
        depth: Layer applications of a shard at k: D_eff(k) = L_in + k L_rec + L_out (eq. 1).
        waits_per_shard: Whether the ranks wait for each other at every shard (``True``) or once per
            micro-batch (``False``).

    Returns:
        ``sum_r work_r / (ranks * sum_slots max_r work_{r, slot})``: 1 when every rank does the same
        work in every slot, ``1 / ranks`` when one rank does all of it while the others wait.
    """
    work, wall = 0, 0
    for schedule in schedules:
        per_rank = len(schedule) // ranks
        slices = [[depth(k) for k in schedule[r * per_rank : (r + 1) * per_rank]] for r in range(ranks)]
        work += sum(map(sum, slices))
        wall += sum(map(max, zip(*slices))) if waits_per_shard else max(map(sum, slices))
    return work / (ranks * wall) if wall else 1.0


def ranks_wait_per_shard(strategy: Any) -> bool:
    """Whether ranks under ``strategy`` wait for each other at every shard's forward (:func:`rank_utilisation`).

    A strategy that shards the parameters (Lightning's ``FSDPStrategy``, FSDP2 under its
    ``ModelParallelStrategy`` and so ``OneLoopOverrideFSDPStrategy``) gathers them in every forward;
    under DDP the ranks meet once per micro-batch.
    """
    return isinstance(strategy, (FSDPStrategy, ModelParallelStrategy))


def loop_gains(losses: dict[int, float], max_loops: int) -> dict[str, float]:
    """Elastic depth's gain from a validation's loss per k, under budget K = ``max_loops``.

    ``gain_kK`` is the loss at k = 1 minus the loss at k = K; ``gain_frac_k{k}`` is the fraction
    of it that k loops capture, ``(loss_1 - loss_k) / gain_kK``, for every other validated k > 1
    (the paper's "two and three loops capture 79% and 96% of the four-loop gain"; NaN while the
    gain is zero). Empty unless both k = 1 and k = K were validated and K > 1.
    """
    if max_loops < 2 or 1 not in losses or max_loops not in losses:
        return {}
    gain = losses[1] - losses[max_loops]
    gains = {"gain_kK": gain}
    for k in sorted(losses):
        if k not in (1, max_loops):
            gains[f"gain_frac_k{k}"] = (losses[1] - losses[k]) / gain if gain != 0 else math.nan
    return gains
