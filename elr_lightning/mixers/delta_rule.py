"""The gated delta-product recurrence, chunked, in plain PyTorch; fla's Triton kernels where they run.

Per head, with state ``S`` ``[d_k, d_v]``, decay ``g_t <= 0`` (log space) and ``n`` Householder
steps per token (Gated DeltaProduct; Gated DeltaNet is ``n = 1``)::

    S <- exp(g_t) S
    for j in 1..n:   S <- S - beta_tj k_tj (k_tj^T S) + beta_tj k_tj v_tj^T      # (I - b k k^T) S + b k v^T
    o_t = S^T q_t

:func:`chunked_delta_product` computes this in chunks of ``C`` sub-steps (the ``n`` sub-steps of a
token laid out one after another, the decay on the first, the query on the last, as fla does). In a
chunk starting from ``S0``, with cumulative decays ``G_i`` and ``Gamma_ij = exp(G_i - G_j)`` for
``j <= i``, the delta rule's corrections ``u_i = beta_i (v_i - exp(g_i) S_{i-1}^T k_i)`` solve the
unit-lower-triangular system (the WY form of a product of Householder matrices)::

    (I + A) U = diag(beta) V - diag(beta exp(G)) K S0,   A_ij = beta_i Gamma_ij k_i^T k_j  (j < i)
    o_i  = exp(G_i) S0^T q_i + sum_{j <= i} Gamma_ij (k_j^T q_i) u_j
    S_C  = exp(G_C) S0 + sum_j exp(G_C - G_j) k_j u_j^T

so everything but the chunk-to-chunk state hand-over is a batched matrix product.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

_FLA_WARNED = False


def chunked_delta_product(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    num_householder: int = 1,
    initial_state: Optional[Tensor] = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """The gated delta-product recurrence (module docstring) in chunks, computed in float32.

    A chunk holds ``max(1, chunk_size // n)`` tokens (fewer for a shorter input, e.g. one decode
    step), that is ``n`` times as many sub-steps; outputs are computed at each token's last
    sub-step only.

    Args:
        q: Queries ``[B, T, H, d_k]`` (already scaled).
        k: Keys ``[B, T n, H, d_k]``, the ``n`` Householder keys of each token in turn (unit norm).
        v: Values ``[B, T n, H, d_v]``.
        g: Log decay per token ``[B, T, H]`` (``<= 0``).
        beta: Step sizes ``[B, T n, H]``.
        num_householder: ``n``.
        initial_state: ``S`` before the first token ``[B, H, d_k, d_v]``; zeros if ``None``.
        chunk_size: Sub-steps per chunk (rounded down to a multiple of ``n``).

    Returns:
        ``(o, S)``: outputs ``[B, T, H, d_v]`` in ``q``'s dtype and the final state ``[B, H, d_k, d_v]`` (float32).
    """
    dtype = q.dtype
    b, t, h, dk = q.shape
    n, dv = num_householder, v.shape[-1]
    tokens = max(1, min(chunk_size // n, t))
    c = tokens * n
    pad = -t % tokens
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))
    beta = beta.float().transpose(1, 2)
    g = F.pad(g.float().transpose(1, 2)[..., None], (0, n - 1)).reshape(b, h, t * n)  # decay on sub-step 0
    if pad:
        q = F.pad(q, (0, 0, 0, pad))
        k, v = F.pad(k, (0, 0, 0, pad * n)), F.pad(v, (0, 0, 0, pad * n))
        beta, g = F.pad(beta, (0, pad * n)), F.pad(g, (0, pad * n))
    m = (t + pad) // tokens
    q = q.reshape(b, h, m, tokens, dk)
    k, v = k.reshape(b, h, m, c, dk), v.reshape(b, h, m, c, dv)
    beta, cum = beta.reshape(b, h, m, c), g.reshape(b, h, m, c).cumsum(-1)
    steps = torch.arange(c, device=q.device)
    rows = steps[n - 1 :: n]  # each token's last sub-step, where its query reads the state
    cum_out = cum[..., n - 1 :: n]
    gamma = (cum[..., :, None] - cum[..., None, :]).masked_fill(steps[:, None] < steps, float("-inf")).exp()
    a = (beta[..., None] * (k @ k.transpose(-1, -2)) * gamma).tril(-1)
    eye = torch.eye(c, dtype=q.dtype, device=q.device)
    rhs = torch.cat((beta[..., None] * v, (beta * cum.exp())[..., None] * k), dim=-1)
    solved = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
    u_free, w = solved[..., :dv], solved[..., dv:]
    gamma_out = (cum_out[..., :, None] - cum[..., None, :]).masked_fill(rows[:, None] < steps, float("-inf")).exp()
    scores = (q @ k.transpose(-1, -2)) * gamma_out
    q_decayed = q * cum_out.exp()[..., None]
    k_tail = k * (cum[..., -1:] - cum).exp()[..., None]
    state = q.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.float()
    decay = cum[..., -1, None, None].exp()
    outs = []
    # unbind once: indexing chunk i inside the loop would cost a full-size gradient buffer per chunk
    for u_i, w_i, q_i, s_i, k_i, d_i in zip(*(x.unbind(2) for x in (u_free, w, q_decayed, scores, k_tail, decay))):
        u = u_i - w_i @ state
        outs.append(q_i @ state + s_i @ u)
        state = d_i * state + k_i.transpose(-1, -2) @ u
    o = torch.stack(outs, dim=2).reshape(b, h, m * tokens, dv)[:, :, :t]
    return o.transpose(1, 2).to(dtype), state


@functools.cache
def _fla_kernel() -> Optional[Callable[..., tuple[Tensor, Tensor]]]:
    """fla's ``chunk_gated_delta_product`` if fla imports, else ``None`` (tried once per process)."""
    try:
        from fla.ops.gated_delta_product import chunk_gated_delta_product
    except Exception:  # noqa: BLE001 - any import failure (no fla, no triton, no driver) means "not available"
        return None
    return chunk_gated_delta_product


