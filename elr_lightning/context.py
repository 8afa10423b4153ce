"""The per-forward loop context: loop index, loop count, budget, conditioning and the layer stores.

One :class:`LoopContext` is built per forward pass of :class:`~elr_lightning.model.LoopedLM` and
handed to every layer, and through it to every token and channel mixer. It carries

* the loop index ``i`` (``1..k`` inside the recurrent block, ``0`` in the input and output blocks),
  the loop count ``k`` and the budget ``K`` (DESIGN §2);
* the conditioning context ``c_i`` of eq. (4) (``c_k`` in the output block; ``None`` without
  conditioning or while it is switched off);
* the positions of the new tokens (RoPE tables, causal/padding mask, the padding itself);
* the stores a mixer may read or write, keyed by ``(layer, loop)`` in one place:

  - :meth:`LoopContext.cached`: the generation cache (attention keys and values, linear-attention
    recurrent and convolution state), kept across forward calls; a
    :class:`~elr_lightning.cache_store.KVCache` policy maps ``(layer, loop)`` to storage;
  - :meth:`LoopContext.scratch`: tensors kept for this forward pass only, e.g. the expert routes a
    mixture-of-experts channel mixer computes at loop 1 and replays at loops 2..k;
  - :meth:`LoopContext.add_aux_loss`: auxiliary losses (e.g. a router balance loss), collected by
    the caller of ``LoopedLM.forward(..., aux_losses=...)``.

Layer numbers are those of :meth:`~elr_lightning.config.ModelConfig.layer_index`: input layers
first, then the recurrent layers, then the output layers, each unique layer once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Union

from torch import Tensor

if TYPE_CHECKING:
    from elr_lightning.cache_store import KVCache, LayerStore


@dataclass
class Positions:
    """Where the new tokens of this forward pass sit.

    Attributes:
        cos: RoPE cosine table for the new positions, ``[T, head_dim / 2]``.
        sin: RoPE sine table for the new positions.
        mask: Boolean attention mask ``[B or 1, 1, T, T_cached + T]`` (True attends), or ``None``
            with ``is_causal``.
        is_causal: Plain causal attention over the new tokens only (no cache, no padding).
        padding: ``[B, T]`` bool, True for the real tokens among the new ones; ``None`` without an
            attention mask (whether a given mask pads anything is not read: that would stall the device). Recurrent mixers must leave their state untouched at padding.
        offset: Tokens already cached before the new ones.
    """

    cos: Tensor
    sin: Tensor
    mask: Optional[Tensor]
    is_causal: bool
    padding: Optional[Tensor] = None
    offset: int = 0


class _Stores:
    """The scratch stores and auxiliary losses one forward pass shares across its loop views.

    A plain object, not a dict: FSDP2 copies dict (and dataclass) arguments of a sharded module's
    forward when it moves them to the device, and the copies of a context must share one store.
    Not a ``collections.UserDict`` either: ``torch.compile`` cannot build one inside a graph.
    """

    def __init__(self) -> None:
        self.scratch: dict[tuple[int, int], dict[str, Any]] = {}
        self.aux: dict[str, Tensor] = {}

    def sharing_scratch(self) -> "_Stores":
        """Stores that share this one's scratch and keep auxiliary losses of their own (dropped by the caller)."""
        stores = _Stores()
        stores.scratch = self.scratch
        return stores


