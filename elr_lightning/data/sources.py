"""Corpus files and their documents: what ``data.sources`` names, expanded and read.

``resolve_sources`` turns files, directories and globs (or nothing, for the standard library of the
running interpreter) into an ordered list of files; ``iter_documents`` reads them as documents.
"""

import glob
import json
import os
import sysconfig
from collections.abc import Iterator, Sequence
from typing import Optional, Union

TEXT_SUFFIXES: tuple[str, ...] = (".py", ".txt", ".md", ".jsonl")
"""Files a directory in ``data.sources`` contributes (searched recursively, hidden entries skipped)."""

STDLIB_EXCLUDED_DIRS: frozenset[str] = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages"})
"""Folders of the standard library left out of the default corpus."""

_GLOB_CHARS = frozenset("*?[")


def default_corpus_files() -> list[str]:
    """The default corpus: ``*.py`` sources of the running interpreter's standard library.

    Test folders (``test``, ``tests``, ``idle_test``) and installed packages (anything under
    ``site-packages``/``dist-packages``) are left out.

    Returns:
        Absolute paths, sorted by their path relative to the standard library folder.

    Raises:
        ValueError: No source file was found (an interpreter installed without its sources).
    """
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in STDLIB_EXCLUDED_DIRS and d != "__pycache__"]
        found.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    if not found:
        raise ValueError(f"data.sources: no standard-library sources under {root!r}; set data.sources to text files")
    return sorted((os.path.abspath(p) for p in found), key=lambda p: os.path.relpath(p, root).split(os.sep))


