"""``elr prepare``: tokenise a corpus in parallel into a prepared folder of token shards.

Layout of a prepared folder::

    plan.json                  the work units and options (written first; a resume must match it)
    shards/00000.train.bin     token ids of the unit's training documents, each followed by the separator
    shards/00000.val.bin       the same for its held-out documents
    shards/00000.json          the shard's counts, written after its two .bin files
    index.json                 every shard's counts and the tokenizer fingerprint, written last

Each unit of :func:`~elr_lightning.data.readers.plan_units` becomes one shard, whatever process
tokenised it, so the folder is byte-identical for any ``--workers``. A file larger than
``--shard_mb`` is cut into spans at line breaks, one unit each, so workers share it and a worker
holds one span at a time: ``--shard_mb`` bounds its memory, not the file (a plain-text file that
large becomes one document per span; see :mod:`~elr_lightning.data.readers`). A document longer than
:data:`ENCODE_CHARS` is tokenised in pieces cut after line breaks.

A document is held out for validation when the first 8 bytes of the BLAKE2b hash of its
whitespace-normalised text (runs of whitespace as one space, none at the ends), read as a fraction
of 2**64, fall below ``val_fraction``: the split depends only on the text, and a duplicate, or a
copy that differs only in whitespace, lands on the same side.

Every file is written to a temporary name and renamed. ``index.json`` appears only when all shards
are there, and training refuses a folder without it, so a killed prepare never trains on part of
its data. Rerunning the command keeps the finished shards and redoes the rest.
"""

import hashlib
import itertools
import json
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, FIRST_EXCEPTION, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import IO, Any, Optional

import numpy as np
from tqdm import tqdm

from elr_lightning.files import remove_orphans, write_atomically
from elr_lightning.data.base import document_separator
from elr_lightning.data.datamodule import token_dtype
from elr_lightning.data.readers import SpanReader, Unit, plan_units, unit_documents
from elr_lightning.tokenizers import Tokenizer, load_tokenizer

PREPARED_FORMAT = 2
"""Version of ``elr prepare``'s output: 2 cuts large files into spans and hashes whitespace-normalised text."""

READABLE_FORMATS = (1, 2)
"""Versions training reads: the shards and index of both are laid out alike."""

ENCODE_CHARS = 1 << 20
"""Characters of a document tokenised at once (and normalised at once for its hash)."""

SHARD_BYTES = 64 << 20
"""Default input bytes per shard (parquet files are cut at row groups instead)."""

_TOKENIZERS: dict[str, Tokenizer] = {}


def _tokenizer(spec: str) -> Tokenizer:
    """The tokenizer of ``spec``, loaded once per process."""
    if spec not in _TOKENIZERS:
        _TOKENIZERS[spec] = load_tokenizer(spec)
    return _TOKENIZERS[spec]


def normalised_pieces(text: str, chars: int = ENCODE_CHARS) -> Iterator[str]:
    """``" ".join(text.split())`` in pieces, reading ``text`` ``chars`` characters at a time."""
    started = space = False
    for start in range(0, len(text), chars):
        block = text[start : start + chars]
        words = block.split()
        if words:
            if started and (space or block[0].isspace()):
                yield " "
            yield " ".join(words)
            started, space = True, block[-1].isspace()
        else:
            space = True  # a block of whitespace only


def held_out(text: str, val_fraction: float) -> bool:
    """Whether a document is a validation document: the BLAKE2b hash of its whitespace-normalised text
    (:func:`normalised_pieces`) below ``val_fraction`` of 2**64."""
    digest = hashlib.blake2b(digest_size=8)
    for piece in normalised_pieces(text):
        digest.update(piece.encode("utf-8", errors="surrogatepass"))
    return int.from_bytes(digest.digest(), "little") < val_fraction * 2.0**64


def encode_pieces(tokenizer: Tokenizer, text: str, chars: int = ENCODE_CHARS) -> Iterator[list[int]]:
    """The token ids of ``text``, tokenised in pieces of at most ``chars`` characters cut after a line break
    where the piece has one (one piece for a shorter text)."""
    start = 0
    while start < len(text):
        end = len(text) if len(text) - start <= chars else text.rfind("\n", start, start + chars) + 1
        end = end if end > start else start + chars
        yield tokenizer.encode(text[start:end])
        start = end


def shard_paths(out: str, index: int) -> dict[str, str]:
    """The ``train``, ``val`` and ``meta`` paths of shard ``index`` in folder ``out``."""
    stem = os.path.join(out, "shards", f"{index:05d}")
    return {"train": stem + ".train.bin", "val": stem + ".val.bin", "meta": stem + ".json"}


