"""Reading a checkpoint without running code from it: tensors and plain data only, named code only if trusted.

Every loader of the library reads a checkpoint file with ``torch.load(..., weights_only=True)``,
which builds tensors, containers and plain values and nothing else. A file it refuses holds a
pickled object: unpickling one calls whatever the file names (``__reduce__``), which is how a
checkpoint runs a shell command. Such a file is refused in one line naming the object and the way
out (:class:`UnsafeCheckpointError`); no command falls back to ``weights_only=False``. A checkpoint
of an earlier elr-lightning version (pickled plug-ins) is converted once, by its owner, with
``elr upgrade-checkpoint OLD NEW --trust`` (:func:`~elr_lightning.checkpoints.io.upgrade_checkpoint`).

A sharded checkpoint folder's ``.metadata`` (the index of ``torch.distributed.checkpoint``) is a
plain pickle that torch reads with ``pickle.load``: :func:`check_sharded_index` reads it first with
an unpickler that builds only the index's own classes.

Its tensor shards are read with :class:`DataOnlyLoadPlanner`, since torch's own planner unpickles
the non-tensor entries (``torch.load(..., weights_only=False)``) it is asked for.

What the checkpoint says about its model is then checked against the schema of
:mod:`elr_lightning.checkpoints.schema` (plain data; classes only in a seam's fields, and only from
trusted modules, :mod:`elr_lightning.checkpoints.trust`); :func:`read_checkpoint` does both.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import shlex
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any, Optional, Union

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from typing_extensions import override

from elr_lightning.checkpoints.schema import check_checkpoint_config


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


def read_checkpoint(path: Union[str, os.PathLike], map_location: Any = "cpu", cls: Optional[type] = None) -> Any:
    """A checkpoint file that is data only: :func:`load_weights_only`, then its configuration checked.

    Args:
        path: The file.
        map_location: As for ``torch.load``.
        cls: The module class its hyperparameters are checked against (``ELRModule``); ``None``
            checks its ``elr`` entry only.

    Raises:
        UnsafeCheckpointError: The file holds a pickled object.
        UntrustedModuleError: It names a class of a module that is not trusted.
        CheckpointConfigError: Its configuration breaks the schema
            (:func:`~elr_lightning.checkpoints.schema.check_checkpoint_config`).
    """
    raw = load_weights_only(path, map_location)
    check_checkpoint_config(raw, os.fspath(path), cls)
    return raw


def source_name(source: Union[str, os.PathLike, IO[bytes]]) -> str:
    """A checkpoint path, URL or open file's name, for messages."""
    return os.fspath(source) if isinstance(source, (str, os.PathLike)) else str(getattr(source, "name", source))


#: The globals a ``torch.distributed.checkpoint`` index may name, by exact (module, name): its own
#: classes, tensor sizes and layouts, and the paths it records. Dtypes are checked to be dtypes.
INDEX_GLOBALS = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    *(("pathlib", name) for name in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")),
})  # fmt: skip


class _RefusedGlobal(Exception):
    """A global outside :data:`INDEX_GLOBALS`; its message is the global's name."""


class _IndexUnpickler(pickle.Unpickler):
    """Builds only :data:`INDEX_GLOBALS` and torch's dtypes, each named exactly (never a dotted attribute path)."""

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and name.isidentifier() and isinstance(getattr(torch, name, None), torch.dtype)
        if "." in name or not ((module, name) in INDEX_GLOBALS or dtype):
            raise _RefusedGlobal(f"{module}.{name}")
        return super().find_class(module, name)


class DataOnlyLoadPlanner(DefaultLoadPlanner):
    """torch's ``DefaultLoadPlanner``, reading the non-tensor entries of a sharded checkpoint as data.

    torch's planner unpickles each non-tensor entry (an optimizer's ``param_groups``, a step count)
    with ``torch.load(..., weights_only=False)``, which runs whatever a damaged or hostile shard
    names; an index may even declare a tensor's key as such an entry. This planner reads each one
    with ``weights_only=True`` first and refuses it in one line if it holds a pickled object;
    one that passes is then handed to torch's planner, which builds the same plain values.
    """

    def __init__(self, folder: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.folder = folder

    @override
    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        """Read the non-tensor entry ``value`` as data, then hand it to torch's planner.

        Raises:
            UnsafeCheckpointError: The entry holds a pickled object, naming the entry and the object.
        """
        try:
            torch.load(value, weights_only=True)
        except Exception as err:
            refused = refused_global(err)
            if refused is None:
                raise
            raise UnsafeCheckpointError(
                f"checkpoint folder {self.folder!r}: its entry {read_item.dest_index.fqn!r} holds a pickled object "
                f"({refused}), and elr-lightning reads a sharded checkpoint as data only; use a folder written by "
                "save_distributed_checkpoint",
                refused,
            ) from None
        value.seek(0)
        super().load_bytes(read_item, value)


def load_sharded(state: dict[str, Any], folder: str, **kwargs: Any) -> None:
    """``torch.distributed.checkpoint.load(state, checkpoint_id=folder)`` reading the shards as data.

    Through :class:`DataOnlyLoadPlanner`; a refusal it raises on any rank reaches the caller as the
    one-line :class:`UnsafeCheckpointError`, not wrapped in torch's ``CheckpointException``.

    Args:
        state: The state to load into, as for ``dcp.load``.
        folder: The checkpoint folder.
        kwargs: For ``dcp.load`` (``no_dist``, ``storage_reader``).
    """
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        load(state, checkpoint_id=folder, planner=DataOnlyLoadPlanner(folder), **kwargs)
    except CheckpointException as err:
        refused = [exc for exc, _ in err.failures.values() if isinstance(exc, UnsafeCheckpointError)]
        if refused:
            raise refused[0] from None
        raise


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
            metadata = _IndexUnpickler(f).load()
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
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata):
        raise ValueError(
            f"checkpoint folder {folder!r}: its .metadata holds a {type(metadata).__name__}, not a "
            "torch.distributed.checkpoint index; use a folder written by save_distributed_checkpoint"
        )
