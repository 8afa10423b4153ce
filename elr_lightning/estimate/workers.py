"""Tracing an ``elr estimate`` table's planned steps in parallel worker processes (``--workers``).

A traced step is single-threaded Python (fake tensors and torch's memory tracker), so a table is traced
faster with a process per core: each worker builds the config's model on fake tensors once
(:func:`~elr_lightning.estimate.memory.fake_training`, with its own fake process group under FSDP2) and
traces the settings it is handed, the costliest first; the parent keeps the results in its
:class:`~elr_lightning.estimate.steps.Steps` as they come and hands the workers what the table asks for later
(the micro-batch search) too, so that the parent never builds a model of its own. Workers are started with
``spawn``: a forked copy of a process that has run torch's thread pools may hang.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Optional

from elr_lightning.estimate.memory import Setting, StepMemory, Target, fake_training
from elr_lightning.estimate.steps import Steps
from elr_lightning.estimate.target import meta_builder

_STACK: Optional[contextlib.ExitStack] = None
_TRACE: Optional[Callable[[Setting], dict[str, StepMemory]]] = None


def _exit_with(parent: int) -> None:
    """Exit this worker once its parent is gone (killed without the chance to stop its workers)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _start(config: dict[str, Any], path: str, conditioning: bool, target: Target, prior_grads: bool) -> None:
    """A worker's initializer: the config's model on fake tensors, kept for the worker's life."""
    global _STACK, _TRACE
    threading.Thread(target=_exit_with, args=(os.getppid(),), daemon=True).start()
    _STACK = contextlib.ExitStack()
    _TRACE = _STACK.enter_context(
        fake_training(
            meta_builder(config, path, conditioning), target, phases=True, prior_grads=prior_grads, replay=prior_grads
        )
    )


def _trace(setting: Setting) -> tuple[Setting, dict[str, StepMemory], float]:
    """One setting traced in a worker: ``(setting, phases, seconds)``."""
    assert _TRACE is not None, "worker not started"
    start = time.perf_counter()
    phases = _TRACE(setting)
    return setting, phases, time.perf_counter() - start


class WorkerPool:
    """The worker processes of one table: they trace the planned settings, then whatever the micro-batch search asks.

    Args:
        steps: Where the planned settings' results are recorded (:meth:`collect`).
        pool: The started processes; ``None`` where none were started (every trace then runs in the parent).
        workers: How many processes ``pool`` runs.
    """

    def __init__(self, steps: Steps, pool: Optional[ProcessPoolExecutor], workers: int) -> None:
        self._steps = steps
        self._pool = pool
        self._workers = workers
        self._futures: dict[Setting, Future] = {}

    def submit(self, settings: list[Setting]) -> None:
        """Start tracing each of ``settings`` not known yet nor submitted before (nothing without workers)."""
        for setting in settings:
            if self._pool is not None and setting not in self._futures and setting not in self._steps.phases:
                try:
                    self._futures[setting] = self._pool.submit(_trace, setting)
                except (BrokenProcessPool, RuntimeError):  # a worker died: the parent traces what is left
                    self._pool = None

    def collect(self) -> None:
        """Wait for the settings submitted so far and record each in ``steps`` as it comes."""
        left = set(self._futures.values())
        while left:
            done, left = wait(left, return_when=FIRST_COMPLETED)
            for future in done:
                result = self._result(future)
                if result is None:
                    return
                setting, phases, seconds = result
                if setting not in self._steps.phases:
                    self._steps.record(setting, phases, seconds, parallel=self._workers)

    def trace(self, setting: Setting) -> Optional[dict[str, StepMemory]]:
        """``setting``'s phases traced by a worker (submitted now unless it was before), or ``None`` without workers."""
        self.submit([setting])
        future = self._futures.get(setting)
        result = None if future is None else self._result(future)
        return None if result is None else result[1]

    def _result(self, future: Future) -> Optional[tuple[Setting, dict[str, StepMemory], float]]:
        try:
            return future.result()
        except BrokenProcessPool:  # a worker died (or could not build the model): the parent traces what is left
            self._pool = None
            return None


@contextlib.contextmanager
def traced_in_workers(
    steps: Steps,
    workers: int,
    config: dict[str, Any],
    path: str,
    conditioning: bool,
    target: Target,
    prior_grads: bool = False,
) -> Iterator[WorkerPool]:
    """Start ``workers`` processes tracing ``steps``' pending settings, the costliest first; yields their
    :class:`WorkerPool`, whose ``collect()`` waits for them and records each in ``steps`` as it comes, and which
    traces later settings (the micro-batch search's) in the workers too (``prior_grads``: the fast path, one
    micro-batch after the first's gradients with the layers replayed, see
    :func:`~elr_lightning.estimate.memory.fake_training`). With ``workers`` below 2 (or fewer than two settings
    pending) nothing is started and the pool traces nothing. On exit (Ctrl-C included) unfinished work is
    cancelled and the workers stop."""
    pending = steps.pending()
    if workers < 2 or len(pending) < 2:
        yield WorkerPool(steps, None, 1)
        return
    workers = min(workers, len(pending))
    pool = ProcessPoolExecutor(
        max_workers=workers, mp_context=multiprocessing.get_context("spawn"), initializer=_start,
        initargs=(config, path, conditioning, target, prior_grads),
    )  # fmt: skip
    handle = WorkerPool(steps, pool, workers)
    handle.submit(pending)
    try:
        yield handle
    finally:
        processes = list((getattr(pool, "_processes", None) or {}).values())  # the executor has no public handle
        pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:  # a worker mid-trace would finish its step before it saw the shutdown
            process.terminate()
        for process in processes:
            process.join()


__all__ = ["WorkerPool", "traced_in_workers"]
