"""The generation cache's storage and its policy seam: what a mixer keeps between forward calls.

The lowest layer of the cache: :class:`LayerStore` (attention keys and values, recurrent state) and
the :class:`KVCache` policy contract. It imports nothing of the package, so the loop context (and
through it every mixer) can name these types without reaching the model config;
:mod:`elr_lightning.inference.cache` adds the built-in policies and the memory accounting over an architecture.
"""

from __future__ import annotations

from typing import Hashable, Optional

import torch
from torch import Tensor


class LayerStore:
    """What one cache key holds between forward calls: attention keys/values and recurrent state.

    * Keys and values: a preallocated ``[B, H_kv, max_len, hd]`` buffer pair, written at the cache
      offset by :meth:`update`, which returns every cached position up to the new ones.
    * Recurrent state (e.g. a linear-attention state and its convolution window): named tensors.
      :meth:`state` returns the state after the tokens cached before this forward pass;
      :meth:`set_state` records the state after the new tokens, which becomes visible at
      :meth:`KVCache.advance`. So under a policy that shares one store across loops, loop i of a new
      token reads the previous token's state and its write replaces the earlier loops', exactly as
      for keys and values.
    """

    def __init__(self, cache: "KVCache") -> None:
        self.cache = cache
        self.k: Optional[Tensor] = None
        self.v: Optional[Tensor] = None
        self._state: dict[str, Tensor] = {}
        self._pending: dict[str, Tensor] = {}
        self._row_pending: list[tuple[str, Tensor, Tensor]] = []

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store the new ``[B, H_kv, T, hd]`` keys/values; return the keys/values to attend to."""
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

    def state(self, name: str) -> Optional[Tensor]:
        """The recurrent tensor ``name`` after the previously cached tokens, or ``None`` before any."""
        return self._state.get(name)

    def set_state(self, name: str, value: Tensor) -> None:
        """Record the recurrent tensor ``name`` after this forward pass's new tokens."""
        self._pending[name] = value

    def commit(self) -> None:
        """Make the states recorded in this forward pass the ones :meth:`state` returns (later writes win)."""
        self._state.update(self._pending)
        self._pending.clear()
        for name, rows, value in self._row_pending:
            if name not in self._state:
                self._state[name] = value.new_zeros((self.cache.slots, *value.shape[1:]))
            self._state[name][rows] = value
        self._row_pending.clear()

    def discard(self) -> None:
        """Drop the states recorded since the last :meth:`commit` (a forward pass that failed mid-way)."""
        self._pending.clear()
        self._row_pending.clear()

    def allocate(self, like: Tensor) -> None:
        """Zeroed key and value buffers for ``cache.slots`` rows, shaped after ``like`` ``[n, H_kv, T, hd]``."""
        if self.k is None:
            shape = (self.cache.slots, like.shape[1], self.cache.max_len, like.shape[3])
            self.k = like.new_zeros(shape)
            self.v = like.new_zeros(shape)

    def nbytes(self) -> int:
        """Bytes of the allocated keys and values."""
        if self.k is None or self.v is None:
            return 0
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def state_nbytes(self) -> int:
        """Bytes of the recurrent state."""
        return sum(t.numel() * t.element_size() for t in self._state.values())


class RowStore:
    """A :class:`LayerStore` seen by some rows of a slot cache, each writing at its own positions.

    The same contract as :class:`LayerStore`: :meth:`update` writes the new keys and values at
    ``pos`` and returns the rows' keys and values up to ``end`` (positions past a row's own length
    hold stale or zero entries, which the caller's mask hides); :meth:`state` reads the rows' state
    after their cached tokens (``None`` for fresh rows); :meth:`set_state` takes effect at
    :meth:`KVCache.commit`.
    """

    def __init__(self, store: LayerStore, rows: Tensor, pos: Optional[Tensor], end: int, fresh: bool) -> None:
        self.store, self.rows, self.pos, self.end, self.fresh = store, rows, pos, end, fresh

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store the rows' new ``[n, H_kv, T, hd]`` keys/values; return theirs up to ``end``."""
        store = self.store
        store.allocate(k)
        if self.pos is None:  # a prompt from position 0
            store.k[self.rows, :, : k.shape[2]] = k
            store.v[self.rows, :, : k.shape[2]] = v
        else:
            store.k[self.rows[:, None], :, self.pos] = k.transpose(1, 2)
            store.v[self.rows[:, None], :, self.pos] = v.transpose(1, 2)
        return store.k[self.rows, :, : self.end], store.v[self.rows, :, : self.end]

    def state(self, name: str) -> Optional[Tensor]:
        """The rows' recurrent tensor ``name`` after their cached tokens, or ``None``."""
        full = self.store.state(name)
        return None if self.fresh or full is None else full[self.rows]

    def set_state(self, name: str, value: Tensor) -> None:
        """Record the rows' recurrent tensor ``name`` after the new tokens."""
        self.store._row_pending.append((name, self.rows, value))


