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
import math
import os
import pickle
import re
import shlex
import stat
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any, Optional, Union

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from typing_extensions import override

from elr_lightning.checkpoints.schema import check_checkpoint_config
from elr_lightning.checkpoints.trust import shown


class UnsafeCheckpointError(ValueError):
    """A checkpoint holds a pickled object, which loading it would run (a ``ValueError``: a bad input).

    Args:
        message: The one-line refusal.
        refused: The global the file names (e.g. ``builtins.exec``), where known.
    """

    def __init__(self, message: str, refused: str = "") -> None:
        super().__init__(message)
        self.refused = refused


class RemoteCheckpointError(ValueError):
    """A checkpoint given as a URL: refused, as only a local file can be checked before it is read."""


class OversizedCheckpointError(ValueError):
    """A checkpoint declares more data (a size, a shape, a count) than it holds or than the library's bounds allow."""


def is_url(path: Union[str, os.PathLike]) -> bool:
    """Whether ``path`` is a URL (``http://``, ``file://``, ``s3://``, any ``scheme://``) rather than a local path."""
    return "://" in os.fspath(path)


def refuse_url(path: Union[str, os.PathLike], field: str = "checkpoint") -> None:
    """Refuse a checkpoint given as a URL, in one line naming ``field`` and the fix.

    A URL is never opened: Lightning's loader unpickles an ``http`` checkpoint with
    ``weights_only=False`` unless told otherwise, and a remote file cannot be checked (CRCs, sizes,
    a sharded folder's index) before it is read. Downloading it first makes it a local file, which
    every check covers.

    Raises:
        RemoteCheckpointError: ``path`` is a URL.
    """
    if is_url(path):
        raise RemoteCheckpointError(
            f"{field} {os.fspath(path)!r} is a URL, and elr-lightning opens checkpoints from local paths only (a local "
            "file is checked before it is read); download it first, e.g. curl -fLo model.ckpt URL, and give the path"
        )


def check_regular_file(path: Union[str, os.PathLike], field: str = "checkpoint") -> None:
    """Refuse a path that exists but is neither a regular file nor a folder (a FIFO, a device, a socket).

    Opening a FIFO blocks until another process writes to it, and a device such as ``/dev/zero``
    never ends; a checkpoint is a file (or a sharded checkpoint's folder). Links are followed: the
    path is the user's own.

    Raises:
        ValueError: One line naming ``field`` and the path.
    """
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # nothing there: the caller says so
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise ValueError(
            f"{field} {os.fspath(path)!r} is not a regular file (a FIFO, device or socket), which reading could block "
            "or never end; give a checkpoint file or a sharded checkpoint folder"
        )


