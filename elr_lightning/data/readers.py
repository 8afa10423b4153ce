"""What ``elr prepare`` reads: its inputs cut into work units, and the documents of each unit.

Inputs are text files, ``.jsonl`` (plain, ``.gz`` or ``.zst``) and parquet files with a text column.
:func:`plan_units` cuts them into units that depend only on the files (never on the worker count):
one unit per parquet row group, and runs of other files up to ``shard_bytes`` of input. Each unit
becomes one shard, so the prepared folder is the same bytes for any ``--workers``.
"""

import gzip
import io
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any, Optional

from elr_lightning.data.sources import TEXT_SUFFIXES, read_text, record_text, resolve_sources

JSONL_SUFFIXES: tuple[str, ...] = (".jsonl", ".jsonl.gz", ".jsonl.zst")
"""Files read one JSON record per line."""

PREPARE_SUFFIXES: tuple[str, ...] = tuple(dict.fromkeys(TEXT_SUFFIXES + JSONL_SUFFIXES + (".parquet",)))
"""Files a folder given to ``elr prepare`` contributes (searched recursively)."""

SOURCES_FIELD = "elr prepare SOURCES"
TEXT_FIELD = "elr prepare --text-field"


@dataclass(frozen=True)
class Unit:
    """One shard's worth of input: some files, or one row group of a parquet file.

    Attributes:
        files: Input files, read in order.
        row_group: The parquet row group, or ``None`` for whole files.
        size: Input bytes (file sizes, or the row group's compressed size): the progress bar's unit.
    """

    files: tuple[str, ...]
    row_group: Optional[int]
    size: int

    def describe(self) -> list[Any]:
        """The unit as JSON (files with size and modification time), to detect changed inputs on resume."""
        return [[[p, os.path.getsize(p), os.stat(p).st_mtime_ns] for p in self.files], self.row_group]


def _parquet_file(path: str) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ImportError(
            f"{SOURCES_FIELD}: {path!r} is parquet, which needs pyarrow: pip install 'elr-lightning[data]'"
        ) from err
    try:
        return pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises ArrowInvalid, OSError and others for a damaged file
        raise ValueError(f"{SOURCES_FIELD}: {path!r} is not a readable parquet file ({err}); replace or remove it") from err


def plan_units(sources: Sequence[str], shard_bytes: int) -> list[Unit]:
    """Resolve ``sources`` and cut them into work units.

    Args:
        sources: Files, folders (their :data:`PREPARE_SUFFIXES` files, recursively) or globs.
        shard_bytes: Input bytes after which a run of non-parquet files is closed into a unit.

    Returns:
        The units, in input order.

    Raises:
        FileNotFoundError: A source does not exist.
        ValueError: A source matches nothing, or a parquet file cannot be read.
    """
    units: list[Unit] = []
    run: list[str] = []
    run_size = 0
    for path in resolve_sources(list(sources), PREPARE_SUFFIXES, SOURCES_FIELD):
        if path.endswith(".parquet"):
            if run:
                units.append(Unit(tuple(run), None, run_size))
                run, run_size = [], 0
            meta = _parquet_file(path).metadata
            for group in range(meta.num_row_groups):
                units.append(Unit((path,), group, meta.row_group(group).total_byte_size))
            continue
        run.append(path)
        run_size += os.path.getsize(path)
        if run_size >= shard_bytes:
            units.append(Unit(tuple(run), None, run_size))
            run, run_size = [], 0
    if run:
        units.append(Unit(tuple(run), None, run_size))
    return units


def _open_jsonl(path: str) -> IO[str]:
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    if path.endswith(".zst"):
        try:
            import zstandard
        except ImportError as err:
            raise ImportError(
                f"{SOURCES_FIELD}: {path!r} is zstd-compressed, which needs zstandard: pip install 'elr-lightning[data]'"
            ) from err
        raw = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)
        return io.TextIOWrapper(raw, encoding="utf-8")
    return open(path, encoding="utf-8")


def _jsonl_documents(path: str, text_field: str) -> Iterator[str]:
    try:
        with _open_jsonl(path) as f:
            for lineno, line in enumerate(f, start=1):
                if line.strip():
                    yield record_text(line, path, lineno, text_field, TEXT_FIELD, SOURCES_FIELD)
    except (OSError, EOFError, UnicodeDecodeError) as err:
        raise ValueError(f"{SOURCES_FIELD}: {path!r} cannot be read to its end ({err}); replace or remove it") from err
    except Exception as err:
        if type(err).__module__.startswith("zstd"):  # zstandard.ZstdError: a damaged frame
            raise ValueError(f"{SOURCES_FIELD}: {path!r} is not valid zstd ({err}); replace or remove it") from err
        raise


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


def unit_documents(unit: Unit, text_field: str) -> Iterator[str]:
    """The documents of a unit: one per plain file, one per JSON record or parquet row.

    Args:
        unit: A unit of :func:`plan_units`.
        text_field: Key (``.jsonl``) or column (parquet) holding the text.

    Raises:
        ValueError: A file is damaged, not text, or a record lacks a string ``text_field``.
    """
    for path in unit.files:
        if unit.row_group is not None:
            yield from _parquet_documents(path, unit.row_group, text_field)
        elif path.endswith(JSONL_SUFFIXES):
            yield from _jsonl_documents(path, text_field)
        else:
            yield read_text(path)
