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

import contextlib
import functools
import warnings
from collections.abc import Callable
from contextvars import ContextVar
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

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
    device = q.device.type  # autocast would run the products in bf16; the meta device has no autocast
    off = torch.autocast(device, enabled=False) if torch.amp.is_autocast_available(device) else contextlib.nullcontext()
    with off:  # not recompute.autocast_off: this file is copied into HF exports, which import nothing of ours
        return _chunked(q, k, v, g, beta, num_householder, initial_state, chunk_size)


def _chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    n: int,
    initial_state: Optional[Tensor],
    chunk_size: int,
) -> tuple[Tensor, Tensor]:
    """:func:`chunked_delta_product`'s computation (autocast off)."""
    dtype = q.dtype
    b, t, h, dk = q.shape
    dv = v.shape[-1]
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

#: Device types fla's Triton kernels run on (ROCm devices report ``cuda`` too).
FLA_DEVICE_TYPES = ("cuda",)

#: Input dtypes of fla's chunked kernels: ``chunk_gated_delta_product`` asserts ``q.dtype != torch.float32``.
FLA_DTYPES = (torch.bfloat16, torch.float16)

#: Widest key per head fla's kernels take (``assert K <= 256`` in its state kernels).
FLA_MAX_HEAD_DIM = 256


def fla_unsupported(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Optional[Tensor] = None
) -> Optional[str]:
    """Why fla's ``chunk_gated_delta_product`` cannot take these inputs, or ``None`` where it can.

    Reads only the tensors' devices, dtypes and widths (arguments as :func:`delta_product`'s), then
    whether fla imports (tried last: the import is slow and needs Triton). fla's contract: every
    tensor on a device of :data:`FLA_DEVICE_TYPES`; ``q``, ``k``, ``v`` in one dtype of
    :data:`FLA_DTYPES` (``g``, ``beta`` and the state may be float32, as fla's own layer passes them);
    a key width of at most :data:`FLA_MAX_HEAD_DIM`.

    Returns:
        A clause naming the unmet condition and its fix, for the warning of ``kernels="fla"``.
    """
    tensors = (q, k, v, g, beta) + (() if initial_state is None else (initial_state,))
    if any(x.device.type not in FLA_DEVICE_TYPES for x in tensors):
        return "the tensors are not on CUDA"
    why = _fla_shapes_unsupported(q, k, v)
    if why is None and _fla_kernel() is None:
        return "fla does not import (install the fla extra)"
    return why


def _fla_shapes_unsupported(q: Tensor, k: Tensor, v: Tensor) -> Optional[str]:
    """The dtype and width conditions of :func:`fla_unsupported`: why fla's kernels refuse these inputs, or ``None``."""
    if q.dtype not in FLA_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        dtypes = ", ".join(sorted({str(x.dtype).removeprefix("torch.") for x in (q, k, v)}))
        return (
            f"fla's kernels need bf16 or fp16 inputs, not {dtypes}: train with precision bf16-mixed "
            "(or generate and evaluate with dtype bfloat16)"
        )
    if q.shape[-1] > FLA_MAX_HEAD_DIM:
        return f"fla's kernels take head_dim <= {FLA_MAX_HEAD_DIM}, not {q.shape[-1]}"
    return None


#: While set, called in place of fla's kernels wherever their inputs suit them, on any device: the memory
#: estimate traces fake tensors on the CPU with :func:`~elr_lightning.estimate.fla.fla_stand_in` here, so
#: that its GDP layers hold what fla's hold on a GPU. Same arguments as :func:`_fla_delta_product`.
FLA_STAND_IN: ContextVar[Optional[Callable[..., tuple[Tensor, Tensor]]]] = ContextVar("fla_stand_in", default=None)

#: The reasons :func:`delta_product` has already warned about (each once per process).
_FLA_WARNED: set[str] = set()


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

    ``kernels``: ``auto`` uses fla where it can run (:func:`fla_unsupported`: CUDA, bf16 or fp16
    inputs, fla installed), else PyTorch; ``fla`` asks for fla and, where it cannot run, uses PyTorch
    and warns once per reason and process, naming it, never failing mid-run; ``torch`` always uses
    PyTorch.

    ``torch.compile`` traces the PyTorch path into its graph (the chunk loop unrolled: one copy per
    chunk of the sequence) and leaves fla's kernels out of it.
    """
    stand_in = None if torch.compiler.is_compiling() else FLA_STAND_IN.get()
    if kernels != "torch" and stand_in is not None and _fla_shapes_unsupported(q, k, v) is None:
        return stand_in(q, k, v, g, beta, num_householder, initial_state)
    if kernels != "torch":
        why = fla_unsupported(q, k, v, g, beta, initial_state)
        if why is None:
            return _fla_delta_product(q, k, v, g, beta, num_householder, initial_state)
        if kernels == "fla":
            _warn_fallback(why)
    return chunked_delta_product(q, k, v, g, beta, num_householder, initial_state, chunk_size)


@torch.compiler.disable
def _fla_delta_product(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, num_householder: int, initial_state: Optional[Tensor]
) -> tuple[Tensor, Tensor]:
    """fla's ``chunk_gated_delta_product``; out of compiled graphs (Triton kernels and autograd of its own)."""
    return _fla_kernel()(
        q,
        k,
        v,
        g.float(),
        beta.to(k.dtype),
        num_householder=num_householder,
        scale=1.0,
        initial_state=None if initial_state is None else initial_state.float(),
        output_final_state=True,
    )


@torch.compiler.disable
def _warn_fallback(why: str) -> None:
    """Warn once per reason and process that ``kernels="fla"`` runs the PyTorch path."""
    if why not in _FLA_WARNED:
        _FLA_WARNED.add(why)
        warnings.warn(
            f"GatedDeltaProduct: kernels='fla' but {why}; using the PyTorch chunked path instead", stacklevel=4
        )


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / ||x||`` over the last dimension, computed in float32 (as fla's ``l2norm``)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)