def tokenise_unit(
    index: int, unit: Unit, out: str, spec: str, text_field: str, val_fraction: float, data: Optional[bytes] = None
) -> dict[str, Any]:
    """Tokenise one unit into shard ``index`` of ``out`` (the worker's job).

    Token ids stream to the two ``.bin`` files as documents are read (memory does not grow with the
    unit beyond one document, a span at most); both files are renamed into place at the end, and the
    shard's ``.json`` after them. ``data`` carries a :attr:`~elr_lightning.data.readers.Unit.streamed`
    unit's bytes.

    Returns:
        The shard's counts, also written to its ``.json``.

    Raises:
        ValueError: A document cannot be read, or the tokenizer emits an id outside its vocabulary.
    """
    tokenizer = _tokenizer(spec)
    dtype = token_dtype(tokenizer.vocab_size)
    sep = document_separator(tokenizer)
    counts = {"train_tokens": 0, "val_tokens": 0, "train_documents": 0, "val_documents": 0}

    def write(train: IO[bytes], val: IO[bytes]) -> None:
        for doc in unit_documents(unit, text_field, data):
            split = "val" if held_out(doc, val_fraction) else "train"
            for piece in itertools.chain(encode_pieces(tokenizer, doc), [sep]):
                ids = np.asarray(piece, dtype=np.int64)
                if ids.size and (ids.min() < 0 or ids.max() >= tokenizer.vocab_size):
                    raise ValueError(f"--tokenizer: produced an id outside its vocabulary of {tokenizer.vocab_size}")
                (val if split == "val" else train).write(ids.astype(dtype).tobytes())
                counts[f"{split}_tokens"] += int(ids.size)
            counts[f"{split}_documents"] += 1

    paths = shard_paths(out, index)
    write_atomically(paths["train"], lambda train: write_atomically(paths["val"], lambda val: write(train, val)))
    meta = {"index": index, "input_bytes": unit.size, **counts}
    write_atomically(paths["meta"], lambda f: f.write(json.dumps(meta).encode()))
    return meta


def finished_shard(out: str, index: int, itemsize: int) -> Optional[dict[str, Any]]:
    """Shard ``index``'s counts if its files are complete, else ``None`` (to be redone)."""
    paths = shard_paths(out, index)
    try:
        with open(paths["meta"], encoding="utf-8") as f:
            meta = json.load(f)
        complete = all(os.path.getsize(paths[s]) == meta[f"{s}_tokens"] * itemsize for s in ("train", "val"))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return meta if complete and meta.get("index") == index else None


def _start_folder(out: str, plan: dict[str, Any]) -> bool:
    """Create ``out`` and write its plan; ``True`` when it already holds a finished prepare of this plan."""
    try:
        os.makedirs(os.path.join(out, "shards"), exist_ok=True)
        plan_path = os.path.join(out, "plan.json")
        if os.path.exists(plan_path):
            with open(plan_path, encoding="utf-8") as f:
                started = json.load(f)
            finished = os.path.exists(os.path.join(out, "index.json"))
            if started.get("format") != plan["format"]:
                raise ValueError(
                    f"elr prepare --out: {out!r} holds a {'finished' if finished else 'unfinished'} prepare of another "
                    f"version (layout {started.get('format')}, this one writes {plan['format']}); "
                    + ("train on it as it is, or choose another --out to prepare again" if finished
                       else "finish it with that version, or choose another --out")
                )
            if started != plan:
                raise ValueError(
                    f"elr prepare --out: {out!r} holds a prepare of other sources or options; "
                    "choose another --out or delete that folder"
                )
            remove_orphans(os.path.join(out, "shards"))  # temporary files of a killed run
            return finished
        write_atomically(plan_path, lambda f: f.write(json.dumps(plan).encode()))
        return False
    except OSError as err:
        reason = getattr(err.__cause__, "strerror", None) or err.strerror or err
        raise OSError(f"elr prepare --out: cannot write to {out!r} ({reason}); choose a writable folder") from err


