"""What ``elr prepare`` reads: its inputs cut into work units, and the documents of each unit.

Inputs are text files, ``.jsonl`` (plain, ``.gz`` or ``.zst``) and parquet files with a text column.
:func:`plan_units` cuts them into units that depend only on the files and ``shard_bytes`` (never on
the worker count): one unit per parquet row group, runs of smaller files up to ``shard_bytes`` of
input, and a file larger than ``shard_bytes`` cut into spans of about ``shard_bytes`` each, so
several workers share it and none holds more than a span. Each unit becomes one shard, so the
prepared folder is the same bytes for any ``--workers``.

A span ends at the first line break at or after ``shard_bytes`` from its start (the file's end
for the last), so a JSON record is never cut. A plain-text file larger than ``shard_bytes`` becomes
one document per span (a smaller one stays one document); a span of plain text whose line runs
``shard_bytes`` past the mark without a break ends at the mark (moved on to a character boundary).
Compressed ``.jsonl.gz``/``.jsonl.zst`` files are cut by decompressed bytes: planning decompresses
them once to find the line breaks, and the process that runs ``elr prepare`` decompresses them
again to hand each span's bytes to a worker.
"""

import gzip
import io
import itertools
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any, Optional

from elr_lightning.data.sources import TEXT_SUFFIXES, decode_text, read_text, record_text, resolve_sources
from elr_lightning.errors import install_extra

JSONL_SUFFIXES: tuple[str, ...] = (".jsonl", ".jsonl.gz", ".jsonl.zst")
"""Files read one JSON record per line."""

COMPRESSED_SUFFIXES: tuple[str, ...] = (".gz", ".zst")
"""Files whose spans are ranges of their decompressed bytes."""

PREPARE_SUFFIXES: tuple[str, ...] = tuple(dict.fromkeys(TEXT_SUFFIXES + JSONL_SUFFIXES + (".parquet",)))
"""Files a folder given to ``elr prepare`` contributes (searched recursively)."""

#: The field the errors about ``elr prepare``'s sources name.
SOURCES_FIELD = "elr prepare SOURCES"
#: The field the errors about a record without text name.
TEXT_FIELD = "elr prepare --text_field"

_READ = 1 << 20
"""Bytes read at a time while looking for a line break or decompressing."""


@dataclass(frozen=True)
class Unit:
    """One shard's worth of input: some files, one row group of a parquet file, or a span of one file.

    Attributes:
        files: Input files, read in order.
        row_group: The parquet row group, or ``None`` for whole files.
        size: Input bytes (file sizes, the row group's compressed size, or the span's length): the
            progress bar's unit.
        span: Byte range ``[start, end)`` of the one file (of its decompressed bytes when it is
            compressed), or ``None`` for whole files.
    """

    files: tuple[str, ...]
    row_group: Optional[int]
    size: int
    span: Optional[tuple[int, int]] = None

    def describe(self) -> list[Any]:
        """The unit as JSON (files with size and modification time), to detect changed inputs on resume."""
        files = [[p, os.path.getsize(p), os.stat(p).st_mtime_ns] for p in self.files]
        return [files, self.row_group] + ([list(self.span)] if self.span is not None else [])

    @property
    def streamed(self) -> bool:
        """Whether the unit is a span of a compressed file, whose bytes the caller decompresses and passes."""
        return self.span is not None and self.files[0].endswith(COMPRESSED_SUFFIXES)


def _parquet_file(path: str) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ImportError(
            f"{SOURCES_FIELD}: {path!r} is parquet, which needs pyarrow: {install_extra('data')}"
        ) from err
    try:
        return pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises ArrowInvalid, OSError and others for a damaged file
        raise ValueError(f"{SOURCES_FIELD}: {path!r} is not a readable parquet file ({err}); replace or remove it") from err


