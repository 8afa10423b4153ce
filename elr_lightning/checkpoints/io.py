"""Checkpoint files that a kill mid-save can never leave half-written, and a clear error for broken ones.

Lightning's ``TorchCheckpointIO`` writes through an fsspec transaction whose temporary file lives in
the system temporary folder; when that is another file system, the final ``shutil.move`` is a copy
into the checkpoint's own path, which a kill can cut short. :class:`AtomicCheckpointIO` writes a
temporary file beside the target, ``fsync`` s it, ``os.replace`` s it over the target (atomic on
POSIX) and ``fsync`` s the folder: after a crash the path holds the old checkpoint or the new one,
never a mix. The checks that a loaded checkpoint fits its model (:func:`state_dict_differences`) and
that a checkpoint about to be written is finite (:func:`non_finite_tensors`) live here too.

Every loader of the library reads checkpoints with ``torch.load(..., weights_only=True)``, which runs
no code from the file (:mod:`elr_lightning.checkpoints.safe_load`); a file that holds a pickled object is refused,
never unpickled. :func:`upgrade_checkpoint` (``elr upgrade-checkpoint OLD NEW --trust``) converts a
checkpoint of an earlier version, whose plug-ins are pickled objects, once and by its owner's choice.
"""

from __future__ import annotations

import io
import os
import warnings
import zipfile
from typing import IO, Any, Callable, Literal, Optional, Union

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from torch import Tensor
from typing_extensions import override

from elr_lightning.files import write_atomically
from elr_lightning.plugin_config import plain_hyperparameters
from elr_lightning.checkpoints.safe_load import (
    UnsafeCheckpointError,
    check_archive,
    check_regular_file,
    check_sharded_index,
    load_sharded,
    load_weights_only,
    refuse_url,
    refused_global,
    refusing_pickles,
)

def upgrade_checkpoint(src: str, dst: str, trust: bool = False) -> None:
    """Rewrite a checkpoint of an earlier version so that it loads with ``torch.load(..., weights_only=True)``.

    Reads ``src`` with ``weights_only=False``, which **runs code from the file** (that is how its
    pickled plug-ins are rebuilt), so it asks for ``trust=True``: convert only a file you made or
    trust. Turns its hyperparameters into plain data (plug-ins as ``class_path`` + ``init_args``, see
    :func:`~elr_lightning.plugin_config.plain_value`) and creates ``dst`` atomically; ``src`` is
    left as it is and an existing ``dst`` is never replaced.

    Raises:
        UnsafeCheckpointError: ``src`` holds pickled objects and ``trust`` is false.
        FileExistsError: ``dst`` exists.
        PluginConfigError: A plug-in whose constructor arguments cannot be recovered, naming the field.
        ValueError: ``src`` holds objects outside the hyperparameters that still need ``weights_only=False``.
    """
    if os.path.lexists(dst):
        raise FileExistsError(f"{dst!r} exists; elr upgrade-checkpoint never replaces a file, give a new path")
    if trust:
        checkpoint = torch.load(src, map_location="cpu", weights_only=False)
    else:
        checkpoint = load_weights_only(src, mmap=False)  # refuses a pickled object, naming it
    if isinstance(checkpoint, dict) and "hyper_parameters" in checkpoint:
        checkpoint["hyper_parameters"] = plain_hyperparameters(checkpoint["hyper_parameters"])
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    try:
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except Exception as err:
        refused = refused_global(err)
        if refused is None:
            raise
        raise ValueError(
            f"checkpoint {src!r} still holds {refused} outside its hyperparameters after the upgrade; "
            "save that entry (a callback's state, ...) as tensors and plain data"
        ) from err
    write_atomically(dst, lambda f: f.write(buffer.getvalue()), overwrite=False)


class CorruptCheckpointError(RuntimeError, ValueError):
    """A checkpoint file is truncated or damaged (a ``ValueError`` too: a bad input, not a bug)."""


