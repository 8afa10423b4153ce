"""Traced steps kept on disk, so that running ``elr estimate`` again traces only what it has not traced before.

A user runs the estimate several times while choosing the micro-batch, the checkpointing and the
flags of a run; each traced step of a large config costs tens of seconds of CPU. A traced step's phases
(:func:`~elr_lightning.estimate.memory.traced_phases`) depend only on the model section of the config,
eq. 4's conditioning switch, the :class:`~elr_lightning.estimate.memory.Target` (strategy, ranks,
precision, ...), the :class:`~elr_lightning.estimate.memory.Setting` and the code that traces them. The
cache's key hashes all of these, the code as the bytes of every ``elr_lightning`` source file and torch's
version, so any change to any of them misses the cache and traces again.

Entries are JSON (numbers only: reading one never runs code), one file per step under
:func:`default_cache_dir`, written to a temporary file and renamed into place, so an interrupted run
never leaves half an entry; an entry that cannot be read or does not hold the expected numbers is
ignored and traced again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

from elr_lightning.estimate.memory import Setting, StepMemory, Target

#: Bumped when the meaning of an entry changes.
SCHEMA = 1

#: The environment variable that moves the cache (default: :func:`default_cache_dir`).
CACHE_ENV = "ELR_ESTIMATE_CACHE"


def default_cache_dir() -> Path:
    """``$ELR_ESTIMATE_CACHE``, else ``$XDG_CACHE_HOME/elr-lightning/estimate``, else ``~/.cache/elr-lightning/estimate``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "elr-lightning" / "estimate"


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """SHA-256 of every ``elr_lightning`` source file (path and bytes) and of torch's version."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256(torch.__version__.encode())
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


class TraceCache:
    """The traced steps of one model, conditioning switch and target, on disk.

    Args:
        directory: Where the entries live (created on the first write, readable by its owner only).
        model: The config's ``model`` section (``class_path`` and ``init_args``), as merged.
        conditioning: Eq. 4 conditioning on or off, as the estimate builds the model.
        target: Where the step runs.
        prior_grads: The steps are the fast path's, traced after the gradients of a first micro-batch, not through it,
            with the layers replayed (:func:`~elr_lightning.estimate.memory.fake_training`): kept apart from
            ``--exact``'s.
    """

    def __init__(
        self, directory: Path, model: dict[str, Any], conditioning: bool, target: Target, prior_grads: bool = True
    ) -> None:
        self.directory = Path(directory)
        self._identity = json.dumps(
            {
                "schema": SCHEMA,
                "code": code_digest(),
                "model": model,
                "conditioning": conditioning,
                "target": dataclasses.asdict(target),
                "prior_grads": prior_grads,
            },
            sort_keys=True,
            default=str,
        )
        #: Why the last write failed (``None`` while every write succeeded).
        self.write_error: Optional[str] = None

    def _path(self, setting: Setting) -> Path:
        key = hashlib.sha256(
            (self._identity + json.dumps(dataclasses.asdict(setting), sort_keys=True)).encode()
        ).hexdigest()
        return self.directory / key[:2] / f"{key}.json"

    def get(self, setting: Setting) -> Optional[dict[str, StepMemory]]:
        """The phases of ``setting`` traced before, or ``None`` (never traced, or an entry that cannot be read)."""
        try:
            entry = json.loads(self._path(setting).read_text())
            fields = {f.name for f in dataclasses.fields(StepMemory)}
            phases = {}
            for phase, columns in entry["phases"].items():
                if set(columns) != fields or not all(type(v) is int and v >= 0 for v in columns.values()):
                    return None
                phases[str(phase)] = StepMemory(**columns)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        return phases or None

    def put(self, setting: Setting, phases: dict[str, StepMemory]) -> None:
        """Keep the phases of ``setting``; a directory that cannot be written is noted in :attr:`write_error`."""
        path = self._path(setting)
        entry = {"setting": dataclasses.asdict(setting), "phases": {p: dataclasses.asdict(m) for p, m in phases.items()}}
        temporary = None
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(handle, "w") as out:
                json.dump(entry, out)
            os.replace(temporary, path)
            temporary = None
        except OSError as err:
            self.write_error = f"{self.directory}: {err.strerror or err}"
        finally:
            if temporary is not None:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)


__all__ = ["CACHE_ENV", "SCHEMA", "TraceCache", "code_digest", "default_cache_dir"]
