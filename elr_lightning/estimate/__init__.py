"""Memory and cost of a config before a run: ``elr estimate`` (per-rank peak memory of a training step, traced on
fake tensors) and ``elr cost`` (parameters, FLOPs and KV memory per k).

``memory`` traces a step, ``fla`` stands in for fla's kernels there, ``steps`` extrapolates the fast path,
``workers`` traces in parallel, ``cache`` keeps traced steps on disk, ``target`` reads a config's run, ``hardware`` the devices, ``budget`` says what fits, ``report`` builds the
table, ``command`` is ``elr estimate``'s command line, ``fit`` the estimate ``elr fit`` logs, and ``cost`` is
``elr cost``. Nothing is imported here: ``elr cost`` does not load torch's memory tools (the names of the
old ``elr_lightning.estimate`` module are read from ``memory`` on first use, with a deprecation warning).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    """The names of 0.1's ``elr_lightning.estimate`` module, now :mod:`elr_lightning.estimate.memory`'s: read from
    there with a ``DeprecationWarning`` naming the new path, for one release (see :mod:`elr_lightning._moved`)."""
    memory = importlib.import_module("elr_lightning.estimate.memory")
    if name.startswith("__") or not hasattr(memory, name):
        raise AttributeError(f"module 'elr_lightning.estimate' has no attribute {name!r}")
    warnings.warn(
        f"elr_lightning.estimate.{name} moved to elr_lightning.estimate.memory.{name}; import from there "
        "(the old path goes in the release after next)",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(memory, name)