def is_sharded_checkpoint(path: str) -> bool:
    """Whether ``path`` is a folder written by a strategy with ``save_distributed_checkpoint=True``."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, ".metadata"))


def read_sharded_checkpoint(folder: str, weights: Union[bool, Literal["meta"]] = True) -> dict[str, Any]:
    """A sharded (``torch.distributed.checkpoint``) Lightning checkpoint as one checkpoint dict, in one process.

    Every entry of the folder's ``meta.pt`` (hyperparameters, loop state, the ``elr`` entry) and,
    with ``weights``, the full ``state_dict`` gathered from every rank's shard. Optimizer state is
    left out: the result serves inference (``elr generate``, ``eval``, ``serve``, ``export``), not
    resuming. The index is checked before torch unpickles it
    (:func:`~elr_lightning.checkpoints.safe_load.check_sharded_index`), ``meta.pt`` is read with
    ``weights_only=True`` and its configuration checked against the schema
    (:func:`~elr_lightning.checkpoints.schema.check_checkpoint_config`), and the shards are read as
    data (:class:`~elr_lightning.checkpoints.safe_load.DataOnlyLoadPlanner`).

    Args:
        folder: The checkpoint folder.
        weights: Also read the model weights (else only ``meta.pt``); ``"meta"``: the ``state_dict`` as
            meta-device tensors of the saved shapes and dtypes, no weight read.

    Raises:
        ValueError: ``folder`` is not a sharded Lightning checkpoint, or its ``meta.pt`` is not a checkpoint's.
        UnsafeCheckpointError: Its index, ``meta.pt`` or a shard would run code.
        UntrustedModuleError: ``meta.pt`` names a class of a module that is not trusted.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    check_sharded_folder(folder, "checkpoint folder")
    checkpoint = read_sharded_meta(folder)
    if not weights:
        return checkpoint
    reader = dcp.FileSystemReader(folder)
    prefix = "state_dict."
    device = "meta" if weights == "meta" else "cpu"
    state_dict = {
        key[len(prefix) :]: torch.empty(entry.size, dtype=entry.properties.dtype, device=device)
        for key, entry in reader.read_metadata().state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
    }
    if weights != "meta":
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*assuming the intent is to load in a single process")
            load_sharded({"state_dict": state_dict}, folder, storage_reader=reader, no_dist=True)
    checkpoint["state_dict"] = state_dict
    return checkpoint


def check_sharded_folder(folder: str, field: str) -> None:
    """Refuse a folder that is not a sharded Lightning checkpoint (``.metadata`` and ``meta.pt``), naming what it lacks.

    Raises:
        ValueError: One line naming ``field``, the folder and the missing file.
    """
    missing = [name for name in (".metadata", "meta.pt") if not os.path.isfile(os.path.join(folder, name))]
    if missing:
        raise ValueError(
            f"{field} {folder!r} is a folder without {' and '.join(missing)}, so not a sharded checkpoint (written with "
            "save_distributed_checkpoint, it holds both); give a .ckpt file or a complete sharded folder"
        )
    links = [name for name in (".metadata", "meta.pt") if os.path.islink(os.path.join(folder, name))]
    if links:
        raise UnsafeCheckpointError(
            f"{field} {folder!r}: its {links[0]} is a link, and a sharded checkpoint is read only from regular files "
            "inside its folder; copy the file into the folder in place of the link"
        )
    check_sharded_index(folder)


