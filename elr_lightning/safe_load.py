"""Reading a checkpoint without running code from it: tensors and plain data only, named code only if trusted.

Every loader of the library reads a checkpoint file with ``torch.load(..., weights_only=True)``,
which builds tensors, containers and plain values and nothing else. A file it refuses holds a
pickled object: unpickling one calls whatever the file names (``__reduce__``), which is how a
checkpoint runs a shell command. Such a file is refused in one line naming the object and the way
out (:class:`UnsafeCheckpointError`); no command falls back to ``weights_only=False``. A checkpoint
of an earlier elr-lightning version (pickled plug-ins) is converted once, by its owner, with
``elr upgrade-checkpoint OLD NEW --trust`` (:func:`~elr_lightning.checkpoint_io.upgrade_checkpoint`).

A sharded checkpoint folder's ``.metadata`` (the index of ``torch.distributed.checkpoint``) is a
plain pickle that torch reads with ``pickle.load``: :func:`check_sharded_index` reads it first with
an unpickler that builds only the index's own classes.

The modules a checkpoint names by class path are checked by :mod:`elr_lightning.trust`
(:func:`read_checkpoint` does both).
"""

from __future__ import annotations

import os
import pickle
import re
import shlex
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any, Optional, Union

import torch

from elr_lightning.trust import check_checkpoint_names


class UnsafeCheckpointError(ValueError):
    """A checkpoint holds a pickled object, which loading it would run (a ``ValueError``: a bad input).

    Args:
        message: The one-line refusal.
        refused: The global the file names (e.g. ``builtins.exec``), where known.
    """

    def __init__(self, message: str, refused: str = "") -> None:
        super().__init__(message)
        self.refused = refused


def refused_global(err: BaseException) -> Optional[str]:
    """The global that ``torch.load(..., weights_only=True)`` refused, or ``None`` for any other error."""
    if not isinstance(err, pickle.UnpicklingError) or "Weights only load failed" not in str(err):
        return None
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(err))
    return found.group(1) if found else "an object torch does not allow"


def unsafe_checkpoint(path: str, refused: str) -> UnsafeCheckpointError:
    """The one-line refusal of a checkpoint that holds the pickled object ``refused``.

    ``path`` may be a sharded checkpoint folder, whose ``meta.pt`` holds the object.
    """
    meta = os.path.join(path, "meta.pt") if os.path.isdir(path) else path
    stem, _ = os.path.splitext(os.path.normpath(meta))
    new = f"{stem}.upgraded{'.pt' if os.path.basename(meta) == 'meta.pt' else '.ckpt'}"
    then = f", then put it in place of {meta}" if os.path.basename(meta) == "meta.pt" else ""
    return UnsafeCheckpointError(
        f"checkpoint {path!r} holds a pickled object ({refused}), and elr-lightning never unpickles one: it would "
        f"run code from the file. If you made or trust the file (e.g. a checkpoint of an earlier elr-lightning), "
        f"convert it once: elr upgrade-checkpoint {shlex.quote(meta)} {shlex.quote(new)} --trust{then}",
        refused,
    )


@contextmanager
def refusing_pickles(path: str) -> Iterator[None]:
    """Turn torch's refusal of a pickled object inside the block into :class:`UnsafeCheckpointError`."""
    try:
        yield
    except Exception as err:
        refused = refused_global(err)
        if refused is None:
            raise
        raise unsafe_checkpoint(path, refused) from None


def load_weights_only(path: Union[str, os.PathLike], map_location: Any = "cpu", mmap: Optional[bool] = None) -> Any:
    """``torch.load(path, weights_only=True)``, a pickled object refused in one line.

    Args:
        path: The file.
        map_location: As for ``torch.load``.
        mmap: Map the file instead of reading it (only the pickled records are read); default: when
            the file is a zip archive (``torch.save``'s format), as the legacy format cannot be mapped.

    Raises:
        UnsafeCheckpointError: The file holds a pickled object.
    """
    path = os.fspath(path)
    mmap = zipfile.is_zipfile(path) if mmap is None else mmap
    with refusing_pickles(path):
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)


