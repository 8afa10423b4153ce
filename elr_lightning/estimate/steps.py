"""The steps an ``elr estimate`` table needs, traced once each, or on the fast path extrapolated from a few.

A traced step (:func:`~elr_lightning.estimate.memory.traced_phases`) gives the peak of each phase of the
step: the forward and backward passes (``step``), and the update (``update``: clipping and the optimizer
step). Within one backward setting and micro-batch, each phase's columns grow by the same bytes per loop
from k = 3 on (every further loop adds the same saved activations; before, the moment of the peak may still
move within the backward pass: under FSDP2 with ``layer`` checkpointing on the quickstart the line through
k = 2 and 3 is 7-29% high at k = 4 to 6). So the fast path (the default) traces k = 1 to 4 and extrapolates
every larger k along the line through k = 3 and 4, phase by phase; ``tests/estimate/test_fast.py`` checks it
at every k to 6 on small dense and hybrid configs under DDP and FSDP2. Two steps are not affine there and
are traced at every k (:func:`extrapolates`): FSDP2 with ``layer`` checkpointing (the hybrid quickstart's
grows unevenly: the line through k = 3 and 4 is 6-15% high at k = 5 and 6) and a mixture of experts' (the
line through k = 2 and 3 was 1-2% low on the MoE quickstart); ``--exact`` traces every step. The
micro-batch search traces its first probe at the row's own k, probes the line through the two traced sizes
(each phase on its own line) and traces the size it settles on and the next: the micro-batch it reports and the
rows at that size are traced, never extrapolated.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Optional

from elr_lightning.estimate.cache import TraceCache
from elr_lightning.estimate.memory import Setting, StepMemory, Target, step_peak

_GIB = 2**30

#: The largest k the fast path traces; larger ones are extrapolated from it and the one before.
TRACED_LOOPS = 4


def extrapolates(target: Target, setting: Setting, moe: bool) -> bool:
    """Whether the fast path may extrapolate ``setting`` in k: not with MoE layers (``moe``), and not under FSDP2
    with ``layer`` checkpointing, whose steps are not affine in k (``tests/estimate/test_fast.py``)."""
    return not moe and not (target.strategy == "fsdp" and setting.checkpointing == "layer")


def _line(a: StepMemory, b: StepMemory, t: float) -> StepMemory:
    """The point at ``t`` of the straight line through ``a`` (t = 0) and ``b`` (t = 1), column by column."""
    fields = [f.name for f in dataclasses.fields(StepMemory)]
    return StepMemory(**{name: max(0, round(getattr(a, name) + t * (getattr(b, name) - getattr(a, name)))) for name in fields})


def extrapolated(
    low: dict[str, StepMemory], high: dict[str, StepMemory], at: float, x_low: float, x_high: float
) -> StepMemory:
    """The step's peak at ``at`` from its phases' peaks at ``x_low`` and ``x_high``, each phase on its own line."""
    t = (at - x_low) / (x_high - x_low)
    return step_peak({phase: _line(low[phase], high[phase], t) for phase in low if phase in high})


class Steps:
    """The steps of one target, each traced once; on the fast path, those past :data:`TRACED_LOOPS` loops extrapolated.

    Args:
        trace: Traces one setting, giving its phases' peaks
            (:func:`~elr_lightning.estimate.memory.fake_training` with ``phases=True``).
        exact: Trace every step.
        cost: The relative time of tracing a setting (for the expected time left).
        say: Where a line per traced step goes.
        extrapolable: Whether a setting may be extrapolated in k (:func:`extrapolates`); default: all.
        cache: Steps traced by earlier runs (:mod:`elr_lightning.estimate.cache`), read before tracing and
            given every step traced here.
    """

    def __init__(
        self,
        trace: Callable[[Setting], dict[str, StepMemory]],
        exact: bool,
        cost: Callable[[Setting], float],
        say: Callable[[str], None],
        extrapolable: Optional[Callable[[Setting], bool]] = None,
        cache: Optional[TraceCache] = None,
    ) -> None:
        self._trace = trace
        self.exact = exact
        self._cost = cost
        self._say = say
        self._extrapolable = extrapolable or (lambda setting: True)
        self._cache = cache
        #: The settings read from the cache instead of traced.
        self.cached: set[Setting] = set()
        self.phases: dict[Setting, dict[str, StepMemory]] = {}
        self.memory: dict[Setting, StepMemory] = {}
        self.extrapolated: set[Setting] = set()
        self._planned: list[Setting] = []
        #: Starts tracing the settings it is given elsewhere, ahead of their use (the table's worker processes,
        #: :class:`~elr_lightning.estimate.workers.WorkerPool`); by default nothing.
        self.ahead: Callable[[list[Setting]], None] = lambda settings: None
        self._seconds = 0.0
        self._spent_cost = 0.0

    def to_trace(self, setting: Setting) -> list[Setting]:
        """The settings traced to know ``setting``."""
        if self.exact or setting.loops <= TRACED_LOOPS or not self._extrapolable(setting):
            return [setting]
        return [dataclasses.replace(setting, loops=k) for k in (TRACED_LOOPS - 1, TRACED_LOOPS)]

    def plan(self, settings: list[Setting], traced: tuple[Setting, ...] = ()) -> None:
        """Announce the settings about to be asked for (``traced``: to be traced at their own k, as the micro-batch
        search's probes are), so that workers trace them and the progress lines can say how long is left."""
        for needed in [*(n for setting in settings for n in self.to_trace(setting)), *traced]:
            if needed not in self.phases and needed not in self._planned:
                self._planned.append(needed)

    def left_seconds(self) -> Optional[float]:
        """Expected seconds to trace what is planned and not traced yet, from the time the traces so far took."""
        if not self._spent_cost:
            return None
        left = sum(self._cost(s) for s in self._planned if s not in self.phases)
        return left * self._seconds / self._spent_cost

    def trace_ahead(self, settings: list[Setting]) -> None:
        """Hand those of ``settings`` that are neither known nor in the cache to :attr:`ahead`, to trace at once."""
        self.ahead([s for s in settings if s not in self.phases and not self._from_cache(s)])

    def load_cached(self) -> None:
        """Take every planned setting that the cache holds from it, with a line each."""
        if self._cache is None:
            return
        for setting in self._planned:
            if setting not in self.phases:
                self._from_cache(setting)

    def _from_cache(self, setting: Setting) -> bool:
        phases = self._cache.get(setting) if self._cache is not None else None
        if phases is None:
            return False
        self.phases[setting] = phases
        self.cached.add(setting)
        peak = step_peak(phases).peak / _GIB
        self._say(f"k={setting.loops} {setting.label} micro-batch {setting.micro_batch}: {peak:.2f} GiB (cached)")
        return True

    def _traced(self, setting: Setting) -> dict[str, StepMemory]:
        if setting not in self.phases and not self._from_cache(setting):
            start = time.perf_counter()
            phases = self._trace(setting)
            self.record(setting, phases, time.perf_counter() - start)
        return self.phases[setting]

    def record(self, setting: Setting, phases: dict[str, StepMemory], seconds: float, parallel: int = 1) -> None:
        """Keep a setting traced here or by a worker process (:mod:`elr_lightning.estimate.workers`) in
        ``seconds``, and print its line; ``parallel`` traces run at once (for the time left)."""
        self.phases[setting] = phases
        if self._cache is not None:
            self._cache.put(setting, phases)
        self._seconds += seconds / parallel
        self._spent_cost += self._cost(setting)
        memory = step_peak(phases)
        host = f", host {memory.host / _GIB:.2f} GiB" if memory.host else ""
        done = len([s for s in self._planned if s in self.phases])
        left = self.left_seconds()
        todo = len(self._planned)
        eta = f"; ~{left:.0f} s left" if left is not None and done < todo else ""
        count = f" [{done}/{todo}{eta}]" if todo and setting in self._planned else ""
        self._say(
            f"k={setting.loops} {setting.label} micro-batch {setting.micro_batch}: {memory.peak / _GIB:.2f} GiB{host} "
            f"({seconds:.0f} s){count}"
        )

    def pending(self) -> list[Setting]:
        """The planned settings not traced yet, the costliest first."""
        return sorted((s for s in self._planned if s not in self.phases), key=self._cost, reverse=True)

    def __call__(self, setting: Setting) -> StepMemory:
        """The step's peak: traced, or on the fast path extrapolated in k from the last two traced loop counts."""
        if setting not in self.memory:
            needed = self.to_trace(setting)
            if needed == [setting]:
                self.memory[setting] = step_peak(self._traced(setting))
            else:
                low, high = (self._traced(s) for s in needed)
                self.memory[setting] = extrapolated(low, high, setting.loops, needed[0].loops, needed[1].loops)
                self.extrapolated.add(setting)
        return self.memory[setting]

    def traced(self, setting: Setting) -> StepMemory:
        """The step's peak, traced at its own k unless it is known already (one trace at k costs less than two at
        k = 3 and 4: what the micro-batch search probes)."""
        if setting in self.memory:
            return self.memory[setting]
        return step_peak(self._phases_at(setting))

    def _phases_at(self, setting: Setting) -> dict[str, StepMemory]:
        """The phases of a setting: traced before, else extrapolated in k where both traces it needs exist, else
        traced now at its own k."""
        if setting in self.phases:
            return self.phases[setting]
        needed = self.to_trace(setting)
        if needed != [setting] and all(s in self.phases for s in needed):
            low, high = (self.phases[s] for s in needed)
            t = (setting.loops - needed[0].loops) / (needed[1].loops - needed[0].loops)
            return {phase: _line(low[phase], high[phase], t) for phase in low if phase in high}
        return self._traced(setting)

    def predicted(self, setting: Setting, traced_sizes: list[int]) -> StepMemory:
        """The step at ``setting.micro_batch`` on the line through the two known micro-batches nearest to it (of
        ``traced_sizes``, same k and mode, each phase on its own line); traced itself where fewer than two are
        known or on the exact path."""
        if self.exact or setting.micro_batch in traced_sizes or len(traced_sizes) < 2:
            return self.traced(setting)
        near = sorted(sorted(traced_sizes, key=lambda b: (abs(b - setting.micro_batch), b))[:2])
        low, high = (self._phases_at(dataclasses.replace(setting, micro_batch=b)) for b in near)
        return extrapolated(low, high, setting.micro_batch, near[0], near[1])


__all__ = ["TRACED_LOOPS", "Steps", "extrapolated", "extrapolates"]