def read_sharded_meta(folder: str, check_config: bool = True) -> dict[str, Any]:
    """A sharded checkpoint folder's ``meta.pt`` (everything but the tensors), read as data and checked.

    Args:
        folder: The checkpoint folder.
        check_config: Check its configuration against the schema
            (:func:`~elr_lightning.checkpoints.schema.check_checkpoint_config`); a resumed ``fit`` builds
            its model from its own config instead, and needs no trust in the modules it names.

    Raises:
        ValueError: ``meta.pt`` is empty, damaged or not a checkpoint's dictionary, in one line.
        UnsafeCheckpointError: It holds a pickled object.
        UntrustedModuleError: It names a class of a module that is not trusted.
    """
    from elr_lightning.checkpoints.schema import check_checkpoint_config

    meta = os.path.join(folder, "meta.pt")
    try:
        checkpoint = load_weights_only(meta, mmap=False)
    except UnsafeCheckpointError:
        raise
    except Exception as err:  # torch.load raises many types (EOF, zip, pickle) for a damaged file
        size = os.path.getsize(meta)
        raise ValueError(
            f"checkpoint folder {folder!r}: its meta.pt ({size} bytes) is {'empty' if size == 0 else 'damaged'} "
            f"({type(err).__name__}); use another checkpoint"
        ) from None
    if not isinstance(checkpoint, dict):
        raise ValueError(
            f"checkpoint folder {folder!r}: its meta.pt holds a {type(checkpoint).__name__}, not a checkpoint's "
            "dictionary; use a folder written by save_distributed_checkpoint"
        )
    if check_config:
        check_checkpoint_config(checkpoint, meta)
    return checkpoint


def verify_checkpoint_path(path: str, field: str = "ckpt_path") -> None:
    """Check a checkpoint path before anything loads it; the one message for every command.

    A local file written by ``torch.save`` is a zip archive with a CRC-32 per record: every CRC is
    checked (one read of the file). A file that is not a zip archive is refused unless it is the
    legacy pickle format, which has no checksum: then a warning says so, once. A folder must be a
    sharded (``torch.distributed.checkpoint``) checkpoint: a ``.metadata`` file that names nothing but
    an index's own classes and only shards inside the folder whose bytes hold what it declares
    (:func:`~elr_lightning.checkpoints.safe_load.check_sharded_index`), and a readable ``meta.pt`` that holds no
    pickled object (:func:`read_sharded_meta`). A URL, and Lightning's ``registry`` keyword (a
    download), are refused (:func:`~elr_lightning.checkpoints.safe_load.refuse_url`); the keywords ``last``,
    ``best`` and ``hpc`` name local files that Lightning finds and the strategy's
    :class:`AtomicCheckpointIO` checks as it loads them.

    Args:
        path: The path given.
        field: The option that gave it, for the messages.

    Raises:
        FileNotFoundError: Nothing is at ``path``.
        RemoteCheckpointError: ``path`` is a URL.
        OversizedCheckpointError: A record declares more bytes than the file holds, or a sharded index more
            than its shards hold.
        ValueError: ``path`` is a folder that is not a sharded checkpoint, or its ``meta.pt`` is damaged.
        UnsafeCheckpointError: A sharded checkpoint's index or ``meta.pt`` would run code.
        CorruptCheckpointError: The file is truncated, damaged or not a checkpoint.
    """
    refuse_url(path, field)
    if path.startswith("registry") and not os.path.exists(path):
        raise ValueError(
            f"{field} {path!r} asks Lightning to download a checkpoint from its model registry, and elr-lightning opens "
            "checkpoints from local paths only; download it first and give the local path"
        )
    if path in ("last", "best", "hpc") and not os.path.exists(path):
        return  # Lightning finds a local file, which the strategy's AtomicCheckpointIO checks as it loads it
    check_regular_file(path, field)
    if os.path.isdir(path):
        check_sharded_folder(path, field)
        read_sharded_meta(path, check_config=False)
        return
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{field} {path!r} does not exist; fix the path")
    with open(path, "rb") as f:
        head = f.read(4)
    if head.startswith(b"PK"):
        if not is_intact(path):
            raise _corrupt(path, "its records fail their CRC check or the archive is incomplete")
    elif head.startswith(b"\x80"):
        warnings.warn(
            f"{field} {path!r} is in torch's legacy (non-zip) format, which has no checksum; it is loaded unverified",
            stacklevel=2,
        )
    else:
        raise _corrupt(path, "it is not a torch.save archive")