class RowView:
    """Some rows of a slot cache, passed where a forward pass takes a :class:`KVCache`.

    Args:
        cache: The slot cache.
        rows: ``[n]`` slot indices.
        pos: ``[n, T]`` positions of the new tokens per row, or ``None`` for a prompt from position 0.
        end: Positions the rows attend over (the longest row's length after the new tokens).
        fresh: The rows start new sequences: their old recurrent state is not read.
    """

    def __init__(self, cache: "KVCache", rows: Tensor, pos: Optional[Tensor], end: int, fresh: bool) -> None:
        self.cache, self.rows, self.pos, self.end, self.fresh = cache, rows, pos, end, fresh
        self.offset = 0 if pos is None else end - 1

    def slot(self, layer: int, loop: int) -> RowStore:
        """The rows' view of the store of ``(layer, loop)``."""
        return RowStore(self.cache.slot(layer, loop), self.rows, self.pos, self.end, self.fresh)

    def advance(self, n: int) -> None:
        """Commit the recurrent state the rows recorded (the caller keeps each row's length)."""
        self.cache.commit()


class KVCache:
    """Seam contract for a KV-cache policy.

    The model's mixers ask for ``slot(layer, loop)`` (through
    :meth:`~elr_lightning.context.LoopContext.cached`): ``layer`` is the layer's number in the whole
    stack (:meth:`~elr_lightning.config.ModelConfig.layer_index`), ``loop`` is ``1..k`` inside the
    recurrent block and ``0`` elsewhere. A policy decides which calls share storage by the key it returns
    from :meth:`key`. After every forward pass the caller advances :attr:`offset` by the number of
    new tokens with :meth:`advance`.

    A new policy is a subclass that overrides :meth:`key`; pass the class as ``kv_cache`` to
    :func:`elr_lightning.inference.generate.generate`, which also counts its stores for memory accounting
    (:func:`elr_lightning.inference.cache.kv_cache_bytes`).

    Args:
        max_len: Longest sequence (prompt plus generated tokens) the cache holds.
    """

    def __init__(self, max_len: int) -> None:
        if max_len < 1:
            raise ValueError(f"max_len={max_len} must be >= 1")
        self.max_len = max_len
        self.offset = 0
        #: Rows of the buffers when the cache holds slots of sequences of their own lengths (:meth:`rows`).
        self.slots = 1
        self._stores: dict[Hashable, LayerStore] = {}

    def key(self, layer: int, loop: int) -> Hashable:
        """Storage key for attention layer ``layer`` at loop ``loop``."""
        raise NotImplementedError

    def slot(self, layer: int, loop: int) -> LayerStore:
        """The store that layer ``layer`` uses at loop ``loop``."""
        key = self.key(layer, loop)
        if key not in self._stores:
            self._stores[key] = LayerStore(self)
        return self._stores[key]

    def advance(self, n: int) -> None:
        """Record that ``n`` new tokens were written by the last forward pass (commits recurrent state)."""
        self.offset += n
        self.commit()

    def commit(self) -> None:
        """Make the recurrent state recorded since the last commit visible."""
        for store in self._stores.values():
            store.commit()

    def discard(self) -> None:
        """Drop the recurrent state recorded since the last commit, which a failed forward pass left behind."""
        for store in self._stores.values():
            store.discard()

    def rows(self, rows: Tensor, pos: Optional[Tensor], end: int, fresh: bool = False) -> RowView:
        """A view of slots ``rows`` writing at ``pos`` (see :class:`RowView`); used by :class:`~elr_lightning.inference.decode.Decoder`."""
        return RowView(self, rows, pos, end, fresh)

    def fill_skipped(self, rows: Tensor, pos: Tensor, layers: list[int], exit_loop: int, max_loops: int) -> None:
        """Copy loop ``exit_loop``'s keys and values at ``pos`` into loops ``exit_loop + 1..max_loops`` of ``layers``.

        For rows that left the recurrent block early (adaptive depth): later tokens attending at a
        skipped loop see the exit loop's entry. Stores the policy shares across loops are left alone.
        """
        for layer in layers:
            source = self.slot(layer, exit_loop)
            if source.k is None:  # no keys and values: a recurrent mixer's state is not copied
                continue
            for loop in range(exit_loop + 1, max_loops + 1):
                target = self.slot(layer, loop)
                if target is source:
                    continue
                target.allocate(source.k)
                target.k[rows, :, pos] = source.k[rows, :, pos]
                target.v[rows, :, pos] = source.v[rows, :, pos]

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

    def state_nbytes(self) -> int:
        """Bytes held by recurrent state (linear-attention and convolution state); independent of length."""
        return sum(store.state_nbytes() for store in self._stores.values())
