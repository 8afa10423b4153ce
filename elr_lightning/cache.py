"""KV-cache policies for generation: what each attention layer keeps between decode steps."""

from __future__ import annotations

from typing import Hashable, Optional

import torch
from torch import Tensor
from typing_extensions import override

from elr_lightning.layers import KVSlot


class _Store:
    """One preallocated key/value buffer ``[B, H_kv, max_len, hd]``, written at the cache offset."""

    def __init__(self, cache: "KVCache") -> None:
        self.cache = cache
        self.k: Optional[Tensor] = None
        self.v: Optional[Tensor] = None

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self.k is None:
            shape = (k.shape[0], k.shape[1], self.cache.max_len, k.shape[3])
            self.k = torch.empty(shape, dtype=k.dtype, device=k.device)
            self.v = torch.empty(shape, dtype=v.dtype, device=v.device)
        start, end = self.cache.offset, self.cache.offset + k.shape[2]
        if end > self.cache.max_len:
            raise ValueError(f"KV cache overflow: {end} tokens exceed max_len={self.cache.max_len}")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]

    def nbytes(self) -> int:
        if self.k is None or self.v is None:
            return 0
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


class KVCache:
    """Seam contract for a KV-cache policy.

    The model asks for ``slot(layer, loop)`` once per attention call: ``layer`` is the layer's
    index in the whole stack (input, recurrent, output), ``loop`` is ``1..k`` inside the recurrent
    block and ``0`` elsewhere. A policy decides which calls share storage by the key it returns
    from :meth:`key`. After every forward pass the caller advances :attr:`offset` by the number of
    new tokens with :meth:`advance`.

    A new policy is a subclass that overrides :meth:`key`; pass the class as ``kv_cache`` to
    :func:`elr_lightning.generation.generate`, which also counts its stores for memory accounting
    (:func:`elr_lightning.generation.kv_cache_bytes`).

    Args:
        max_len: Longest sequence (prompt plus generated tokens) the cache holds.
    """

    def __init__(self, max_len: int) -> None:
        if max_len < 1:
            raise ValueError(f"max_len={max_len} must be >= 1")
        self.max_len = max_len
        self.offset = 0
        self._stores: dict[Hashable, _Store] = {}

    def key(self, layer: int, loop: int) -> Hashable:
        """Storage key for attention layer ``layer`` at loop ``loop``."""
        raise NotImplementedError

    def slot(self, layer: int, loop: int) -> KVSlot:
        """The store that attention layer ``layer`` uses at loop ``loop``."""
        key = self.key(layer, loop)
        if key not in self._stores:
            self._stores[key] = _Store(self)
        return self._stores[key]

    def advance(self, n: int) -> None:
        """Record that ``n`` new tokens were written by the last forward pass."""
        self.offset += n

    @property
    def dtype(self) -> Optional[torch.dtype]:
        """Dtype of the stored keys and values, or ``None`` before the first write."""
        for store in self._stores.values():
            if store.k is not None:
                return store.k.dtype
        return None

    def nbytes(self, used: bool = True) -> int:
        """Bytes held by the keys and values: of the ``offset`` tokens written, or allocated."""
        total = sum(store.nbytes() for store in self._stores.values())
        return total * self.offset // self.max_len if used else total


class PerLoopCache(KVCache):
    """One store per (layer, loop): exact, reproduces the cache-free forward; memory grows with k."""

    @override
    def key(self, layer: int, loop: int) -> Hashable:
        return (layer, loop)


class LastLoopCache(KVCache):
    """One store per layer that every loop overwrites: attention KV memory of k = 1.

    A new token's loop i attends to the past tokens' last-loop keys and values plus its own loop-i
    ones; after its last loop, the stored entry is the last loop's.
    """

    @override
    def key(self, layer: int, loop: int) -> Hashable:
        return layer
