"""Fold loop conditioning (eq. 4) into the sublayers' own linear maps for serving at a fixed k.

Training folds the conditioning per loop inside the autograd graph
(:meth:`~elr_lightning.mixers.TokenMixer.modulated`); this module builds the folded weights once,
as plain layers, so an exporter gets an unmodulated model at one k. (Generation keeps the weights
shared and precomputes the per-loop constants instead: :mod:`elr_lightning.serving`.)

At a fixed loop count k the context c_i = MLP([phi(i / k); phi(k / K)]) of loop i depends on
``(i, k, K)`` alone, so every modulated sublayer's FiLM-plus-adapter pre-map and exit gate are
constants. With ``A = up.weight`` ``[d, r]``, ``B = down.weight`` ``[r, d]``, ``g = g(c_i)`` and
``(lambda, mu) = film(c_i)``, the pre-map of eq. (4) is affine,

    x^ = M h + m,   M = (I + A diag(g) B) diag(1 + lambda),   m = (I + A diag(g) B) mu,

so each mixer's input linear maps ``W`` (attention ``q`` and ``kv``, MLP ``up``; a mixer names
them in ``fold_inputs``) become ``W M`` with the bias ``W m``, and the exit gate
``(1 + omega) * (W_o y)`` becomes ``diag(1 + omega) W_o`` (attention ``o``, MLP ``down``; its
``fold_outputs``). Each mixer folds itself (:meth:`~elr_lightning.mixers.TokenMixer.folded`). The
folded layers are unmodulated :class:`~elr_lightning.layers.Block` s, so a folded model runs the op
sequence of the non-recurrent baseline plus the state update.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, MutableMapping, Optional

import torch
from torch import Tensor, nn
from typing_extensions import override

from elr_lightning.cache import KVCache
from elr_lightning.config import ModelConfig
from elr_lightning.layers import Block
from elr_lightning.core import LoopedForward, RecurrentCore, check_loops

if TYPE_CHECKING:  # the model serves cached decoding through this module
    from elr_lightning.model import LoopedLM

__all__ = ["FoldedLM", "fold_conditioning"]


class _FoldedCore(nn.Module):
    """The recurrent core with one list of layers per loop, its context fixed, and no conditioner."""

    #: The same k-loop as the source core (DESIGN §2), over :meth:`layers_at`.
    forward = RecurrentCore.forward
    loop = RecurrentCore.loop

    def __init__(self, source: RecurrentCore, per_loop: list[list[nn.Module]]) -> None:
        super().__init__()
        self.config, self.update = source.config, source.update
        self.conditioner = None
        self.checkpointing, self.backprop_loops = "none", None
        self.per_loop = nn.ModuleList(nn.ModuleList(layers) for layers in per_loop)

    def layers_at(self, loop: int) -> nn.ModuleList:
        """The layers of loop ``loop``, under its context."""
        return self.per_loop[loop - 1]


class FoldedLM(LoopedForward):
    """An inference-only :class:`LoopedLM` at one loop count k, its conditioning fixed for that k.

    ``forward(input_ids, loops, attention_mask, cache)`` is :meth:`LoopedLM.forward` at
    ``loops == k`` over the given layers: the same state update, injection and cache slots
    ``(layer, loop)``. The embedding, input layers, final norm, head and RoPE tables are the
    source's own modules, shared, not copied. :func:`fold_conditioning` builds one from plain
    blocks with the conditioning folded into copies of their weights;
    :func:`~elr_lightning.serving.serving_model` from blocks that share the source's weights and
    hold each loop's modulation constants.

    Args:
        source: The model to serve.
        loops: The loop count k it is built for.
        recurrent_layers: One list of ``n_rec`` layers ``layer(x, ctx)`` per loop ``1..k``, each under
            that loop's context.
        output_layers: The ``n_out`` output layers (under c_k).
    """

    def __init__(
        self,
        source: LoopedLM,
        loops: int,
        recurrent_layers: list[list[nn.Module]],
        output_layers: list[nn.Module],
    ) -> None:
        super().__init__()
        self.config: ModelConfig = source.config
        self.loops = loops
        self.embed = source.embed
        self.input_layers = source.input_layers
        self.core = _FoldedCore(source.core, recurrent_layers)
        self.output_layers = nn.ModuleList(output_layers)
        self.norm = source.norm
        self.head = source.head
        self.rotary = source.rotary

    @override
    def forward(
        self,
        input_ids: Tensor,
        loops: int,
        attention_mask: Optional[Tensor] = None,
        cache: Optional[KVCache] = None,
        aux_losses: Optional[MutableMapping[str, Tensor]] = None,
    ) -> Tensor:
        """Logits ``[B, T, vocab]``, as :meth:`LoopedLM.forward` at ``loops`` (which must be k).

        Raises:
            ValueError: ``loops`` is not the loop count this model was folded for.
        """
        if loops != self.loops:
            raise ValueError(f"this model is folded for loops={self.loops}, called with loops={loops}; fold again")
        return super().forward(input_ids, loops, attention_mask, cache, aux_losses)


def _fold_block(block: Block, c: Tensor) -> Block:
    """An unmodulated copy of ``block`` computing it under the context ``c``; the mixers fold themselves."""
    folded = copy.copy(block)
    folded._modules = {name: copy.deepcopy(block._modules[name]) for name in ("attn_norm", "mlp_norm")}
    folded.attn = block.attn.folded(*block.attn_mod.affine(c))
    folded.mlp = block.mlp.folded(*block.mlp_mod.affine(c))
    folded.attn_mod, folded.mlp_mod = None, None
    return folded.requires_grad_(False).eval()


@torch.no_grad()
def fold_conditioning(model: LoopedLM, loops: int) -> FoldedLM:
    """Fold ``model``'s loop conditioning (eq. 4) into its linear maps, for serving at ``loops``.

    Each recurrent layer gets one folded copy per loop i = 1..k (under c_i) and each output layer
    one (under c_k); input layers are unmodulated and shared. Folding runs in float64 and casts to
    the weights' dtype; each modulator supplies its affine form (``Modulator.affine``). Without a conditioner, or with an inactive one, there is
    nothing to fold: the result shares the source's layers, once for every loop.

    Memory: the recurrent weights are held k times, so the result's layer weights are
    ``D_eff(k) / D_eff(1)`` (eq. 1) of the source's; it shares the embedding, head and input layers
    with the source, which stays alive beside it. A serving trade-off for one fixed k; fold again
    for another k.

    Args:
        model: The trained model (left unchanged).
        loops: The loop count k >= 1 to serve at.

    Returns:
        An inference-only :class:`FoldedLM` that accepts ``loops == k`` only.

    Raises:
        ValueError: ``loops`` is not an integer >= 1.
        NotImplementedError: A modulator does not implement ``affine``.
    """
    check_loops(loops)
    config, conditioner = model.config, model.conditioner
    like = model.embed.weight

    def fold(blocks: nn.ModuleList, c: Optional[Tensor]) -> list[Block]:
        if c is None:
            return list(blocks)
        return [_fold_block(block, c.double()) for block in blocks]

    contexts = [
        None if conditioner is None else conditioner(i, loops, config.max_loops, like) for i in range(1, loops + 1)
    ]
    recurrent = [fold(model.core.layers, c) for c in contexts]
    folded = FoldedLM(model, loops, recurrent, fold(model.output_layers, contexts[-1]))
    folded.training = False  # the folded copies are in eval mode; the shared modules keep the source's mode
    return folded
