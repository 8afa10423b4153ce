"""Fold loop conditioning (eq. 4) into the sublayers' own linear maps for serving at a fixed k.

At a fixed loop count k the context c_i = MLP([phi(i / k); phi(k / K)]) of loop i depends on
``(i, k, K)`` alone, so every modulated sublayer's FiLM-plus-adapter pre-map and exit gate are
constants. With ``A = up.weight`` ``[d, r]``, ``B = down.weight`` ``[r, d]``, ``g = g(c_i)`` and
``(lambda, mu) = film(c_i)``, the pre-map of eq. (4) is affine,

    x^ = M h + m,   M = (I + A diag(g) B) diag(1 + lambda),   m = (I + A diag(g) B) mu,

so a sublayer's first linear map ``W`` (attention ``q`` and ``kv``, MLP ``up``) becomes
``W M`` with the bias ``W m``, and the exit gate ``(1 + omega) * (W_o y)`` becomes
``diag(1 + omega) W_o`` (attention ``o``, MLP ``down``). The folded layers are plain
:class:`~elr_lightning.layers.Block` s, so a folded model runs the op sequence of the
non-recurrent baseline plus the state update.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn
from typing_extensions import override

from elr_lightning.cache import KVCache
from elr_lightning.config import ModelConfig
from elr_lightning.layers import Block
from elr_lightning.model import LoopedLM, RecurrentCore

__all__ = ["FoldedLM", "fold_conditioning"]


class _FoldedCore(nn.Module):
    """The recurrent core with one folded copy of its layers per loop and no conditioner."""

    #: The same k-loop as the source core (DESIGN §2), over :meth:`layers_at`.
    forward = RecurrentCore.forward

    def __init__(self, source: RecurrentCore, per_loop: list[list[Block]]) -> None:
        super().__init__()
        self.config, self.first_layer, self.update = source.config, source.first_layer, source.update
        self.conditioner = None
        self.per_loop = nn.ModuleList(nn.ModuleList(layers) for layers in per_loop)

    def layers_at(self, loop: int) -> nn.ModuleList:
        """The layers folded under loop ``loop``'s context."""
        return self.per_loop[loop - 1]


class FoldedLM(nn.Module):
    """An inference-only :class:`LoopedLM` at one loop count k, with conditioning folded in.

    ``forward(input_ids, loops, attention_mask, cache)`` is :meth:`LoopedLM.forward` at
    ``loops == k`` over the folded layers: the same state update, injection and KV slots
    ``(layer, loop)``. The embedding, input layers, final norm, head and RoPE tables are the
    source's own modules, shared, not copied. Build it with :func:`fold_conditioning`.

    Args:
        source: The model to serve.
        loops: The loop count k it is folded for.
        recurrent_layers: One list of ``n_rec`` plain blocks per loop ``1..k``.
        output_layers: The ``n_out`` plain output blocks (folded with c_k).
    """

    #: RoPE tables and the causal/padding mask, exactly as :meth:`LoopedLM.attention_inputs`.
    attention_inputs = LoopedLM.attention_inputs

    def __init__(
        self, source: LoopedLM, loops: int, recurrent_layers: list[list[Block]], output_layers: list[Block]
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
        self, input_ids: Tensor, loops: int, attention_mask: Optional[Tensor] = None, cache: Optional[KVCache] = None
    ) -> Tensor:
        """Logits ``[B, T, vocab]``, as :meth:`LoopedLM.forward` at ``loops`` (which must be k).

        Raises:
            ValueError: ``loops`` is not the loop count this model was folded for.
        """
        if loops != self.loops:
            raise ValueError(f"this model is folded for loops={self.loops}, called with loops={loops}; fold again")
        return LoopedLM.forward(self, input_ids, loops, attention_mask, cache)


def _fold_block(config: ModelConfig, block: Block, c: Tensor) -> Block:
    """A plain block computing ``block`` under the context ``c``: q, kv and up gain biases."""
    attn_m, attn_b, attn_gate = block.attn_mod.affine(c)
    mlp_m, mlp_b, mlp_gate = block.mlp_mod.affine(c)
    state: dict[str, Tensor] = {
        "attn_norm.weight": block.attn_norm.weight,
        "mlp_norm.weight": block.mlp_norm.weight,
        "attn.o.weight": attn_gate[:, None] * block.attn.o.weight.double(),
        "mlp.down.weight": mlp_gate[:, None] * block.mlp.down.weight.double(),
    }
    for name, linear, pre, bias in (
        ("attn.q", block.attn.q, attn_m, attn_b),
        ("attn.kv", block.attn.kv, attn_m, attn_b),
        ("mlp.up", block.mlp.up, mlp_m, mlp_b),
    ):
        w = linear.weight.double()
        state[f"{name}.weight"], state[f"{name}.bias"] = w @ pre, w @ bias
    dtype = block.attn.q.weight.dtype
    state = {name: t.detach().to(dtype).clone() for name, t in state.items()}
    with torch.device("meta"):
        folded = Block(config)
        d, attn = config.d_model, folded.attn
        attn.q = nn.Linear(d, attn.q.out_features, bias=True)
        attn.kv = nn.Linear(d, attn.kv.out_features, bias=True)
        folded.mlp.up = nn.Linear(d, folded.mlp.up.out_features, bias=True)
    folded.load_state_dict(state, assign=True)
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
        ValueError: ``loops < 1``.
        NotImplementedError: A modulator does not implement ``affine``.
    """
    if loops < 1:
        raise ValueError(f"loops={loops} must be >= 1")
    config, conditioner = model.config, model.conditioner
    like = model.embed.weight

    def fold(blocks: nn.ModuleList, c: Optional[Tensor]) -> list[Block]:
        if c is None:
            return list(blocks)
        return [_fold_block(config, block, c.double()) for block in blocks]

    contexts = [
        None if conditioner is None else conditioner(i, loops, config.max_loops, like) for i in range(1, loops + 1)
    ]
    recurrent = [fold(model.core.layers, c) for c in contexts]
    return FoldedLM(model, loops, recurrent, fold(model.output_layers, contexts[-1])).eval()
