"""Tracing an ``elr estimate`` table's planned steps in parallel worker processes (``--workers``).

A traced step is single-threaded Python (fake tensors and torch's memory tracker), so a table is traced
faster with a process per core: each worker builds the config's model on fake tensors once
(:func:`~elr_lightning.estimate.memory.fake_training`, with its own fake process group under FSDP2) and
traces the settings it is handed, the costliest first; the parent keeps the results in its
:class:`~elr_lightning.estimate.steps.Steps` as they come, and traces what the table asks for later
(the micro-batch search) itself. Workers are started with ``spawn``: a forked copy of a process that has
run torch's thread pools may hang.
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


@contextlib.contextmanager
def traced_in_workers(
    steps: Steps,
    workers: int,
    config: dict[str, Any],
    path: str,
    conditioning: bool,
    target: Target,
    prior_grads: bool = False,
) -> Iterator[Callable[[], None]]:
    """Start ``workers`` processes tracing ``steps``' pending settings; yields ``collect()``, which waits for them
    and records each in ``steps`` as it comes (``prior_grads``: the fast path, one micro-batch after the first's
    gradients with the layers replayed, see :func:`~elr_lightning.estimate.memory.fake_training`). With ``workers`` below 2 (or nothing pending) nothing is started
    and ``collect`` does nothing. On exit (Ctrl-C included) unfinished work is cancelled and the workers stop."""
    pending = steps.pending()
    if workers < 2 or len(pending) < 2:
        yield lambda: None
        return
    workers = min(workers, len(pending))
    pool = ProcessPoolExecutor(
        max_workers=workers, mp_context=multiprocessing.get_context("spawn"), initializer=_start,
        initargs=(config, path, conditioning, target, prior_grads),
    )  # fmt: skip
    futures: list[Future] = [pool.submit(_trace, setting) for setting in pending]

    def collect() -> None:
        left = set(futures)
        while left:
            done, left = wait(left, return_when=FIRST_COMPLETED)
            for future in done:
                try:
                    setting, phases, seconds = future.result()
                except BrokenProcessPool:
                    return  # a worker died (or could not build the model): this process traces what is left
                steps.record(setting, phases, seconds, parallel=workers)

    try:
        yield collect
    finally:
        processes = list((getattr(pool, "_processes", None) or {}).values())  # the executor has no public handle
        pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:  # a worker mid-trace would finish its step before it saw the shutdown
            process.terminate()
        for process in processes:
            process.join()


__all__ = ["traced_in_workers"]