#: Kernel choices of :func:`delta_product`.
KERNELS = ("auto", "fla", "torch")


@torch.compiler.disable
def delta_product(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    num_householder: int = 1,
    initial_state: Optional[Tensor] = None,
    chunk_size: int = 64,
    kernels: str = "auto",
) -> tuple[Tensor, Tensor]:
    """:func:`chunked_delta_product`, or fla's Triton kernels (same arguments and numbers).

    ``kernels``: ``auto`` uses fla on CUDA when it imports, else PyTorch; ``fla`` asks for fla and,
    where it cannot run (on CPU, or without the ``fla`` extra), uses PyTorch and warns once per
    process, never failing mid-run; ``torch`` always uses PyTorch.

    ``torch.compile`` leaves this call out of its graphs: the chunk loop would be unrolled per
    sequence length and takes minutes to compile; the projections around it are still compiled.
    """
    global _FLA_WARNED
    if kernels != "torch":
        kernel = _fla_kernel() if q.is_cuda else None
        if kernel is not None:
            return kernel(
                q.to(k.dtype),
                k,
                v,
                g.float(),
                beta,
                num_householder=num_householder,
                scale=1.0,
                initial_state=None if initial_state is None else initial_state.float(),
                output_final_state=True,
            )
        if kernels == "fla" and not _FLA_WARNED:
            _FLA_WARNED = True
            why = (
                "the tensors are not on CUDA"
                if not q.is_cuda
                else "fla does not import (pip install 'elr-lightning[fla]')"
            )
            warnings.warn(
                f"GatedDeltaProduct: kernels='fla' but {why}; using the PyTorch chunked path instead",
                stacklevel=2,
            )
    return chunked_delta_product(q, k, v, g, beta, num_householder, initial_state, chunk_size)


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / ||x||`` over the last dimension, computed in float32 (as fla's ``l2norm``)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)