def prepare_corpus(
    sources: Sequence[str],
    out: str,
    tokenizer: str = "byte",
    workers: int = 1,
    text_field: str = "text",
    val_fraction: float = 0.01,
    shard_bytes: int = SHARD_BYTES,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenise ``sources`` into the prepared folder ``out`` (see the module docstring).

    Args:
        sources: Files, folders or globs: text, ``.jsonl[.gz|.zst]`` or parquet.
        out: The prepared folder; rerunning on it resumes an interrupted prepare.
        tokenizer: ``"byte"`` or a HF ``tokenizer.json`` path.
        workers: Processes tokenising units in parallel (1: in this process).
        text_field: JSON key or parquet column holding the text.
        val_fraction: Share of documents held out for validation, in [0, 1).
        shard_bytes: Input bytes per shard for non-parquet files; a larger file is cut into spans of
            about this size (decompressed size for ``.gz``/``.zst``), which bounds a worker's memory.
        progress: Show a progress bar (MB/s and ETA).

    Returns:
        The index written to ``out/index.json``.

    Raises:
        ValueError: An option is out of range, an input is damaged, or ``out`` holds another prepare.
        OSError: ``out`` is not writable.
        RuntimeError: A worker process died (rerunning resumes).
    """
    if workers < 1:
        raise ValueError(f"elr prepare --workers must be >= 1, got {workers}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"elr prepare --val_fraction must be in [0, 1), got {val_fraction}")
    if shard_bytes < 1:
        raise ValueError(f"elr prepare --shard_mb must be positive, got {shard_bytes} bytes")
    tok = _tokenizer(tokenizer)
    dtype = token_dtype(tok.vocab_size)
    units = plan_units(sources, shard_bytes)
    plan = {
        "format": PREPARED_FORMAT,
        "tokenizer_fingerprint": tok.fingerprint(),
        "text_field": text_field,
        "val_fraction": val_fraction,
        "units": [u.describe() for u in units],
    }
    index_path = os.path.join(out, "index.json")
    if _start_folder(out, plan):
        with open(index_path, encoding="utf-8") as f:
            return json.load(f)
    metas: dict[int, dict[str, Any]] = {}
    for i in range(len(units)):
        meta = finished_shard(out, i, dtype.itemsize)
        if meta is not None:
            metas[i] = meta
    todo = [i for i in range(len(units)) if i not in metas]
    bar = tqdm(
        total=sum(u.size for u in units),
        initial=sum(units[i].size for i in metas),
        unit="B",
        unit_scale=True,
        desc="elr prepare",
        disable=not progress,
    )
    with bar:
        if workers == 1:
            for i, data in _unit_data(todo, units):
                metas[i] = tokenise_unit(i, units[i], out, tokenizer, text_field, val_fraction, data)
                bar.update(units[i].size)
        else:
            _run_in_pool(todo, units, out, tokenizer, text_field, val_fraction, workers, metas, bar)
    index = {
        "format": PREPARED_FORMAT,
        "tokenizer_fingerprint": tok.fingerprint(),
        "vocab_size": tok.vocab_size,
        "dtype": dtype.name,
        "separator": document_separator(tok),
        "text_field": text_field,
        "val_fraction": val_fraction,
        "shards": [metas[i] for i in range(len(units))],
        "train_tokens": sum(m["train_tokens"] for m in metas.values()),
        "val_tokens": sum(m["val_tokens"] for m in metas.values()),
    }
    if index["train_tokens"] + index["val_tokens"] == 0:
        raise ValueError(f"elr prepare SOURCES: the {len(units)} input unit(s) contain no documents")
    write_atomically(index_path, lambda f: f.write(json.dumps(index, indent=1).encode()))
    return index


def _unit_data(todo: list[int], units: list[Unit]) -> Iterator[tuple[int, Optional[bytes]]]:
    """Each unit to do, in order, with its bytes when it is a span of a compressed file (else ``None``).

    The compressed files are decompressed here, once, front to back (:class:`SpanReader`): a worker
    cannot start reading a zstd or gzip stream in the middle.
    """
    readers: dict[str, SpanReader] = {}
    try:
        for i in todo:
            unit = units[i]
            if not unit.streamed:
                yield i, None
                continue
            path = unit.files[0]
            if path not in readers:
                readers[path] = SpanReader(path)
            yield i, readers[path].read(unit.span)
    finally:
        for reader in readers.values():
            reader.close()


def _run_in_pool(
    todo: list[int],
    units: list[Unit],
    out: str,
    tokenizer: str,
    text_field: str,
    val_fraction: float,
    workers: int,
    metas: dict[int, dict[str, Any]],
    bar: tqdm,
) -> None:
    """Tokenise the ``todo`` units over ``workers`` processes, filling ``metas`` as shards finish.

    At most ``workers + 1`` units are in flight, so the spans of compressed files handed to the
    workers hold at most that many spans' bytes in this process.
    """
    pool = ProcessPoolExecutor(max_workers=workers)
    futures: dict[Future, int] = {}

    def finish(done: set[Future]) -> None:
        for future in done:
            i = futures.pop(future)
            metas[i] = future.result()
            bar.update(units[i].size)

    try:
        for i, data in _unit_data(todo, units):
            while len(futures) > workers:
                done, _ = wait(set(futures), return_when=FIRST_COMPLETED)
                finish(done)
            futures[pool.submit(tokenise_unit, i, units[i], out, tokenizer, text_field, val_fraction, data)] = i
            del data
        while futures:
            done, _ = wait(set(futures), return_when=FIRST_EXCEPTION)
            finish(done)
    except BrokenProcessPool as err:
        raise RuntimeError(
            f"elr prepare --workers: a worker process died (killed or out of memory) with {len(todo) - len(metas)} "
            "shard(s) left; rerun the same command to resume (finished shards are kept)"
        ) from err
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
