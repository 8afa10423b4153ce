"""``TextDataModule``: a text corpus tokenised once into a cached token shard, served as fixed windows."""

import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any, Optional, Union

import numpy as np
from torch.utils.data import DataLoader

from elr_lightning.files import write_atomically
from elr_lightning.data.base import TokenDataModule, document_separator
from elr_lightning.data.sources import capped_documents, iter_documents, resolve_sources
from elr_lightning.data.windows import StepIndexedLoader, TokenWindows
from elr_lightning.tokenizers import Tokenizer, load_tokenizer

CACHE_FORMAT = 1
"""Version of the shard layout; part of the cache key, bumped when the layout changes."""


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned-or-int32 dtype holding every id below ``vocab_size``.

    Args:
        vocab_size: Number of ids.

    Returns:
        ``uint8``, ``uint16`` or ``int32``.

    Raises:
        ValueError: ``vocab_size`` is below 1 or its ids do not fit in ``int32``.
    """
    for dtype in (np.uint8, np.uint16, np.int32):
        if 1 <= vocab_size and vocab_size - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise ValueError(
        f"data.tokenizer: vocabulary of {vocab_size} ids does not fit an int32 token shard; use a smaller vocabulary"
    )


#: Bytes hashed at each end of a source file for the cache key; smaller files are hashed whole.
SIGNATURE_BLOCK = 1 << 20


def file_signature(path: str) -> list[Any]:
    """Path, size, modification time and a SHA-256 of the first and last :data:`SIGNATURE_BLOCK` bytes.

    The hash catches an edit that keeps a file's size and modification time (a copy with
    ``cp -p``, a restored backup, a coarse file-system clock). Files up to two blocks are hashed
    whole; in larger ones an edit of the middle alone, with size and mtime unchanged, is the one
    change the key misses.
    """
    st = os.stat(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(SIGNATURE_BLOCK))
        if st.st_size > SIGNATURE_BLOCK:
            f.seek(max(SIGNATURE_BLOCK, st.st_size - SIGNATURE_BLOCK))
            digest.update(f.read(SIGNATURE_BLOCK))
    return [path, st.st_size, st.st_mtime_ns, digest.hexdigest()]


class TextDataModule(TokenDataModule):
    """Text corpus -> cached token shard -> fixed windows of ``seq_len + 1`` tokens.

    Every batch is a ``torch.LongTensor`` of shape ``[batch_size, seq_len + 1]``; the model uses
    ``batch[:, :-1]`` as inputs and ``batch[:, 1:]`` as targets.

    Corpus: the files of ``sources`` (see :func:`resolve_sources`), or the standard library sources
    (see :func:`default_corpus_files`). Each plain file, and each ``.jsonl`` record, is one document.
    Documents are joined with the tokenizer's end-of-sequence id between them when it has one, else
    with the encoding of a newline (for :class:`~elr_lightning.tokenizers.ByteTokenizer`, the byte
    ``10``).

    Cache: :meth:`prepare_data` writes ``<cache_dir>/tokens-<key>.bin`` (raw token ids, ``uint8``,
    ``uint16`` or ``int32`` by vocabulary size) and ``tokens-<key>.json`` (sidecar), where ``key``
    hashes the tokenizer fingerprint, every source file's :func:`file_signature` (path, size, mtime
    and a hash of its first and last MiB), ``text_field`` and ``max_bytes``. Both files are written through a temporary file and ``os.replace``, the sidecar
    last, so an interrupted prepare leaves no cache that looks valid.

    Split: windows are ``[i * seq_len, i * seq_len + seq_len + 1)``; the last
    ``max(1, round(val_fraction * n_windows))`` are validation, the rest training.

    Args:
        sources: Files, directories or globs (one entry may be given alone, without a list);
            ``None`` for the standard library.
        tokenizer: ``"byte"`` or the path of a HF ``tokenizer.json``.
        seq_len: Tokens the model sees per sequence (T).
        batch_size: Sequences per batch on each device.
        val_fraction: Share of windows held out for validation, in (0, 1).
        text_field: Key holding the text in ``.jsonl`` records.
        cache_dir: Folder for token shards.
        seed: Seed of the training order.
        max_bytes: Use only the first ``max_bytes`` UTF-8 bytes of the corpus (quick runs, tests).
        val_batches: Use at most this many validation batches per device (of ``batch_size`` windows each).

    Raises:
        ValueError: A number is out of range or the tokenizer spec is invalid.
        FileNotFoundError: The tokenizer file does not exist.
    """

    def __init__(
        self,
        sources: Optional[Union[list[str], str]] = None,
        tokenizer: str = "byte",
        seq_len: int = 256,
        batch_size: int = 16,
        val_fraction: float = 0.01,
        text_field: str = "text",
        cache_dir: str = ".cache/elr_lightning",
        seed: int = 0,
        max_bytes: Optional[int] = None,
        val_batches: Optional[int] = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if seq_len < 1:
            raise ValueError(f"data.seq_len must be >= 1, got {seq_len}")
        if batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {batch_size}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(
                f"data.val_fraction must be strictly between 0 and 1, got {val_fraction}; "
                "to train without validation keep it and set trainer.limit_val_batches: 0"
            )
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"data.max_bytes must be >= 1 or null, got {max_bytes}")
        if val_batches is not None and val_batches < 1:
            raise ValueError(f"data.val_batches must be >= 1 or null, got {val_batches}")
        if not text_field:
            raise ValueError("data.text_field must be a non-empty key")
        self.sources = sources
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.text_field = text_field
        self.cache_dir = cache_dir
        self.seed = seed
        self.max_bytes = max_bytes
        self.val_batches = val_batches
        self.tokenizer: Tokenizer = load_tokenizer(tokenizer)
        self.dtype = token_dtype(self.tokenizer.vocab_size)
        self.tokens: Optional[np.ndarray] = None
        self.train_windows: Optional[TokenWindows] = None
        self.val_windows: Optional[TokenWindows] = None
        self._train_loader: Optional[StepIndexedLoader] = None

    def separator(self) -> list[int]:
        """Ids placed between two documents: ``[eos_id]``, or the encoding of ``"\\n"``."""
        return document_separator(self.tokenizer)

    def cache_key(self, files: Sequence[str]) -> str:
        """Hash naming the shard of this tokenizer, these files (as they are now) and these options.

        Args:
            files: Output of :func:`resolve_sources`.

        Returns:
            A hex digest.
        """
        content = {
            "format": CACHE_FORMAT,
            "tokenizer": self.tokenizer.fingerprint(),
            "files": [file_signature(p) for p in files],
            "text_field": self.text_field,
            "max_bytes": self.max_bytes,
        }
        return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()

    def cache_paths(self, key: Optional[str] = None) -> tuple[str, str]:
        """Shard and sidecar paths: ``<cache_dir>/tokens-<first 20 hex digits of key>.{bin,json}``.

        Args:
            key: A :meth:`cache_key`; by default that of the current sources.

        Returns:
            ``(bin_path, json_path)``.
        """
        if key is None:
            key = self.cache_key(resolve_sources(self.sources))
        stem = os.path.join(self.cache_dir, f"tokens-{key[:20]}")
        return stem + ".bin", stem + ".json"

    def _read_sidecar(self, key: str) -> Optional[dict[str, Any]]:
        """The sidecar if it describes a complete shard of ``key``, else ``None``."""
        bin_path, json_path = self.cache_paths(key)
        try:
            with open(json_path, encoding="utf-8") as f:
                meta = json.load(f)
        except (OSError, ValueError):
            return None
        try:
            valid = (
                meta["key"] == key
                and meta["tokenizer_fingerprint"] == self.tokenizer.fingerprint()
                and meta["dtype"] == self.dtype.name
                and os.path.getsize(bin_path) == meta["num_tokens"] * self.dtype.itemsize
            )
        except (KeyError, TypeError, OSError):
            return None
        return meta if valid else None

    def prepare_data(self) -> None:
        """Tokenise the corpus into the cache, unless a matching shard is already there.

        Raises:
            FileNotFoundError: An entry of ``data.sources`` does not exist.
            ValueError: The sources yield no files or no tokens, a ``.jsonl`` record lacks
                ``data.text_field``, or the tokenizer emits ids outside its vocabulary.
        """
        files = resolve_sources(self.sources)
        key = self.cache_key(files)
        if self._read_sidecar(key) is not None:
            return
        bin_path, json_path = self.cache_paths(key)
        separator = np.asarray(self.separator(), dtype=np.int64)
        vocab_size = self.tokenizer.vocab_size
        num_tokens = 0
        text_tokens = 0

        def write_tokens(f: Any) -> None:
            nonlocal num_tokens, text_tokens
            for doc_index, doc in enumerate(capped_documents(iter_documents(files, self.text_field), self.max_bytes)):
                ids = np.asarray(self.tokenizer.encode(doc), dtype=np.int64)
                text_tokens += int(ids.size)
                if doc_index > 0:
                    ids = np.concatenate([separator, ids])
                outside = ids[(ids < 0) | (ids >= vocab_size)]
                if outside.size:
                    raise ValueError(
                        f"data.tokenizer: produced id {int(outside[0])} outside its vocabulary of {vocab_size}; "
                        "the tokenizer file is inconsistent"
                    )
                f.write(ids.astype(self.dtype).tobytes())
                num_tokens += int(ids.size)

        self._write_cache(bin_path, write_tokens)
        if text_tokens == 0:
            os.remove(bin_path)
            raise ValueError(f"data.sources: the {len(files)} source file(s) contain no text")
        meta = {
            "format": CACHE_FORMAT,
            "key": key,
            "tokenizer_fingerprint": self.tokenizer.fingerprint(),
            "vocab_size": vocab_size,
            "dtype": self.dtype.name,
            "num_tokens": num_tokens,
            "separator": separator.tolist(),
            "sources": files,
            "text_field": self.text_field,
            "max_bytes": self.max_bytes,
        }
        self._write_cache(json_path, lambda f: f.write(json.dumps(meta, indent=1).encode("utf-8")))

    def _write_cache(self, path: str, write: Any) -> None:
        try:
            write_atomically(path, write)
        except OSError as err:
            reason = getattr(err.__cause__, "strerror", None) or err.strerror or err
            raise type(err)(
                f"data.cache_dir {self.cache_dir!r} cannot hold the token cache ({reason}); "
                "point data.cache_dir at a writable folder"
            ) from err

    def setup(self, stage: Optional[str] = None) -> None:
        """Open the shard (preparing it if absent) and split its windows into train and validation.

        Args:
            stage: Lightning stage; the split is the same for all stages.

        Raises:
            ValueError: The corpus is too short for one training and one validation window.
        """
        key = self.cache_key(resolve_sources(self.sources))
        meta = self._read_sidecar(key)
        if meta is None:
            self.prepare_data()
            meta = self._read_sidecar(key)
        if meta is None:
            raise RuntimeError(f"token cache for key {key[:20]} is missing right after prepare_data()")
        bin_path, _ = self.cache_paths(key)
        num_tokens = meta["num_tokens"]
        self.tokens = np.memmap(bin_path, dtype=self.dtype, mode="r", shape=(num_tokens,))
        n_windows = (num_tokens - 1) // self.seq_len
        n_val = max(1, round(self.val_fraction * n_windows))
        if n_windows - n_val < 1:
            raise ValueError(
                f"data.seq_len: a corpus of {num_tokens} tokens gives {n_windows} window(s) of seq_len + 1 = "
                f"{self.seq_len + 1} tokens, too few for one training and one validation window at "
                f"data.val_fraction={self.val_fraction}; lower data.seq_len or add data (data.sources, data.max_bytes)"
            )
        self.train_windows = TokenWindows(self.tokens, self.seq_len, 0, n_windows - n_val)
        self.val_windows = TokenWindows(self.tokens, self.seq_len, n_windows - n_val, n_windows)
        self._train_loader = None

    def _require_setup(self) -> tuple[TokenWindows, TokenWindows]:
        if self.train_windows is None or self.val_windows is None:
            raise RuntimeError("TextDataModule.setup() must run before asking for a dataloader")
        return self.train_windows, self.val_windows

    def train_dataloader(self) -> StepIndexedLoader:
        """The resumable training loader (one per setup; asking again returns the same cursor).

        Returns:
            A :class:`StepIndexedLoader` for this rank.

        Raises:
            ValueError: There are fewer training windows than one global batch.
        """
        train, _ = self._require_setup()
        return self.resumable_loader(
            train, self.seed, "training windows", "lower data.batch_size or data.seq_len, or add data"
        )

    def val_dataloader(self) -> DataLoader:
        """Validation windows in stream order, at most ``val_batches`` global batches
        (:meth:`~elr_lightning.data.base.TokenDataModule.validation_count`).

        Returns:
            A plain ``DataLoader`` (Lightning adds a distributed sampler under DDP).
        """
        _, val = self._require_setup()
        count = self.validation_count(len(val))
        val = TokenWindows(val.tokens, val.seq_len, val.start, val.start + count)
        return DataLoader(val, batch_size=self.batch_size, shuffle=False, drop_last=False)

    def test_dataloader(self) -> DataLoader:
        """The held-out validation windows (the corpus has one held-out split)."""
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        """The held-out validation windows, for per-sequence losses at every k."""
        return self.val_dataloader()
