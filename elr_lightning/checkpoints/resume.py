"""What a resumed run must keep from the run it continues: the loop schedule (DESIGN §4) and its length."""

from __future__ import annotations

import math
from typing import Any, Optional

from lightning_utilities.core.rank_zero import rank_zero_warn


def planned_steps(trainer: Any) -> Optional[int]:
    """The fitting run's planned optimizer steps (the LR schedule's length); ``None`` when unbounded or not fitting."""
    if trainer.state.fn != "fit":
        return None
    total = trainer.estimated_stepping_batches
    return int(total) if math.isfinite(total) else None


def check_resumed_schedule(
    saved: Optional[dict[str, int]], trainer: Any, *, ranks: int, virtual_ranks: int, seed: int
) -> None:
    """Refuse to resume training with another loop schedule than the checkpoint's run had.

    The schedule is a pure function of ``(seed, step, shard, num_shards)`` (DESIGN §4): a resumed
    run with another number of shards per step (data-parallel ranks x ``virtual_ranks``) or
    another loop seed would silently run other loop counts than the interrupted run. The LR
    schedule is restored from the checkpoint: a longer planned run is refused (the cosine would
    rise again after the planned end), a shorter one warns (it stops before the cosine ends).

    Args:
        saved: The checkpoint's ``elr.schedule`` entry (``num_shards``, ``seed``, ``total_steps``), or ``None``.
        trainer: The fitting trainer.
        ranks: This run's data-parallel ranks.
        virtual_ranks: This run's ``model.init_args.virtual_ranks``.
        seed: This run's loop seed.

    Raises:
        ValueError: Naming the field and the value that keeps the schedule (or the run length).
    """
    if saved is None:
        return
    shards = ranks * virtual_ranks
    if saved["num_shards"] != shards:
        fits = saved["num_shards"] % ranks == 0
        fix = (
            f"set model.init_args.virtual_ranks: {saved['num_shards'] // ranks}"
            if fits
            else f"use a number of data-parallel ranks that divides {saved['num_shards']}"
        )
        raise ValueError(
            f"cannot resume the loop schedule exactly: the checkpoint was trained with {saved['num_shards']} "
            f"shards per step, this run has {shards} ({ranks} data-parallel rank(s) x "
            f"model.init_args.virtual_ranks={virtual_ranks}); {fix} (keeping data.batch_size x devices), "
            "or start a fresh run from the weights with DelayedMixedDepth(init_from=...)"
        )
    if saved["seed"] != seed:
        raise ValueError(
            f"cannot resume the loop schedule exactly: the checkpoint was trained with loop seed {saved['seed']}, "
            f"this run has {seed}; set model.init_args.loop_seed: {saved['seed']} (or the same seed_everything)"
        )
    planned, total = saved.get("total_steps"), planned_steps(trainer)
    if planned is None or total is None or planned == total:
        return
    if total > planned:
        raise ValueError(
            f"cannot resume with a longer run: the checkpoint's run planned {planned} optimizer steps, this run plans "
            f"{total}; the LR schedule is restored from the checkpoint, so its cosine would end at step {planned} and "
            f"rise again after it. Resume with trainer.max_steps: {planned}, or train on as a new run from the "
            "weights with DelayedMixedDepth(init_from=...) and its own LR schedule"
        )
    rank_zero_warn(
        f"the checkpoint's run planned {planned} optimizer steps, this run plans {total}: the LR schedule is restored "
        f"from the checkpoint, so this run stops before its cosine ends (at step {planned}); resume with the "
        f"checkpoint's trainer.max_steps ({planned} steps) to continue it exactly"
    )
