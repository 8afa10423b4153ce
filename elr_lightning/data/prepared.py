"""Reading prepared folders: the index checked against its shards, token streams, and windows over them.

Memory stays flat in corpus size: a stream holds one path and one offset per shard and reads windows
with ``os.pread``, and the training order is a keyed permutation computed per window (:class:`FeistelPermutation`), never a
table over all windows.
"""

import hashlib
import json
import os
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from elr_lightning.data.prepare import READABLE_FORMATS, shard_paths
from elr_lightning.tokenizers import Tokenizer

#: The field the errors about prepared folders name.
FIELD = "data.folders"


class TokenStream:
    """The concatenated token ids of some shard files, read by global token offset.

    Reads go through ``os.pread`` instead of a memory map, so the pages of a read stay in the
    page cache and never in the process' resident set: a rank's memory is the same for a corpus of
    10M or 2B tokens (``bench/data.py``). At most :attr:`OPEN_FILES` shards are open at a time.

    Args:
        paths: Shard files, in order.
        counts: Tokens in each.
        dtype: Their token dtype.
    """

    OPEN_FILES = 64

    def __init__(self, paths: list[str], counts: list[int], dtype: np.dtype) -> None:
        kept = [(p, c) for p, c in zip(paths, counts) if c > 0]
        self.paths = [p for p, _ in kept]
        self.dtype = np.dtype(dtype)
        self.offsets = np.cumsum([0] + [c for _, c in kept], dtype=np.int64)
        self._files: dict[int, int] = {}

    def __len__(self) -> int:
        """Number of tokens."""
        return int(self.offsets[-1])

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without open file descriptors (a DataLoader worker opens its own)."""
        return {**self.__dict__, "_files": {}}

    def close(self) -> None:
        """Close the open shard files (reads reopen them)."""
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()

    def __del__(self) -> None:
        self.close()

    def _fd(self, shard: int) -> int:
        if shard not in self._files:
            if len(self._files) >= self.OPEN_FILES:
                self.close()
            self._files[shard] = os.open(self.paths[shard], os.O_RDONLY)
        return self._files[shard]

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` as ``int64``, across shard boundaries."""
        if start < 0 or start + length > len(self):
            raise IndexError(f"tokens [{start}, {start + length}) outside a stream of {len(self)}")
        out = np.empty(length, dtype=np.int64)
        shard = int(np.searchsorted(self.offsets, start, side="right")) - 1
        done = 0
        size = self.dtype.itemsize
        while done < length:
            local = start + done - int(self.offsets[shard])
            take = min(length - done, int(self.offsets[shard + 1]) - start - done)
            data = os.pread(self._fd(shard), take * size, local * size)
            if len(data) != take * size:
                raise ValueError(f"{FIELD}: shard {self.paths[shard]!r} ended early; the folder is damaged")
            out[done : done + take] = np.frombuffer(data, dtype=self.dtype)
            done += take
            shard += 1
        return out

    def num_windows(self, seq_len: int) -> int:
        """Windows of ``seq_len + 1`` tokens overlapping by one: ``(tokens - 1) // seq_len``."""
        return max(0, (len(self) - 1) // seq_len)

    def window(self, index: int, seq_len: int) -> np.ndarray:
        """Window ``index``: tokens ``[index * seq_len, index * seq_len + seq_len + 1)``."""
        return self.read(index * seq_len, seq_len + 1)


class PreparedFolder:
    """A prepared folder opened for training: its index checked against the tokenizer and the shards.

    Args:
        path: The folder written by ``elr prepare``.
        tokenizer: The run's tokenizer; a folder made with another one is refused.

    Raises:
        FileNotFoundError: The folder or one of its shards is missing.
        ValueError: The prepare did not finish, the tokenizer differs (by fingerprint or by the index's
            ``vocab_size``), or a shard does not match the index.
    """

    def __init__(self, path: str, tokenizer: Tokenizer) -> None:
        self.path = path
        self.name = os.path.basename(os.path.normpath(path))
        index_path = os.path.join(path, "index.json")
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{FIELD}: {path!r} does not exist; run elr prepare SOURCES --out {path}")
        if not os.path.exists(index_path):
            if os.path.exists(os.path.join(path, "plan.json")):
                raise ValueError(
                    f"{FIELD}: the prepare of {path!r} did not finish (no index.json); rerun the same elr prepare "
                    "command to complete it"
                )
            raise ValueError(f"{FIELD}: {path!r} is not a prepared folder (no index.json); make it with elr prepare")
        try:
            with open(index_path, encoding="utf-8") as f:
                index: dict[str, Any] = json.load(f)
            shards, dtype = index["shards"], np.dtype(index["dtype"])
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{FIELD}: {index_path!r} is damaged ({err}); rerun elr prepare into a new folder") from err
        if index.get("format") not in READABLE_FORMATS:
            raise ValueError(
                f"{FIELD}: {path!r} has layout {index.get('format')}, this version reads {list(READABLE_FORMATS)}; "
                "prepare it again with this version"
            )
        if index["tokenizer_fingerprint"] != tokenizer.fingerprint():
            raise ValueError(
                f"data.tokenizer: {path!r} was prepared with another tokenizer (fingerprint "
                f"{index['tokenizer_fingerprint'][:12]}, this run {tokenizer.fingerprint()[:12]}); use its tokenizer or "
                "prepare the folder again"
            )
        if index.get("vocab_size") != tokenizer.vocab_size:
            raise ValueError(
                f"{FIELD}: {index_path!r} has vocab_size={index.get('vocab_size')}, but its tokenizer (the run's "
                f"data.tokenizer) has {tokenizer.vocab_size} ids: the index does not describe these shards, whose ids "
                "may not fit the model's arch.vocab_size; rerun elr prepare into a new folder"
            )
        self.index = index
        self.dtype = dtype
        files: dict[str, list[str]] = {"train": [], "val": []}
        for position, shard in enumerate(shards):
            paths = shard_paths(path, position)
            for split in ("train", "val"):
                expected = shard[f"{split}_tokens"] * dtype.itemsize
                if not os.path.exists(paths[split]):
                    raise FileNotFoundError(
                        f"{FIELD}: shard {paths[split]!r} listed in the index is missing; rerun elr prepare into a new folder"
                    )
                size = os.path.getsize(paths[split])
                if size != expected:
                    raise ValueError(
                        f"{FIELD}: shard {paths[split]!r} has {size} bytes, its index says {expected}; the folder is "
                        "damaged, rerun elr prepare into a new folder"
                    )
                files[split].append(paths[split])
        self.train = TokenStream(files["train"], [s["train_tokens"] for s in shards], dtype)
        self.val = TokenStream(files["val"], [s["val_tokens"] for s in shards], dtype)

    def fingerprint(self) -> str:
        """Hash of the index: names the exact data a checkpoint's position refers to."""
        return hashlib.sha256(json.dumps(self.index, sort_keys=True).encode()).hexdigest()

    def input_files(self) -> dict[str, tuple[int, int]]:
        """The files ``elr prepare`` read, with their size and modification time, from ``plan.json``
        (empty when the folder has none or it is damaged: the folder trains, it just cannot be compared)."""
        try:
            with open(os.path.join(self.path, "plan.json"), encoding="utf-8") as f:
                units = json.load(f)["units"]
            return {str(p): (int(size), int(mtime)) for unit in units for p, size, mtime in unit[0]}
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            return {}


def _mix(x: np.ndarray, key: int) -> np.ndarray:
    """A 64-bit mixing of ``x`` under ``key`` (SplitMix64's finaliser)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(key)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


class FeistelPermutation:
    """A keyed permutation of ``[0, n)`` evaluated per element in O(1) memory.

    A balanced Feistel network over ``2 * half_bits`` bits (four rounds of :func:`_mix`) permutes
    ``[0, 4**half_bits)``; cycle walking (apply again while the result is ``>= n``) restricts it to
    ``[0, n)``, which stays a bijection. Since ``4**half_bits < 4 n``, a walk takes under four
    rounds on average.

    Args:
        n: Size of the permuted range (>= 1).
        key: Any integer; each key gives another permutation.
    """

    ROUNDS = 4

    def __init__(self, n: int, key: int) -> None:
        if n < 1:
            raise ValueError(f"cannot permute an empty range (n={n})")
        self.n = n
        self.half_bits = max(1, ((n - 1).bit_length() + 1) // 2)
        self.mask = np.uint64((1 << self.half_bits) - 1)
        self.keys = [int.from_bytes(hashlib.sha256(f"{key}:{r}".encode()).digest()[:8], "little") for r in range(4)]

    def _round_trip(self, x: np.ndarray) -> np.ndarray:
        shift = np.uint64(self.half_bits)
        left, right = x >> shift, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right, key) & self.mask)
        return (left << shift) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """The permuted values of ``positions`` (each in ``[0, n)``), as ``int64``."""
        x = self._round_trip(np.asarray(positions, dtype=np.uint64))
        outside = x >= np.uint64(self.n)
        while outside.any():
            x[outside] = self._round_trip(x[outside])
            outside = x >= np.uint64(self.n)
        return x.astype(np.int64)


class StreamWindows(Dataset):
    """Consecutive windows of ``seq_len + 1`` tokens of several streams, one after another (validation).

    Args:
        streams: Token streams.
        seq_len: Model context T.
    """

    def __init__(self, streams: list[TokenStream], seq_len: int) -> None:
        self.streams = streams
        self.seq_len = seq_len
        self.offsets = np.cumsum([0] + [s.num_windows(seq_len) for s in streams], dtype=np.int64)

    def __len__(self) -> int:
        """Number of windows."""
        return int(self.offsets[-1])

    def __getitem__(self, index: int) -> torch.Tensor:
        """Window ``index`` as an ``int64`` tensor of shape ``[seq_len + 1]``."""
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        source = int(np.searchsorted(self.offsets, index, side="right")) - 1
        local = index - int(self.offsets[source])
        return torch.from_numpy(self.streams[source].window(local, self.seq_len))