@dataclass
class LoopContext:
    """Everything a layer may need about the current forward pass and loop (see the module docstring).

    The model builds one per forward pass with :meth:`at` deriving the per-loop views; the views
    share the cache, the scratch stores and the auxiliary losses.

    Attributes:
        positions: The new tokens' positions and masks.
        loops: The loop count k of this forward pass.
        max_loops: The loop budget K (``arch.max_loops``).
        loop: The loop index i: ``1..k`` in the recurrent block, ``0`` in the input and output blocks.
        cond: The conditioning context c_i of eq. (4), or ``None``.
        modulations: Eq. (4)'s terms under ``cond`` of the layers the caller computed them for at
            once, by layer index (:func:`~elr_lightning.layers.layer_modulations`), or ``None``:
            a layer without an entry computes its own.
        cache: The generation cache policy, or ``None`` (training, cache-free inference).
        rows: The rows of the pass's batch this view runs on (a slice of consecutive rows, or
            indices) where a loop runs on some of them only (a decode step whose rows stop at
            their own depths, :meth:`on_rows`); ``None``: every row. Loop 1 runs on every row:
            per-token tensors a mixer keeps in the scratch of loop 1 cover the whole batch, and a
            view with ``rows`` reads these rows of them.
        checkpointed: Whether this view runs inside activation checkpointing (the ``loop`` or
            ``layer`` setting of :meth:`~elr_lightning.model.LoopedLM.set_backprop`): what its
            layers save for the backward pass belongs to the checkpoint, which keeps none of it
            across the forward, so a mixer installs no saved-tensor hooks of its own there
            (:meth:`~elr_lightning.mixers.TokenMixer.modulated`).
        passes: How many passes the recurrent block makes (>= ``loops``; ``None``: ``loops``). The
            passes after loop k run every recurrent layer on zero rows (:meth:`idle`), so that a
            strategy sharding each layer on its own issues the collectives of a forward at this
            many loops, whatever k this rank runs (:meth:`RecurrentCore.forward
            <elr_lightning.core.RecurrentCore.forward>`).
    """

    positions: Positions
    loops: int
    max_loops: int
    loop: int = 0
    cond: Optional[Tensor] = None
    modulations: Optional[dict[int, Any]] = None
    cache: Optional["KVCache"] = None
    rows: Optional[Union[slice, Tensor]] = None
    checkpointed: bool = False
    passes: Optional[int] = None
    _stores: "_Stores" = field(default_factory=lambda: _Stores(), repr=False)

    def at(self, loop: int, cond: Optional[Tensor], modulations: Optional[dict[int, Any]] = None) -> "LoopContext":
        """The view of this context at loop ``loop`` with context ``cond`` (and its ``modulations``); stores are shared."""
        return dataclasses.replace(self, loop=loop, cond=cond, modulations=modulations)

    def idle(self, loop: int, cond: Optional[Tensor]) -> "LoopContext":
        """The view of an idle pass at loop ``loop`` (> k): no rows of the batch, ``cond`` as c_i.

        It reads the scratch of this forward pass (a mixture of experts replays loop 1's routes for
        no tokens) and writes its own auxiliary losses, which nobody collects: a loss over zero
        tokens is 0/0.
        """
        return dataclasses.replace(
            self, loop=loop, cond=cond, modulations=None, rows=slice(0, 0), _stores=self._stores.sharing_scratch()
        )

    def under_checkpoint(self) -> "LoopContext":
        """This view marked :attr:`checkpointed`, for a pass that runs inside activation checkpointing."""
        return dataclasses.replace(self, checkpointed=True)

    def on_rows(
        self, loop: int, rows: Optional[Union[slice, Tensor]], positions: Positions, cache: Optional["KVCache"]
    ) -> "LoopContext":
        """The view of this pass at loop ``loop`` on ``rows`` of its batch (``None``: all), at those rows'
        ``positions`` and ``cache``; stores are shared, so loop 1's routes reach the rows at later loops."""
        return dataclasses.replace(self, loop=loop, rows=rows, positions=positions, cache=cache)

    def cached(self, layer: int) -> Optional["LayerStore"]:
        """The generation-cache store of ``(layer, self.loop)``, or ``None`` without a cache.

        What persists between forward calls: attention keys and values
        (:meth:`~elr_lightning.cache_store.LayerStore.update`) and recurrent state
        (:meth:`~elr_lightning.cache_store.LayerStore.state` / :meth:`~elr_lightning.cache_store.LayerStore.set_state`).
        The policy decides which ``(layer, loop)`` pairs share storage.
        """
        return None if self.cache is None else self.cache.slot(layer, self.loop)

    def scratch(self, layer: int, loop: Optional[int] = None) -> dict[str, Any]:
        """A dict private to ``(layer, loop)`` for this forward pass (``loop`` defaults to this loop).

        A mixer may write at one loop and read at a later one, e.g. routes computed at
        ``scratch(layer, 1)`` and replayed at loops 2..k. Gradients flow through stored tensors.
        """
        return self._stores.scratch.setdefault((layer, self.loop if loop is None else loop), {})

    def add_aux_loss(self, name: str, value: Tensor) -> None:
        """Add ``value`` to the auxiliary loss ``name`` of this forward pass (summed over layers and loops)."""
        aux = self._stores.aux
        aux[name] = value if name not in aux else aux[name] + value

    @property
    def aux_losses(self) -> dict[str, Tensor]:
        """The auxiliary losses added so far, by name."""
        return dict(self._stores.aux)