def check_archive(path: str) -> None:
    """Refuse a ``torch.save`` archive whose members declare more bytes than the file holds, before any is read.

    ``torch.save`` stores every record uncompressed, so a record's declared size is its size on disk
    and no record can be larger than the file. A compressed record (a small file that expands to
    gigabytes when read or CRC-checked), a record that ends past the end of the file, or records
    declaring more bytes in all than the file has, are refused from the archive's directory alone.
    A file that is no zip archive is left to the caller.

    Raises:
        OversizedCheckpointError: Naming the file and the record.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            records = archive.infolist()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError):
        return  # not an archive, or a damaged one: the CRC check or torch.load says so
    size = os.path.getsize(path)
    declared = 0
    for record in records:
        if record.compress_type != zipfile.ZIP_STORED:
            raise OversizedCheckpointError(
                f"checkpoint {path!r}: its record {record.filename!r} is compressed ({record.file_size} bytes from "
                f"{record.compress_size}), which torch.save never writes and which would be expanded before any check; "
                "use a file written by torch.save (elr fit, Trainer.save_checkpoint)"
            )
        declared += record.file_size
        if record.header_offset + record.compress_size > size or declared > size:
            raise OversizedCheckpointError(
                f"checkpoint {path!r} ({size} bytes): its record {record.filename!r} declares {record.file_size} bytes, "
                "more than the file holds; the file is damaged or forged, use another checkpoint"
            )


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
        RemoteCheckpointError: ``path`` is a URL.
        OversizedCheckpointError: A record declares more bytes than the file holds (:func:`check_archive`).
    """
    path = os.fspath(path)
    refuse_url(path)
    check_regular_file(path)
    check_archive(path)
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
    one-line :class:`UnsafeCheckpointError`, not wrapped in torch's ``CheckpointException``; any other
    failure of a rank (a shard whose sizes differ from the index's) as a one-line ``ValueError``
    naming the folder.

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
        failures = [exc for exc, _ in err.failures.values()]
        refused = [exc for exc in failures if isinstance(exc, UnsafeCheckpointError)]
        if refused:
            raise refused[0] from None
        first = failures[0] if failures else err
        said = " ".join(str(first).split())
        raise ValueError(
            f"checkpoint folder {folder!r} does not hold what its .metadata declares ({type(first).__name__}: "
            f"{shown(said, 300)}); use a folder written by save_distributed_checkpoint"
        ) from err


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
    check_index_storage(folder, metadata)


def _storage_file(folder: str, relative: Any, fqn: str) -> os.stat_result:
    """The ``os.lstat`` of a shard an index names, if it is a regular file inside ``folder`` (no link, no ``..``)."""
    where = f"checkpoint folder {folder!r}: its .metadata stores {fqn!r} in {shown(relative)}"
    fix = "use a folder written by save_distributed_checkpoint"
    parts = relative.replace("\\", "/").split("/") if isinstance(relative, str) else []
    if not parts or os.path.isabs(relative) or any(part in ("", ".", "..") for part in parts):
        raise UnsafeCheckpointError(f"{where}, which is not a file name inside the folder; {fix}")
    path = os.path.join(folder, *parts)
    try:
        info = os.lstat(path)
    except OSError:
        raise ValueError(f"{where}, which is missing; the folder is incomplete, {fix}") from None
    inside = os.path.realpath(path) == os.path.join(os.path.realpath(folder), *parts)
    if not (stat.S_ISREG(info.st_mode) and inside):
        raise UnsafeCheckpointError(
            f"{where}, which is {'a link' if stat.S_ISLNK(info.st_mode) or not inside else 'not a regular file'}; "
            f"a shard is a regular file inside the folder, {fix}"
        )
    return info


def _count(value: Any) -> int:
    """The product of a shape's sizes, or -1 if it is not a sequence of integers >= 0."""
    if not isinstance(value, (tuple, list)) or not all(type(n) is int and n >= 0 for n in value):
        return -1
    return math.prod(value)


def check_index_storage(folder: str, metadata: Any) -> None:
    """Check what a sharded checkpoint's index says about its shards against the files present, reading none.

    Every storage entry must name a regular file inside ``folder`` (a relative name, no ``..``, no
    link, no FIFO or device), with ``offset`` and ``length`` inside that file; every tensor's
    declared bytes (its shape times its dtype's size) must be held by the bytes stored for it, so an
    index that declares a 4,000,000 x 128 embedding over a few bytes is refused before anything is
    allocated. The entries stored in one file may not declare more bytes than it holds in all
    (entries that overlap would each be allocated anew).

    Raises:
        UnsafeCheckpointError: A shard path that leaves the folder or is not a regular file.
        OversizedCheckpointError: A tensor declares more bytes than are stored for it.
        ValueError: The index is malformed, naming the entry.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    fix = "use a folder written by save_distributed_checkpoint"
    storage = metadata.storage_data if metadata.storage_data is not None else {}
    if not isinstance(storage, dict) or not isinstance(metadata.state_dict_metadata, dict):
        raise ValueError(f"checkpoint folder {folder!r}: its .metadata is not a torch.distributed.checkpoint index; {fix}")
    stored: dict[str, int] = {}
    sizes: dict[str, int] = {}
    used: dict[str, int] = {}
    for index, info in storage.items():
        fqn = str(getattr(index, "fqn", index))
        relative = getattr(info, "relative_path", None)
        if relative not in sizes:
            sizes[relative] = _storage_file(folder, relative, fqn).st_size
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if _count([offset, length]) < 0 or offset + length > sizes[relative]:
            raise OversizedCheckpointError(
                f"checkpoint folder {folder!r}: its .metadata stores {fqn!r} at bytes {shown(offset)} + "
                f"{shown(length)} of {relative!r}, which holds {sizes[relative]} bytes; {fix}"
            )
        stored[fqn] = stored.get(fqn, 0) + length
        used[relative] = used.get(relative, 0) + length
        if used[relative] > sizes[relative]:  # entries sharing bytes would each be allocated anew
            raise OversizedCheckpointError(
                f"checkpoint folder {folder!r}: its .metadata stores {used[relative]} bytes in {relative!r}, which "
                f"holds {sizes[relative]} (its entries overlap); {fix}"
            )
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        dtype = getattr(entry.properties, "dtype", None)
        numel = _count(entry.size)
        if not isinstance(dtype, torch.dtype) or numel < 0:
            raise ValueError(f"checkpoint folder {folder!r}: its .metadata declares {fqn!r} with no valid shape; {fix}")
        declared = numel * dtype.itemsize
        if declared > stored.get(fqn, 0):
            raise OversizedCheckpointError(
                f"checkpoint folder {folder!r}: its .metadata declares {fqn!r} as {list(entry.size)} {dtype} "
                f"({declared} bytes), but its shards hold {stored.get(fqn, 0)} bytes for it; {fix}"
            )
