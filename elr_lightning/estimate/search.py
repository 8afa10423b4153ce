"""The micro-batch search of ``elr estimate``: the largest micro-batch whose step fits a budget.

:func:`largest_fitting` searches any growing peak; :func:`largest_micro_batch` runs it on a table's
:class:`~elr_lightning.estimate.steps.Steps` (probes placed on the line through traced sizes, the size found and
the next traced), and :func:`fitting_at` picks a k's row, or the micro-batch that fits under its lightest mode.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Optional

from elr_lightning.estimate.budget import Budget
from elr_lightning.estimate.memory import Setting, StepMemory
from elr_lightning.estimate.steps import Steps


def table_row(setting: Setting, memory: StepMemory) -> dict[str, Any]:
    """A row of the table: the setting and the step's columns (what :class:`~elr_lightning.estimate.budget.Budget` reads)."""
    return {
        "loops": setting.loops,
        "mode": setting.label,
        "activation_checkpointing": setting.checkpointing,
        "backprop_loops": setting.backprop_loops,
        "micro_batch": setting.micro_batch,
        "seq_len": setting.seq_len,
        **memory.as_dict(),
    }


def largest_fitting(peak: Callable[[int], int], budget: int, start: int, minimum: int = 1, limit: int = 1 << 16) -> Optional[int]:
    """The largest integer ``b`` in ``[minimum, limit]`` with ``peak(b) <= budget``, or ``None`` if none fits.

    ``peak`` must grow with ``b`` (a step's memory grows with its micro-batch). The search is
    logarithmic: a probe is placed where the straight line through the nearest known peaks crosses
    the budget (just past it while no size is known not to fit, to close the range at once: a step's
    memory is close to affine in its micro-batch, so the search usually takes three probes), except
    after two such probes in a row that moved the same end of the range, when it doubles the largest
    fitting size (no size is known not to fit yet) or takes the geometric middle of the range. So a
    peak that is far from a line (where the line alone would creep towards the answer a few sizes
    at a time) still needs at most about ``3 log2(limit)`` probes.
    """
    known: dict[int, int] = {}

    def fits(b: int) -> bool:
        if b not in known:
            known[b] = peak(b)
        return known[b] <= budget

    b = max(minimum, min(start, limit))
    if not fits(b):
        if b == minimum or not fits(minimum):
            return None
        lo, hi = minimum, b
    else:
        lo, hi = b, None
    last_moved, in_a_row = "", 0  # the end the line's probes moved, and how many times in a row
    while hi is None or hi - lo > 1:
        if hi is None and lo == limit:
            return lo
        geometric = in_a_row >= 2
        if hi is None:
            nxt = min(limit, 2 * lo)
            below = [x for x in known if x < lo]
            slope = (known[lo] - known[max(below)]) / (lo - max(below)) if below else 0.0
            if slope > 0 and not geometric:  # just past where the line through the last two fitting probes crosses
                nxt = min(limit, max(lo + 1, int(lo + (budget - known[lo]) / slope) + 1))
            else:
                geometric = True
        else:
            slope = (known[hi] - known[lo]) / (hi - lo)
            if slope > 0 and not geometric:
                nxt = int(lo + (budget - known[lo]) / slope)
            else:
                nxt, geometric = round(math.sqrt(lo * hi)), True
            nxt = min(hi - 1, max(lo + 1, nxt))
        moved = "lo" if fits(nxt) else "hi"
        lo, hi = (nxt, hi) if moved == "lo" else (lo, nxt)
        in_a_row = 0 if geometric else (in_a_row + 1 if moved == last_moved else 1)
        last_moved = "" if geometric else moved
    return lo


def largest_micro_batch(steps: Steps, setting: Setting, budget: Budget, minimum: int) -> Optional[int]:
    """The largest micro-batch at which ``setting`` fits. Each probe is traced at the setting's own k until two sizes
    are known; on the fast path later probes read the line through the traced sizes, and the size the search
    settles on and the next are traced; unless the first fits and the next does not, the search runs again on
    traced steps alone."""
    traced = [setting.micro_batch]

    def probe(b: int) -> int:
        s = dataclasses.replace(setting, micro_batch=b)
        if len(traced) < 2 and b not in traced:
            traced.append(b)
        return budget.score(table_row(s, steps.predicted(s, traced)))

    found = largest_fitting(probe, budget.device, setting.micro_batch, minimum)
    if steps.exact or found is None:
        return found

    def traced_fits(b: int) -> bool:
        return budget.fits(table_row(setting, steps.traced(dataclasses.replace(setting, micro_batch=b))))

    # the line only placed the probes: the size found must fit and the next must not, both traced (at once,
    # where workers run)
    steps.trace_ahead([dataclasses.replace(setting, micro_batch=b) for b in (found, found + 1) if b <= 1 << 16])
    if traced_fits(found) and (found >= 1 << 16 or not traced_fits(found + 1)):
        return found
    return largest_fitting(
        lambda b: budget.score(table_row(setting, steps.traced(dataclasses.replace(setting, micro_batch=b)))),
        budget.device, found, minimum,
    )  # fmt: skip


def fitting_at(
    k: int,
    rows: list[dict[str, Any]],
    settings: list[Setting],
    budget: Budget,
    steps: Steps,
    search: bool,
    minimum: int,
) -> dict[str, Any]:
    """The first of ``rows`` (one k, in the order of the modes) that fits, else the largest micro-batch that fits
    under the row with the smallest footprint; ``micro_batch`` ``None`` where nothing fits."""
    for row in rows:
        if budget.fits(row):
            return row
    lightest = min(rows, key=budget.score)
    if search:
        setting = next(s for s in settings if s.loops == k and s.label == lightest["mode"])
        found = largest_micro_batch(steps, setting, budget, minimum)
        if found is not None:
            chosen = dataclasses.replace(setting, micro_batch=found)
            return table_row(chosen, steps.traced(chosen))
    return {**lightest, "micro_batch": None}


__all__ = ["fitting_at", "largest_fitting", "largest_micro_batch", "table_row"]
