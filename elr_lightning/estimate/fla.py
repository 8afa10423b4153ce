"""What fla's Gated DeltaProduct kernels hold in memory, on fake tensors: the GDP layers of a GPU run in an estimate.

On a CUDA device with bf16 activations, :func:`~elr_lightning.mixers.delta_rule.delta_product` runs
fla's ``chunk_gated_delta_product``, whose Triton kernels cannot run on the fake tensors of
:mod:`elr_lightning.estimate.memory`. There, :func:`fla_stand_in` takes their place
(:data:`~elr_lightning.mixers.delta_rule.FLA_STAND_IN`): an autograd function that computes nothing
and allocates, in order, what fla-core 0.6.0's ``ChunkGatedDeltaProductFunction`` allocates, read
from ``fla/ops/gated_delta_product/chunk.py`` and the kernel wrappers it calls: the forward's
buffers (decay cumsums, the chunk matrix ``A``, ``w``, ``u``, the per-chunk states ``h``), its
outputs, the tensors it saves for the backward pass (``q, k, v``, the interleaved decay, ``beta``, ``A``
in ``k``'s dtype), and the backward's recomputation and gradients. A later fla may allocate otherwise.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

#: fla's chunk length in sub-steps (its ``BT``).
CHUNK = 64


def _chunks(length: int) -> int:
    return -(-length // CHUNK)


class _FlaMemory(torch.autograd.Function):
    """Shapes and dtypes of fla's forward and backward; no values (see the module docstring)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, n: int, initial_state: Optional[Tensor]
    ) -> tuple[Tensor, Tensor]:
        b, t, h, dk = q.shape
        steps, dv = k.shape[1], v.shape[-1]
        f32 = torch.float32
        g_steps = g.new_zeros(b, t, n, h, dtype=f32).view(b, steps, h)  # the decay on each token's first sub-step
        g_cum, g_steps = g.new_empty(b, t, h, dtype=f32), torch.empty_like(g_steps)  # chunk_local_cumsum of both
        a = k.new_empty(b, steps, h, CHUNK, dtype=f32)  # chunk_scaled_dot_kkt_fwd
        a = k.new_zeros(b, steps, h, CHUNK)  # solve_tril, in k's dtype
        w, u = k.new_empty(b, steps, h, dk), v.new_empty(b, steps, h, dv)  # recompute_w_u_fwd
        states, v_new = k.new_empty(b, _chunks(t), h, dk, dv), torch.empty_like(u)  # chunk_gated_delta_product_fwd_h
        final = k.new_empty(b, h, dk, dv, dtype=f32)
        o = v.new_empty(b, t, h, dv)
        del g_cum, w, u, states, v_new
        ctx.save_for_backward(q, k, v, g_steps, beta, a, initial_state)
        ctx.n = n
        return o, final

    @staticmethod
    def backward(ctx: Any, do: Tensor, dht: Optional[Tensor]) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        q, k, v, g_steps, beta, a, initial_state = ctx.saved_tensors
        n = ctx.n
        b, t, h, dk = q.shape
        steps, dv = k.shape[1], v.shape[-1]
        q_steps = q.new_zeros(b, t, n, h, dk)  # queries and output gradients on the last sub-step of each token
        do_steps = do.new_zeros(b, t, n, h, dv)
        w, u = k.new_empty(b, steps, h, dk), v.new_empty(b, steps, h, dv)  # recompute_w_u_fwd
        states, v_new = k.new_empty(b, _chunks(steps), h, dk, dv), torch.empty_like(u)  # chunk_gated_delta_rule_fwd_h
        dv_local = torch.empty_like(do_steps).view(b, steps, h, dv)  # chunk_bwd_dv_local
        dstates = q.new_empty(b, _chunks(steps), h, dk, dv)  # chunk_gated_delta_rule_bwd_dhu
        dh0 = None if initial_state is None else torch.empty_like(initial_state, dtype=torch.float32)
        dv_state = torch.empty_like(dv_local)
        del dv_local
        dq, dk_out, dw = q.new_empty(b, steps, h, dk), k.new_empty(b, steps, h, dk), torch.empty_like(w)  # chunk_bwd_dqkwg
        dg = torch.empty_like(g_steps, dtype=torch.float32)
        del states, v_new, dstates, q_steps, do_steps
        dk2, dv_out, db, dg2 = torch.empty_like(dk_out), torch.empty_like(v), torch.empty_like(g_steps), torch.empty_like(beta)
        del w, u, dw, dv_state, dk2, dg2  # prepare_wy_repr_bwd, then dk += dk2, dg += dg2
        dq = dq.view(b, t, n, h, dk)[:, :, -1].contiguous()
        dg = dg.view(b, t, n, h)[:, :, 0].contiguous()
        return dq, dk_out, dv_out, dg, db, None, dh0


def fla_stand_in(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, num_householder: int, initial_state: Optional[Tensor]
) -> tuple[Tensor, Tensor]:
    """In place of fla's ``chunk_gated_delta_product(q, k, v, g.float(), beta.to(k.dtype), ...)``: ``(o, final_state)``
    of the right shapes and dtypes, with fla's allocations (no values)."""
    state = None if initial_state is None else initial_state.float()
    return _FlaMemory.apply(q, k, v, g.float(), beta.to(k.dtype), num_householder, state)
