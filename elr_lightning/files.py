"""Files that a kill mid-write never leaves half-written: atomic writes, text files and figures.

Every file the library writes (checkpoints, prepared data, exports, reports, figures) goes through
:func:`replace_atomically`: a temporary file beside the target, flushed to disk, then ``os.replace`` d
over it, so a path holds its old contents or its new ones, never a mix; :func:`remove_orphans` clears
the temporary files a kill left behind. Imports nothing of the package.
"""

from __future__ import annotations

import os
import re
import sys
import uuid
from collections.abc import Iterable, Sequence
from typing import IO, Any, Callable, Union


def fsync_folder(folder: str) -> None:
    """Flush a folder's entries (a rename into it) to disk; a no-op where folders cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


#: Names of :func:`replace_atomically`'s temporary files: ``.<name>.<32 hex digits>.tmp``.
TEMPORARY_NAME = re.compile(r"^\..+\.[0-9a-f]{32}\.tmp$")


def replace_atomically(path: str, fill: Callable[[str], None], overwrite: bool = True) -> None:
    """Make ``path`` anew through a temporary path in its folder, then ``os.replace`` it into place.

    If ``fill`` raises (or the process dies) only the temporary path is affected: ``path`` keeps
    its previous contents. The folder is flushed after the rename. A kill can leave the temporary
    file behind; :func:`remove_orphans` clears them.

    Args:
        path: The destination.
        fill: Creates the complete new contents at the (not yet existing) temporary path it is given.
        overwrite: Replace an existing ``path``. When false, the new file is hard-linked into place,
            which fails if ``path`` exists however it came to (on a file system without hard links,
            a check just before the rename stands in).

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is false; nothing was written.
        OSError: The folder cannot be created or written, naming the folder (not the hidden
            temporary path) and the fix.
    """
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
    exists = False
    try:
        os.makedirs(folder, exist_ok=True)
        fill(tmp)
        if overwrite:
            os.replace(tmp, path)
        else:
            exists = not _link_new(tmp, path)
    except OSError as err:
        _remove_quietly(tmp)
        raise type(err)(
            f"cannot write {os.path.basename(path)!r} into the folder {folder!r} ({err.strerror or err}); "
            "make the folder writable, free space, or write elsewhere"
        ) from err
    except BaseException:
        _remove_quietly(tmp)
        raise
    if exists:
        raise FileExistsError(f"{path!r} exists and is never replaced; give a new path or remove it first")
    fsync_folder(folder)


def _link_new(tmp: str, path: str) -> bool:
    """Move ``tmp`` to ``path`` unless ``path`` exists; whether it was moved (``tmp`` is gone either way)."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        _remove_quietly(tmp)
        return False
    except OSError:  # no hard links on this file system
        if os.path.lexists(path):
            _remove_quietly(tmp)
            return False
        os.replace(tmp, path)
        return True
    _remove_quietly(tmp)
    return True


def _remove_quietly(path: str) -> None:
    if os.path.lexists(path):
        try:
            os.remove(path)
        except OSError:
            pass


def remove_orphans(folder: str) -> list[str]:
    """Delete the temporary files that a killed :func:`replace_atomically` left in ``folder``.

    Only names matching :data:`TEMPORARY_NAME` are touched. Call it when no other writer uses the
    folder (at the start of a run).

    Returns:
        The paths removed.
    """
    if not os.path.isdir(folder):
        return []
    removed = [os.path.join(folder, name) for name in os.listdir(folder) if TEMPORARY_NAME.match(name)]
    for path in removed:
        _remove_quietly(path)
    return removed


def write_atomically(path: str, write: Callable[[IO[bytes]], None], overwrite: bool = True) -> None:
    """Write ``path`` with :func:`replace_atomically`, the temporary file flushed to disk first.

    Args:
        path: The destination file.
        write: Writes the whole contents to the binary file object it is given.
        overwrite: Replace an existing ``path``; when false, an existing one raises ``FileExistsError``
            and is left as it is.
    """

    def fill(tmp: str) -> None:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, new_file_mode())

    replace_atomically(path, fill, overwrite)


def write_file(path: Union[str, os.PathLike], data: Union[str, bytes], overwrite: bool = True) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` through a temporary file and a rename (:func:`write_atomically`).

    What a command writes into its output folder goes through here: a kill leaves the old file or
    the new one, and a symbolic link at ``path`` is replaced by the new file, never followed (its
    target is left as it was).

    Args:
        path: The destination file.
        data: The contents.
        overwrite: Replace an existing ``path``; when false, an existing one raises ``FileExistsError``.
    """
    raw = data.encode("utf-8") if isinstance(data, str) else data
    write_atomically(os.fspath(path), lambda f: f.write(raw), overwrite=overwrite)


def save_figure(figure: Any, path: Union[str, os.PathLike], **kwargs: Any) -> None:
    """``figure.savefig`` into ``path`` as :func:`write_file` writes: atomically, replacing a symbolic link, not following it.

    Args:
        figure: A matplotlib figure.
        path: The image file; its suffix gives the format (``.png``).
        kwargs: For ``savefig`` (``dpi``).
    """
    fmt = os.path.splitext(os.fspath(path))[1].lstrip(".") or "png"
    write_atomically(os.fspath(path), lambda f: figure.savefig(f, format=fmt, **kwargs))


def new_file_mode() -> int:
    """The mode a new file gets from ``open``: ``0o666`` less the user's umask (``0o644`` under umask 022)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def refuse_to_replace(
    flag: str, folder: Union[str, os.PathLike], names: Iterable[str], overwrite: bool, what: str = "them"
) -> None:
    """The one rule of every command that writes named files into a folder: never replace one unasked.

    Args:
        flag: The command's option that names the folder (``--out``, ``--output_dir``).
        folder: The folder.
        names: The files the command is about to write there.
        overwrite: The command's ``--overwrite``: replacing is allowed.
        what: What replacing replaces, for the message.

    Raises:
        FileExistsError: One of ``names`` exists (a symbolic link counts) and ``overwrite`` is false,
            naming them, the folder and the fix, in one line.
    """
    held = [name for name in names if os.path.lexists(os.path.join(folder, name))]
    if held and not overwrite:
        raise FileExistsError(
            f"{flag} {os.fspath(folder)!r} already holds {', '.join(held)}; choose a new folder, "
            f"or add --overwrite to replace {what}"
        )


def print_written(command: str, table: str, pictures: Sequence[str]) -> None:
    """Say on stderr where ``elr COMMAND`` wrote its table (a JSON file) and its picture(s)."""
    print(f"elr {command}: wrote the table to {table} and the picture to {', '.join(pictures)}", file=sys.stderr, flush=True)