def plan_units(sources: Sequence[str], shard_bytes: int) -> list[Unit]:
    """Resolve ``sources`` and cut them into work units (see the module docstring).

    Args:
        sources: Files, folders (their :data:`PREPARE_SUFFIXES` files, recursively) or globs.
        shard_bytes: Input bytes after which a run of files is closed into a unit; a file larger
            than this is cut into spans of about this many bytes.

    Returns:
        The units, in input order.

    Raises:
        FileNotFoundError: A source does not exist.
        ValueError: A source matches nothing, or a parquet or compressed file cannot be read.
    """
    units: list[Unit] = []
    run: list[str] = []
    run_size = 0

    def close_run() -> None:
        nonlocal run, run_size
        if run:
            units.append(Unit(tuple(run), None, run_size))
            run, run_size = [], 0

    for path in resolve_sources(list(sources), PREPARE_SUFFIXES, SOURCES_FIELD):
        if path.endswith(".parquet"):
            close_run()
            meta = _parquet_file(path).metadata
            for group in range(meta.num_row_groups):
                units.append(Unit((path,), group, meta.row_group(group).total_byte_size))
            continue
        size = os.path.getsize(path)
        if size > shard_bytes:
            close_run()
            units += [Unit((path,), None, end - start, (start, end)) for start, end in file_spans(path, shard_bytes)]
            continue
        run.append(path)
        run_size += size
        if run_size >= shard_bytes:
            close_run()
    close_run()
    return units


def file_spans(path: str, span_bytes: int) -> list[tuple[int, int]]:
    """``[start, end)`` byte ranges that cut ``path`` (its decompressed bytes if compressed) into spans.

    Each span ends at the first line break at or after ``span_bytes`` from its start; in plain text
    (not ``.jsonl``) a span with no break within ``2 * span_bytes`` ends at ``span_bytes``, moved on
    to the next character boundary.
    """
    if path.endswith(COMPRESSED_SUFFIXES):
        return _stream_spans(path, span_bytes)
    size = os.path.getsize(path)
    records = path.endswith(JSONL_SUFFIXES)
    spans, start = [], 0
    with open(path, "rb") as f:
        while start < size:
            end = _line_end(f, start + span_bytes, size, None if records else start + 2 * span_bytes)
            spans.append((start, end))
            start = end
    return spans


def _line_end(f: IO[bytes], mark: int, size: int, give_up: Optional[int]) -> int:
    """Offset just after the first ``\\n`` at or after ``mark - 1`` (``size`` if none); when none comes before
    ``give_up``, the first character boundary at or after the mark."""
    if mark >= size:
        return size
    pos = mark - 1
    while pos < size and (give_up is None or pos < give_up):
        f.seek(pos)
        chunk = f.read(_READ if give_up is None else min(_READ, give_up - pos))
        found = chunk.find(b"\n")
        if found >= 0:
            return pos + found + 1
        pos += len(chunk)
    if pos >= size:
        return size
    f.seek(mark)
    head = f.read(3)  # step over the UTF-8 continuation bytes at the mark (at most 3) to a character's start
    ahead = 0
    while ahead < len(head) and 0x80 <= head[ahead] < 0xC0:
        ahead += 1
    return mark + ahead


def _stream_spans(path: str, span_bytes: int) -> list[tuple[int, int]]:
    """:func:`file_spans` of a compressed file: one pass of decompression, cutting at the line breaks."""
    spans, start, pos, mark = [], 0, 0, span_bytes
    with _open_binary(path) as f:
        while chunk := _read(f, path):
            while pos + len(chunk) >= mark:
                found = chunk.find(b"\n", max(0, mark - 1 - pos))
                if found < 0:
                    break
                end = pos + found + 1
                spans.append((start, end))
                start, mark = end, end + span_bytes
            pos += len(chunk)
    if pos > start:
        spans.append((start, pos))
    return spans


class SpanReader:
    """The decompressed bytes of a compressed file's spans, read forward in one pass.

    Args:
        path: A ``.jsonl.gz`` or ``.jsonl.zst`` file.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._file = _open_binary(path)
        self.pos = 0

    def read(self, span: tuple[int, int]) -> bytes:
        """Bytes ``[start, end)`` of the decompressed stream; ``start`` must not be behind the last read's end.

        Raises:
            ValueError: The file ends before ``end`` (it changed since it was planned) or is damaged.
        """
        start, end = span
        if start < self.pos:
            raise ValueError(f"SpanReader: span {span} of {self.path!r} is behind the read position {self.pos}")
        while self.pos < start:
            skipped = _read(self._file, self.path, min(_READ, start - self.pos))
            if not skipped:
                break
            self.pos += len(skipped)
        data = _read(self._file, self.path, end - start) if self.pos == start else b""
        self.pos += len(data)
        if len(data) != end - start:
            raise ValueError(f"{SOURCES_FIELD}: {self.path!r} ended before byte {end}; it changed while being read")
        return data

    def close(self) -> None:
        """Close the file."""
        self._file.close()


def _open_binary(path: str) -> IO[bytes]:
    """``path``'s bytes, decompressed if it is ``.gz`` or ``.zst``."""
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        try:
            import zstandard
        except ImportError as err:
            raise ImportError(
                f"{SOURCES_FIELD}: {path!r} is zstd-compressed, which needs zstandard: {install_extra('data')}"
            ) from err
        return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)
    return open(path, "rb")