def read_checkpoint(path: Union[str, os.PathLike], map_location: Any = "cpu") -> Any:
    """A checkpoint file that is data only: :func:`load_weights_only`, then the modules it names checked.

    Raises:
        UnsafeCheckpointError: The file holds a pickled object.
        UntrustedModuleError: Its hyperparameters name a module that is not trusted
            (:func:`~elr_lightning.trust.check_checkpoint_names`).
    """
    raw = load_weights_only(path, map_location)
    if isinstance(raw, dict):
        check_checkpoint_names(raw, os.fspath(path))
    return raw


def check_checkpoint(source: Union[str, os.PathLike, IO[bytes]]) -> None:
    """The checks of :func:`read_checkpoint` on a file, URL or open binary file, reading no tensor.

    The tensors are mapped to the meta device, so only the pickled records are read; an open
    file is left at the position it had.

    Raises:
        UnsafeCheckpointError: The checkpoint holds a pickled object.
        UntrustedModuleError: It names a module that is not trusted.
    """
    if isinstance(source, (str, os.PathLike)) and "://" not in os.fspath(source):
        read_checkpoint(source, "meta")
        return
    name = os.fspath(source) if isinstance(source, (str, os.PathLike)) else str(getattr(source, "name", source))
    with refusing_pickles(name):
        if isinstance(source, (str, os.PathLike)):
            from lightning.fabric.utilities.cloud_io import get_filesystem

            with get_filesystem(name).open(name, "rb") as f:
                raw = torch.load(f, map_location="meta", weights_only=True)
        else:
            position = source.tell()
            raw = torch.load(source, map_location="meta", weights_only=True)
            source.seek(position)
    if isinstance(raw, dict):
        check_checkpoint_names(raw, name)


#: The globals a ``torch.distributed.checkpoint`` index may name: its own classes, tensor sizes,
#: dtypes and layouts, and the paths it records.
_INDEX_MODULES = ("torch.distributed.checkpoint.metadata",)
_INDEX_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    *(("pathlib", name) for name in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")),
}


class _RefusedGlobal(Exception):
    """A global outside :data:`_INDEX_GLOBALS`; its message is the global's name."""


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            module in _INDEX_MODULES
            or (module, name) in _INDEX_GLOBALS
            or (module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)))
        )
        if not allowed:
            raise _RefusedGlobal(f"{module}.{name}")
        return super().find_class(module, name)


def check_sharded_index(folder: str) -> None:
    """Check that a sharded checkpoint folder's ``.metadata`` names only the classes of a DCP index.

    ``torch.distributed.checkpoint`` reads that file with ``pickle.load``; this reads it first with
    an unpickler that builds nothing else, so a file that would run code is refused before torch
    reads it.

    Raises:
        UnsafeCheckpointError: The index names anything else, naming it.
        ValueError: The index is not a pickle at all.
    """
    index = os.path.join(folder, ".metadata")
    if not os.path.isfile(index):
        return  # nothing that torch would unpickle
    try:
        with open(index, "rb") as f:
            _IndexUnpickler(f).load()
    except _RefusedGlobal as err:
        raise UnsafeCheckpointError(
            f"checkpoint folder {folder!r}: its .metadata names {err}, which a torch.distributed.checkpoint index "
            "never holds; elr-lightning does not unpickle it, as that would run code from the file. Use a folder "
            "written by save_distributed_checkpoint"
        ) from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError, IndexError) as err:
        raise ValueError(
            f"checkpoint folder {folder!r}: its .metadata is not a torch.distributed.checkpoint index "
            f"({type(err).__name__}: {err}); use a folder written by save_distributed_checkpoint"
        ) from None
