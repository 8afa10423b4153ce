"""Training compute of a looped LM: FLOPs per token and the eq. (5) multiplier of delayed mixed depth.

Two levels of precision:

* :func:`compute_multiplier` is eq. (5) of the paper,
  ``(1 - rho) + rho * D_eff(mean_k) / D_eff(1)``, which counts layers only (eq. 1).
* :func:`forward_flops_per_token` / :func:`train_flops_per_token` count the matrix multiplies of
  every layer, as each mixer reports them (attention projections, attention scores and values over
  the causal context, SwiGLU, a linear-attention recurrence),
  the adaptive-delta gate once per loop, the conditioning adapters while conditioning is on, and the
  LM head once. :func:`flops_multiplier` is eq. (5) with these counts in place of layer counts; it
  is a little below eq. (5) because the LM head does not repeat with k.

Element-wise work (norms, RoPE, softmax, activations, the state update) and the per-loop context
MLP of the conditioner (run once per loop, not per token) are not counted. Training is three
forward passes' worth (forward plus a backward of twice its cost). Every function is linear in the
loop count, so a fractional mean loop count gives the mean cost.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

import torch

from elr_lightning.config import ModelConfig

#: Training FLOPs per forward FLOP: the backward pass costs about twice the forward pass.
TRAIN_FORWARD_RATIO = 3.0


def _check(rho: Optional[float] = None, loops: Optional[float] = None) -> None:
    if rho is not None and not 0.0 <= rho <= 1.0:
        raise ValueError(f"rho={rho} must be in [0, 1] (the fraction of training tokens in the mixed phase)")
    if loops is not None and loops < 1:
        raise ValueError(f"loop count {loops} must be >= 1")


def compute_multiplier(config: ModelConfig, rho: float, mean_loops: float) -> float:
    """Eq. (5): training compute relative to an all-k = 1 run, counting layers.

    ``(1 - rho) + rho * D_eff(mean_loops) / D_eff(1)`` with ``D_eff(k) = L_in + k L_rec + L_out``
    (eq. 1).

    Args:
        config: The architecture (only ``n_in``, ``n_rec``, ``n_out`` matter).
        rho: Fraction of training tokens in the mixed-depth phase (0.25 for a switch at 75%; 1 for
            mixed depth from scratch).
        mean_loops: Mean loop count of the mixed phase, e.g. eq. (3)'s
            ``f + (1 - f)(K + 1) / 2``.

    Returns:
        The multiplier (1.0 for an all-k = 1 run).
    """
    _check(rho, mean_loops)
    depth_1 = config.n_in + config.n_rec + config.n_out
    depth_k = config.n_in + mean_loops * config.n_rec + config.n_out
    return (1.0 - rho) + rho * depth_k / depth_1


def _mixer_flops(config: ModelConfig, name: str, context: float) -> float:
    """Forward FLOPs per token of the mixer a pattern entry names, built on the meta device."""
    key = (json.dumps(dataclasses.asdict(config), sort_keys=True, default=str), name)
    if key not in _MIXERS:
        with torch.device("meta"):
            _MIXERS[key] = config.build_mixer(name)
    return _MIXERS[key].flops_per_token(context)


#: Mixers built on the meta device for counting, by (config, name): counting runs every step.
_MIXERS: dict[tuple[str, str], Any] = {}


def block_flops_per_token(
    config: ModelConfig, block: str, seq_len: Optional[int] = None, adapter_rank: int = 0
) -> float:
    """Forward FLOPs per token of all layers of ``block`` (``in``, ``rec``, ``out``), one pass.

    Each layer counts its token and channel mixers' :meth:`~elr_lightning.mixers.TokenMixer.flops_per_token`
    at the mean causal context ``c = (T + 1) / 2`` of a sequence of ``T`` tokens (for attention:
    ``2 x`` its projection weights plus ``4 n_heads head_dim c``; for SwiGLU ``2 x 3 d d_ff``),
    plus ``2 x 2 d r`` per sublayer for an eq. (4) low-rank adapter of rank ``r``.

    Args:
        config: The architecture.
        block: Which block.
        seq_len: Sequence length T; ``config.max_seq_len`` by default.
        adapter_rank: Rank of the conditioning adapters, 0 for none.
    """
    t = config.max_seq_len if seq_len is None else seq_len
    if t < 1 or adapter_rank < 0:
        raise ValueError(f"seq_len={t} must be >= 1 and adapter_rank={adapter_rank} >= 0")
    context = (t + 1) / 2
    adapters = 2.0 * 2 * (2 * config.d_model * adapter_rank)
    n = {"in": config.n_in, "rec": config.n_rec, "out": config.n_out}[block]
    total = 0.0
    for j in range(n):
        token, channel = config.layer_mixers(block, j)
        total += _mixer_flops(config, token, context) + _mixer_flops(config, channel, context) + adapters
    return total


def forward_flops_per_token(
    config: ModelConfig,
    loops: float,
    seq_len: Optional[int] = None,
    *,
    gate: bool = True,
    adapter_rank: int = 0,
) -> float:
    """Forward FLOPs per token at loop count ``loops``.

    ``F_in + k (F_rec + F_gate) + F_out + F_head`` (each ``F_block`` is :func:`block_flops_per_token`;
    ``(L_in + L_out) F_layer + k (L_rec F_layer + F_gate) + F_head`` for a single-mixer model, whose
    layers all cost ``F_layer``) where ``F_gate = 2 d^2`` is the adaptive-delta gate ``W_beta`` (eq. 2) and ``F_head = 2 d V`` the LM head. Adapters
    (``adapter_rank > 0``) are counted on the recurrent and output layers, which carry them (eq. 4).

    Args:
        config: The architecture.
        loops: Loop count k (a mean loop count gives the mean cost).
        seq_len: Sequence length T; ``config.max_seq_len`` by default.
        gate: The state update has a ``d x d`` gate (adaptive delta); ``False`` for rules without.
        adapter_rank: Rank of the conditioning adapters while conditioning is on, else 0.

    Returns:
        Forward FLOPs per token.
    """
    _check(loops=loops)
    gate_flops = 2.0 * config.d_model**2 if gate else 0.0
    head = 2.0 * config.d_model * config.vocab_size
    blocks = {
        b: block_flops_per_token(config, b, seq_len, 0 if b == "in" else adapter_rank) for b in ("in", "rec", "out")
    }
    return blocks["in"] + loops * (blocks["rec"] + gate_flops) + blocks["out"] + head


def train_flops_per_token(
    config: ModelConfig,
    loops: float,
    seq_len: Optional[int] = None,
    *,
    gate: bool = True,
    adapter_rank: int = 0,
) -> float:
    """Training FLOPs per token (forward and backward) at loop count ``loops``.

    ``3 x`` :func:`forward_flops_per_token` with the same arguments.
    """
    return TRAIN_FORWARD_RATIO * forward_flops_per_token(
        config, loops, seq_len, gate=gate, adapter_rank=adapter_rank
    )


def flops_multiplier(
    config: ModelConfig,
    rho: float,
    mean_loops: float,
    seq_len: Optional[int] = None,
    *,
    gate: bool = True,
    adapter_rank: int = 0,
) -> float:
    """Eq. (5) with FLOP counts in place of layer counts.

    ``(1 - rho) + rho * F(mean_loops, conditioned) / F(1, plain)`` where ``F`` is
    :func:`train_flops_per_token` and the mixed phase runs the adapters of rank ``adapter_rank``.

    Args:
        config: The architecture.
        rho: Fraction of training tokens in the mixed-depth phase.
        mean_loops: Mean loop count of the mixed phase.
        seq_len: Sequence length T; ``config.max_seq_len`` by default.
        gate: The state update has a ``d x d`` gate.
        adapter_rank: Rank of the conditioning adapters in the mixed phase, 0 for none.

    Returns:
        The multiplier over an all-k = 1 run without conditioning.
    """
    _check(rho, mean_loops)
    base = train_flops_per_token(config, 1, seq_len, gate=gate)
    mixed = train_flops_per_token(config, mean_loops, seq_len, gate=gate, adapter_rank=adapter_rank)
    return (1.0 - rho) + rho * mixed / base