def _read(f: IO[bytes], path: str, n: int = _READ) -> bytes:
    """Up to ``n`` bytes of ``f`` (fewer only at its end), a damaged file refused naming ``path``."""
    parts, got = [], 0
    with _reading(path):
        while got < n:
            part = f.read(n - got)
            if not part:
                break
            parts.append(part)
            got += len(part)
    return b"".join(parts)


@contextmanager
def _reading(path: str) -> Iterator[None]:
    """Turn the errors of reading a damaged or truncated ``path`` into one line naming it."""
    try:
        yield
    except (OSError, EOFError, UnicodeDecodeError) as err:
        raise ValueError(f"{SOURCES_FIELD}: {path!r} cannot be read to its end ({err}); replace or remove it") from err
    except Exception as err:
        if type(err).__module__.startswith("zstd"):  # zstandard.ZstdError: a damaged frame
            raise ValueError(f"{SOURCES_FIELD}: {path!r} is not valid zstd ({err}); replace or remove it") from err
        raise


def _jsonl_documents(path: str, text_field: str) -> Iterator[str]:
    with _reading(path), io.TextIOWrapper(_open_binary(path), encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                yield record_text(line, path, lineno, text_field, TEXT_FIELD, SOURCES_FIELD)


def _span_documents(unit: Unit, text_field: str, data: Optional[bytes]) -> Iterator[str]:
    """The documents of a span unit: its JSON records, or (plain text) the span as one document."""
    path, (start, end) = unit.files[0], unit.span
    if data is None:
        with _reading(path), open(path, "rb") as f:
            f.seek(start)
            data = f.read(end - start)
    if len(data) != end - start:
        raise ValueError(f"{SOURCES_FIELD}: {path!r} ended before byte {end}; it changed since the prepare began")
    where = f"{path} (bytes {start}..{end})"
    if not path.endswith(JSONL_SUFFIXES):
        text, data = decode_text(data, where), None
        yield text
        return
    pos = 0
    for lineno in itertools.count(1):
        if pos >= len(data):
            return
        cut = data.find(b"\n", pos)
        cut = len(data) if cut < 0 else cut + 1
        with _reading(where):
            line = data[pos:cut].decode("utf-8")
        pos = cut
        if line.strip():
            yield record_text(line, where, lineno, text_field, TEXT_FIELD, SOURCES_FIELD)


def _parquet_documents(path: str, row_group: int, text_field: str) -> Iterator[str]:
    parquet = _parquet_file(path)
    names = parquet.schema_arrow.names
    if text_field not in names:
        raise ValueError(f"{TEXT_FIELD}: parquet {path!r} has no column {text_field!r} (columns {names}); pass the text column")
    try:
        column = parquet.read_row_group(row_group, columns=[text_field]).column(0)
    except Exception as err:  # a damaged page or an unexpected type
        raise ValueError(f"{SOURCES_FIELD}: {path!r} row group {row_group} cannot be read ({err}); replace it") from err
    for i, value in enumerate(column.to_pylist()):
        if not isinstance(value, str):
            raise ValueError(
                f"{TEXT_FIELD}: {text_field!r} of row {i} in row group {row_group} of {path!r} is "
                f"{type(value).__name__}, not a string"
            )
        yield value


def unit_documents(unit: Unit, text_field: str, data: Optional[bytes] = None) -> Iterator[str]:
    """The documents of a unit: one per plain file or plain-text span, one per JSON record or parquet row.

    Args:
        unit: A unit of :func:`plan_units`.
        text_field: Key (``.jsonl``) or column (parquet) holding the text.
        data: The span's bytes, for a :attr:`Unit.streamed` unit (:class:`SpanReader`); read from the
            file otherwise.

    Raises:
        ValueError: A file is damaged, not text, or a record lacks a string ``text_field``.
    """
    if unit.span is not None:
        yield from _span_documents(unit, text_field, data)
        return
    for path in unit.files:
        if unit.row_group is not None:
            yield from _parquet_documents(path, unit.row_group, text_field)
        elif path.endswith(JSONL_SUFFIXES):
            yield from _jsonl_documents(path, text_field)
        else:
            yield read_text(path)