def _files_in_directory(root: str, suffixes: tuple[str, ...]) -> list[str]:
    """Files under ``root`` ending in one of ``suffixes``, recursively, hidden entries skipped, sorted."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        found.extend(
            os.path.join(dirpath, f) for f in filenames if f.endswith(suffixes) and not f.startswith(".")
        )
    return sorted(found, key=lambda p: os.path.relpath(p, root).split(os.sep))


def resolve_sources(
    sources: Optional[Union[Sequence[str], str]], suffixes: tuple[str, ...] = TEXT_SUFFIXES, field: str = "data.sources"
) -> list[str]:
    """Expand ``data.sources`` into an ordered list of files.

    Each entry is a file, a directory (its ``suffixes`` files, recursively, sorted) or a
    glob pattern (``**`` allowed; matches sorted). Order follows the entries; a file reached twice
    is kept at its first place.

    Args:
        sources: The entries (a single entry may be given as a string), or ``None`` for
            :func:`default_corpus_files`.
        suffixes: File endings a directory contributes.
        field: How errors name the option (``"data.sources"``, or a command's argument).

    Returns:
        Absolute file paths.

    Raises:
        FileNotFoundError: An entry is neither a glob nor an existing path.
        ValueError: ``sources`` is empty, or an entry or the whole list yields no file.
    """
    if sources is None:
        return default_corpus_files()
    if isinstance(sources, str):
        sources = [sources]
    if len(sources) == 0:
        raise ValueError(f"{field} is an empty list; give files, directories or globs, or null for the stdlib")
    files: list[str] = []
    for entry in sources:
        if any(c in _GLOB_CHARS for c in entry):
            matched = sorted(p for p in glob.glob(entry, recursive=True) if os.path.isfile(p))
            if not matched:
                raise ValueError(f"{field}: pattern {entry!r} matches no files")
        elif os.path.isdir(entry):
            matched = _files_in_directory(entry, suffixes)
            if not matched:
                raise ValueError(
                    f"{field}: directory {entry!r} holds no {'/'.join(suffixes)} files; "
                    "list its files or a glob instead"
                )
        elif os.path.isfile(entry):
            matched = [entry]
        else:
            raise FileNotFoundError(f"{field}: {entry!r} does not exist; fix the path or remove it from the list")
        files.extend(os.path.abspath(p) for p in matched)
    return list(dict.fromkeys(files))


def read_text(path: str) -> str:
    """The contents of ``path`` as UTF-8 text, refusing binary files by name.

    Raises:
        ValueError: The file holds a NUL byte (a binary file, e.g. an executable) or bytes that are not
            UTF-8.
    """
    with open(path, "rb") as f:
        return decode_text(f.read(), path)


def decode_text(data: bytes, path: str) -> str:
    """``data``, read from ``path``, as UTF-8 text, refusing binary content by name (see :func:`read_text`).

    Raises:
        ValueError: ``data`` holds a NUL byte or bytes that are not UTF-8.
    """
    nul = data.find(b"\0")
    if nul >= 0:
        raise ValueError(
            f"data.sources: {path!r} is not a text file (NUL byte at offset {nul}); remove it from data.sources"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"data.sources: {path!r} is not UTF-8 text (byte {err.start}: {err.reason}); convert it to UTF-8 "
            "or remove it from data.sources"
        ) from err


def iter_documents(files: Sequence[str], text_field: str = "text") -> Iterator[str]:
    """Yield the documents of the corpus: one per plain file, one per ``.jsonl`` record.

    Every file must be UTF-8 text without NUL bytes (:func:`read_text`). Each non-blank line of a
    ``.jsonl`` file must be a JSON object whose ``text_field`` is a string.

    Args:
        files: Files from :func:`resolve_sources`.
        text_field: Key holding the text in ``.jsonl`` records.

    Yields:
        Document texts, in file order.

    Raises:
        ValueError: A file is not text, or a ``.jsonl`` line is not JSON or lacks a string ``text_field``.
    """
    for path in files:
        text = read_text(path)
        if not path.endswith(".jsonl"):
            yield text
            continue
        for lineno, line in enumerate(text.split("\n"), start=1):
            if line.strip():
                yield record_text(line, path, lineno, text_field)


def record_text(
    line: str, path: str, lineno: int, text_field: str, field: str = "data.text_field", sources: str = "data.sources"
) -> str:
    """The text of one ``.jsonl`` line, refusing a line that is not a JSON object with a string ``text_field``.

    Args:
        line: The line (not blank).
        path: Its file, for the error.
        lineno: Its 1-based line number, for the error.
        text_field: Key holding the text.
        field: How errors name the option holding ``text_field``.
        sources: How errors name the option listing the files.

    Raises:
        ValueError: The line is not JSON, or lacks a string ``text_field``.
    """
    return record_strings(line, path, lineno, {field: text_field}, sources)[0]


def record_strings(line: str, path: str, lineno: int, fields: dict[str, str], sources: str) -> list[str]:
    """The string values of several keys of one ``.jsonl`` line, in the order of ``fields``.

    Args:
        line: The line (not blank).
        path: Its file, for the error.
        lineno: Its 1-based line number, for the error.
        fields: How errors name each option -> the key it holds, e.g. ``{"data.prompt_field": "prompt"}``.
        sources: How errors name the option listing the files.

    Raises:
        ValueError: The line is not JSON, or lacks a key, or a key's value is not a string; naming the
            file, the line, the key and the option.
    """
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{sources}: {path}:{lineno} is not valid JSON ({err.msg})") from err
    values = []
    for field, key in fields.items():
        if not isinstance(record, dict) or key not in record:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(
                f"{field}: record at {path}:{lineno} has no {key!r} field (found {keys}); set {field} to the key "
                "holding the text"
            )
        value = record[key]
        if not isinstance(value, str):
            raise ValueError(f"{field}: {key!r} at {path}:{lineno} is a {type(value).__name__}, not a string")
        values.append(value)
    return values


def capped_documents(documents: Iterator[str], max_bytes: Optional[int]) -> Iterator[str]:
    """Pass documents through until their UTF-8 size reaches ``max_bytes``; cut the last one there."""
    budget = max_bytes
    for doc in documents:
        if budget is None:
            yield doc
            continue
        data = doc.encode("utf-8")
        if len(data) >= budget:
            yield data[:budget].decode("utf-8", errors="ignore")
            return
        budget -= len(data)
        yield doc
