"""Weighted mixtures of prepared sources, drawn deterministically by step.

Global batch ``s`` (``G = batch_size x devices`` windows) takes ``C_j(s + 1) - C_j(s)`` windows of
source ``j``, where ``C_j(s) = floor(w_j G s)`` for every source but the heaviest, which gets the rest
of the ``G s`` windows. So after any number of steps each source's share is within ``1 / (G s)`` of its
weight (largest source: ``(J - 1) / (G s)``), and the counts are a closed form of the step: no state.

Source ``j``'s ``c``-th window is window ``P_{j,e}(c mod N_j)`` of its ``N_j``, where ``e = c div N_j``
is the source's own epoch and ``P`` the :class:`~elr_lightning.data.prepared.FeistelPermutation`
keyed by (seed, source, epoch). The rows of a global batch are then put in the order of a
permutation keyed by (seed, step), and rank ``r`` takes rows ``[r B, (r + 1) B)``. So the batch at
step ``s`` is a pure function of (seed, step, the sources' shards), the same global batch for any
device count at the same ``G``.
"""

import hashlib
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from typing_extensions import override

from elr_lightning.data.prepared import FeistelPermutation, TokenStream
from elr_lightning.data.windows import StepLoader


def keyed(*parts: Any) -> int:
    """A 63-bit key from SHA-256 of the parts joined by ``:``."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class MixtureSchedule:
    """How many windows of each source global batch ``s`` takes (see the module docstring).

    Args:
        weights: One positive weight per source (normalised here).
        global_batch_size: Windows per optimizer step over all ranks (G).

    Raises:
        ValueError: A weight is not positive, or G is too small to give every step its share.
    """

    def __init__(self, weights: Sequence[float], global_batch_size: int) -> None:
        if not weights or any(not (w > 0 and math.isfinite(w)) for w in weights):
            raise ValueError(f"data.weights must be positive numbers, got {list(weights)}")
        total = float(sum(weights))
        self.weights = [w / total for w in weights]
        self.global_batch_size = global_batch_size
        self.rest = max(range(len(weights)), key=lambda j: (self.weights[j], -j))
        if sum(math.ceil(w * global_batch_size) for j, w in enumerate(self.weights) if j != self.rest) > global_batch_size:
            raise ValueError(
                f"data.batch_size: a global batch of {global_batch_size} window(s) cannot hold every source's share "
                f"of weights {list(weights)}; raise data.batch_size or merge small sources"
            )

    def consumed(self, step: int) -> np.ndarray:
        """Windows of each source in global batches ``0 .. step - 1``."""
        rows = self.global_batch_size * step
        counts = np.array([math.floor(w * rows) for w in self.weights], dtype=np.int64)
        counts[self.rest] = 0
        counts[self.rest] = rows - counts.sum()
        return counts

    def share(self, step: int) -> list[float]:
        """Realised share of each source in global batches ``0 .. step`` (the step included)."""
        counts = self.consumed(step + 1)
        return (counts / counts.sum()).tolist()


class MixtureLoader(StepLoader):
    """Training batches of a weighted mixture of token streams, a pure function of (seed, step).

    An epoch is nominal (``sum of the sources' windows // G`` steps): the step is ``epoch *
    len(self) + position``, and each source wraps around its own windows independently.

    Args:
        streams: The sources' training streams.
        names: The sources' names (TensorBoard tags).
        weights: The sources' weights.
        fingerprints: The sources' identities (a resume over other data is refused).
        seq_len: Model context T.
        batch_size: Windows per batch on this rank.
        seed: Data seed.
        rank: This process' rank.
        world_size: Number of processes sharing each global batch.
        prefetch: Batches read ahead in a background thread while the step runs (0: read each when
            asked for); the batches and the resume position are the same either way (:class:`StepLoader`).
    """

    LAYOUT_FIX = "use the same data.folders, data.weights, data.seq_len, data.seed and data.batch_size x devices"

    def __init__(
        self,
        streams: Sequence[TokenStream],
        names: Sequence[str],
        weights: Sequence[float],
        fingerprints: Sequence[str],
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        prefetch: int = 2,
    ) -> None:
        super().__init__(batch_size, rank, world_size, prefetch)
        self.streams = list(streams)
        self.names = list(names)
        self.fingerprints = list(fingerprints)
        self.seq_len = seq_len
        self.seed = seed
        self.schedule = MixtureSchedule(weights, self.global_batch_size)
        self.num_windows = [s.num_windows(seq_len) for s in self.streams]
        for name, n in zip(self.names, self.num_windows):
            if n < 1:
                raise ValueError(
                    f"data.folders: {name!r} has no training window of seq_len + 1 = {seq_len + 1} tokens; "
                    "lower data.seq_len or prepare more data"
                )
        self._permutations: dict[tuple[int, int], FeistelPermutation] = {}

    @override
    def __len__(self) -> int:
        """Nominal batches per epoch: all sources' windows over one global batch (at least 1)."""
        return max(1, sum(self.num_windows) // self.global_batch_size)

    def _permutation(self, source: int, epoch: int) -> FeistelPermutation:
        key = (source, epoch)
        permutation = self._permutations.get(key)
        if permutation is None:  # built and returned without a second lookup: the prefetch thread may clear the cache
            if len(self._permutations) > 64:
                self._permutations.clear()
            permutation = FeistelPermutation(self.num_windows[source], keyed(self.seed, source, epoch))
            self._permutations[key] = permutation
        return permutation

    def global_rows(self, step: int) -> list[tuple[int, int]]:
        """The ``(source, window)`` rows of global batch ``step``, in batch order."""
        first, last = self.schedule.consumed(step), self.schedule.consumed(step + 1)
        rows: list[tuple[int, int]] = []
        for source, (a, b) in enumerate(zip(first.tolist(), last.tolist())):
            n = self.num_windows[source]
            draws = np.arange(a, b, dtype=np.int64)
            for epoch in np.unique(draws // n).tolist():
                at = draws[draws // n == epoch] % n
                rows.extend((source, int(w)) for w in self._permutation(source, epoch)(at))
        order = np.random.default_rng(keyed(self.seed, "rows", step)).permutation(len(rows))
        return [rows[i] for i in order]

    @override
    def batch_at(self, epoch: int, position: int) -> torch.Tensor:
        """This rank's batch at ``position`` of ``epoch``: rows ``[r B, (r + 1) B)`` of the global batch."""
        rows = self.global_rows(epoch * len(self) + position)
        mine = rows[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
        return torch.from_numpy(np.stack([self.streams[s].window(w, self.seq_len) for s, w in mine]))

    @override
    def layout(self) -> dict[str, Any]:
        """``seed``, ``global_batch_size``, ``seq_len`` and the sources with their weights."""
        return {
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
            "seq_len": self.seq_len,
            "sources": [[f[:16], w] for f, w in zip(self.fingerprints, self.schedule.weights)],
        }