def is_intact(path: str) -> bool:
    """Whether ``path`` is a complete ``torch.save`` archive (zip directory present, every CRC right).

    The records' declared sizes are checked against the file first
    (:func:`~elr_lightning.checkpoints.safe_load.check_archive`), so the check reads at most the file's own bytes.

    Raises:
        OversizedCheckpointError: A record is compressed or declares more bytes than the file holds.
    """
    check_archive(path)
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip() is None
    except (zipfile.BadZipFile, OSError, EOFError):
        return False


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` with atomic local writes and a clear refusal of damaged files.

    Saving goes through :func:`~elr_lightning.files.write_atomically` (remote URLs fall back to Lightning's own writer).
    Loading a local file first checks the CRC-32 of every record of the archive (``verify``; one
    read of the file), because ``torch.load`` does not: a flipped bit in a tensor would load
    silently. A file that fails the check, or that ``torch.load`` cannot read and is not a complete
    archive, raises :class:`CorruptCheckpointError` naming the file, its size and the fix, instead
    of torch's ``PytorchStreamReader failed reading zip archive``. A sharded checkpoint folder (which
    this plugin cannot load) is refused naming the strategy that resumes it.
    Without an explicit ``weights_only`` (Lightning's default ``None``), a file is read with
    ``weights_only=True``, whatever the environment says (``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``), and a
    file that holds a pickled object is refused in one line (:mod:`elr_lightning.checkpoints.safe_load`). Only a
    caller's explicit ``weights_only=False`` unpickles, as in Lightning; no ``elr`` command passes it.

    A checkpoint given as a URL is refused in one line (:func:`~elr_lightning.checkpoints.safe_load.refuse_url`):
    Lightning's loader would unpickle an ``http`` one with ``weights_only=False``.

    Every run of an :class:`~elr_lightning.module.ELRModule` loads through this plugin, whatever its
    callbacks: the module installs it on the strategy in ``setup``, before Lightning restores a
    checkpoint (:func:`install_safe_checkpoint_io`).

    Args:
        verify: Check the archive's CRCs before loading a local checkpoint file.
    """

    def __init__(self, verify: bool = True) -> None:
        super().__init__()
        self.verify = verify

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> None:
        if "://" in str(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        write_atomically(str(path), lambda f: torch.save(checkpoint, f))

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        map_location: Optional[Callable] = lambda storage, loc: storage,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        refuse_url(str(path), "--ckpt_path")
        check_regular_file(str(path), "--ckpt_path")
        if os.path.isdir(path):
            raise ValueError(
                f"--ckpt_path {str(path)!r} is a sharded checkpoint folder (save_distributed_checkpoint: true), which "
                "only the strategy that wrote it can load; resume it with trainer.strategy.class_path "
                "elr_lightning.strategies.OneLoopOverrideFSDPStrategy (on any number of devices)"
            )
        local_file = os.path.isfile(path)
        if local_file and self.verify and not is_intact(str(path)):
            raise _corrupt(str(path), "its records fail their CRC check or the archive is incomplete")
        weights_only = True if weights_only is None else weights_only
        try:
            with refusing_pickles(str(path)):
                return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        except Exception as err:
            if not local_file or is_intact(str(path)):
                raise
            raise _corrupt(str(path), f"{type(err).__name__}: {err}") from err


def install_safe_checkpoint_io(strategy: Any) -> bool:
    """Make ``strategy`` load (and write) checkpoints through :class:`AtomicCheckpointIO`, where it uses Lightning's own IO.

    Lightning's ``TorchCheckpointIO`` is replaced, also inside a wrapping IO (``AsyncCheckpointIO``),
    so no run falls back to Lightning's loader, which unpickles a URL's checkpoint with
    ``weights_only=False``. A strategy that loads checkpoints itself (the FSDP strategy) or a
    checkpoint IO of the user's own is left as it is.

    Returns:
        Whether the strategy now uses :class:`AtomicCheckpointIO` (false: an IO of the user's own).
    """
    io = strategy.checkpoint_io
    if type(io) is TorchCheckpointIO:
        strategy.checkpoint_io = AtomicCheckpointIO()
        return True
    inner = getattr(io, "checkpoint_io", None)
    if isinstance(io, _WrappingCheckpointIO) and type(inner) is TorchCheckpointIO:
        io.checkpoint_io = AtomicCheckpointIO()
        return True
    return isinstance(io, AtomicCheckpointIO) or isinstance(inner, AtomicCheckpointIO)


def _corrupt(path: str, reason: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"checkpoint {path!r} ({os.path.getsize(path)} bytes) is truncated or corrupt and cannot be loaded "
        f"({reason}). Resume from an earlier checkpoint; files written by AtomicCheckpointIO are never left "
        "half-written, so this one was damaged or cut short by another writer"
    )


def listed(names: list[str], limit: int = 4) -> str:
    """The first ``limit`` names, comma-separated, and how many more there are."""
    return ", ".join(names[:limit]) + (f", ... {len(names) - limit} more" if len(names) > limit else "")


def _part(key: str) -> str:
    if ".conditioner." in key or "_mod." in key:
        return "conditioning"
    if ".update." in key:
        return "state-update"
    return "model"


def state_dict_differences(saved: dict[str, Any], own: dict[str, Any]) -> list[str]:
    """Human-readable differences between a checkpoint's tensors and a module's."""
    problems = []
    for part, fix in (
        ("conditioning", "model.init_args.conditioner"),
        ("state-update", "model.init_args.update"),
        ("model", "model.init_args.arch"),
    ):
        extra = sorted(k for k in set(saved) - set(own) if _part(k) == part)
        missing = sorted(k for k in set(own) - set(saved) if _part(k) == part)
        if extra:
            problems.append(
                f"the checkpoint has {len(extra)} {part} tensor(s) this model lacks ({listed(extra)}); check {fix}"
            )
        if missing:
            problems.append(
                f"this model has {len(missing)} {part} tensor(s) the checkpoint lacks ({listed(missing)}); check {fix}"
            )
    shapes = sorted(
        f"{k} {tuple(saved[k].shape)} vs {tuple(own[k].shape)}"
        for k in set(saved) & set(own)
        if hasattr(saved[k], "shape") and saved[k].shape != own[k].shape
    )
    if shapes:
        problems.append(f"{len(shapes)} tensor(s) differ in shape, checkpoint vs model ({listed(shapes)})")
    return problems


#: Elements :func:`non_finite_tensors` checks at a time.
_FINITE_CHECK_ELEMENTS = 1 << 22


def non_finite_tensors(checkpoint: dict[str, Any]) -> list[str]:
    """Names of the floating-point tensors of a checkpoint's weights and optimizer states with NaN or inf.

    Sharded tensors (``DTensor``) are checked on this rank's shard only.
    """

    def bad(value: Any) -> bool:
        local = value.to_local() if hasattr(value, "to_local") else value
        if not (isinstance(local, Tensor) and local.is_floating_point()):
            return False
        # in slices: isfinite's temporaries for a whole embedding table would add a copy of it to the peak
        return not all(bool(torch.isfinite(part).all()) for part in local.reshape(-1).split(_FINITE_CHECK_ELEMENTS))

    names = [key for key, value in checkpoint.get("state_dict", {}).items() if bad(value)]
    for i, optimizer in enumerate(checkpoint.get("optimizer_states", [])):
        for param, state in optimizer.get("state", {}).items():
            names += [f"optimizer_states[{i}].state[{param}].{key}" for key, value in state.items() if bad(value)]
    return names
