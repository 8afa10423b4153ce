"""Dropless expert dispatch: sort token copies by expert, run the experts as grouped matmuls, combine.

A token routed to ``top_k`` experts becomes ``top_k`` copies. :func:`plan_dispatch` sorts the copies
by expert once (a stable argsort) and counts them per expert; :func:`expert_swiglu` then runs every
expert's SwiGLU on its contiguous slice of the sorted copies, and :func:`combine` scatters the gated
results back to their tokens. No token is dropped and no Python loop runs over tokens.

The grouped matmul is ``torch._grouped_mm`` where the device and dtype support it (see
:func:`grouped_mm_supported`), else a loop over the experts' contiguous slices. Autocast does not
cover ``torch._grouped_mm``, so the grouped path casts the tokens and weights to the autocast dtype
itself (:func:`compute_dtype`), as autocast does for the loop path's matmuls. Both use every
expert's weights at every call, also an expert with no token (an empty slice multiplies, giving a zero
gradient), so DDP and FSDP reduce the same parameters on every rank.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

#: Dispatch implementations: ``auto`` picks ``grouped`` where supported, else ``loop``.
DISPATCH = ("auto", "grouped", "loop")


@dataclass
class DispatchPlan:
    """Where the ``N x top_k`` token copies of one call go: what route replay keeps from loop 1.

    Attributes:
        experts: ``[N, top_k]`` expert index of each token's copies (the routes).
        order: ``[N top_k]`` the copies sorted by expert (indices into the flattened ``experts``).
        tokens: ``[N top_k]`` the token of each sorted copy (``order // top_k``).
        counts: ``[E]`` copies per expert (int64).
        offsets: ``[E]`` int32 cumulative counts (the ``offs`` of ``torch._grouped_mm``).
        known_sizes: ``counts`` as a list where it is known without reading the device (the meta
            device, whose tensors hold no values), else ``None``.
    """

    experts: Tensor
    order: Tensor
    tokens: Tensor
    counts: Tensor
    offsets: Tensor
    known_sizes: Optional[list[int]] = None

    @functools.cached_property
    def sizes(self) -> list[int]:
        """``counts`` as a Python list: the slice sizes of the loop path, read on first use only
        (a host sync; the grouped path never reads it)."""
        return self.known_sizes if self.known_sizes is not None else self.counts.tolist()


def plan_dispatch(experts: Tensor, num_experts: int) -> DispatchPlan:
    """Sort the copies of ``experts`` ``[N, top_k]`` by expert: the plan every later step reuses.

    On the meta device, where routes have shapes but no values (a ``meta_init`` model probed by a
    strategy's setup), the copies are counted as spread evenly over the experts: every shape
    downstream is right and every expert's weights take part, as they do on real data.
    """
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    known_sizes = None
    if flat.is_meta:
        share, extra = divmod(flat.numel(), num_experts)
        known_sizes = [share + (e < extra) for e in range(num_experts)]
        counts = torch.tensor(known_sizes, device=flat.device)
    else:
        counts = torch.bincount(flat, minlength=num_experts)
    return DispatchPlan(
        experts=experts,
        order=order,
        tokens=order // experts.shape[1],
        counts=counts,
        offsets=counts.cumsum(0).to(torch.int32),
        known_sizes=known_sizes,
    )


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype a matmul on ``x`` computes in: autocast's where it is on for ``x``'s device, else ``x``'s."""
    device = x.device.type  # the meta device has no autocast (asking about it raises)
    if x.dtype.is_floating_point and torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def grouped_mm_supported(x: Tensor, weight: Tensor, dtype: Optional[torch.dtype] = None) -> bool:
    """Whether ``torch._grouped_mm`` runs ``x @ weight[e]`` here in ``dtype`` (default :func:`compute_dtype`).

    It needs this torch to have it, floating tensors of one dtype (or an autocast ``dtype`` both are
    cast to), rows aligned to 16 bytes (the inner and outer widths a multiple of 16 bytes in
    ``dtype``), and on CUDA bf16 on a Hopper-class device (compute capability 9.0 or later).
    """
    dtype = compute_dtype(x) if dtype is None else dtype
    if not hasattr(torch, "_grouped_mm") or not dtype.is_floating_point or not weight.dtype.is_floating_point:
        return False
    if dtype == x.dtype and weight.dtype != x.dtype:  # nothing casts them to one dtype
        return False
    size = torch.empty((), dtype=dtype, device="meta").element_size()
    if (weight.shape[1] * size) % 16 or (weight.shape[2] * size) % 16:
        return False
    if x.device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    if torch.compiler.is_compiling() and dtype != torch.bfloat16:  # its meta kernel, which compile traces, takes bf16 only
        return False
    return x.device.type == "cpu"


def grouped_matmul(x: Tensor, weight: Tensor, plan: DispatchPlan, grouped: bool) -> Tensor:
    """``x[rows of expert e] @ weight[e]`` for every expert: ``[M, n] x [E, n, m] -> [M, m]``.

    Args:
        x: The sorted token copies, expert by expert.
        weight: The experts' stacked weights.
        plan: The dispatch plan (slice sizes and offsets).
        grouped: Use ``torch._grouped_mm`` in :func:`compute_dtype` (see :func:`grouped_mm_supported`);
            else loop over experts.
    """
    if grouped:
        dtype = compute_dtype(x)
        return torch._grouped_mm(x.to(dtype), weight.to(dtype), offs=plan.offsets)
    parts = torch.split(x, plan.sizes)
    return torch.cat([part @ weight[e] for e, part in enumerate(parts)])


def expert_swiglu(x: Tensor, w_up: Tensor, w_down: Tensor, plan: DispatchPlan, grouped: bool) -> Tensor:
    """Each sorted copy through its expert's SwiGLU: ``silu(x W1) * (x W3)`` then ``W2``.

    Args:
        x: ``[N, d]`` the tokens (unsorted; gathered here in the plan's order).
        w_up: ``[E, d, 2 f]`` gate and up projections of every expert.
        w_down: ``[E, f, d]`` down projections.
        plan: The dispatch plan.
        grouped: See :func:`grouped_matmul`.

    Returns:
        ``[N top_k, d]`` the expert outputs of the sorted copies.
    """
    h = grouped_matmul(x[plan.tokens], w_up, plan, grouped)
    gate, up = h.chunk(2, dim=-1)
    return grouped_matmul((F.silu(gate) * up).contiguous(), w_down, plan, grouped)


def combine(y: Tensor, weights: Tensor, plan: DispatchPlan, num_tokens: int) -> Tensor:
    """``out[t] = sum_j weights[t, j] y[copy (t, j)]``: the gated expert outputs summed per token.

    Args:
        y: ``[N top_k, d]`` expert outputs of the sorted copies.
        weights: ``[N, top_k]`` gate weights of each token's copies (in ``plan.experts``' order).
        plan: The dispatch plan.
        num_tokens: N.
    """
    gated = y * weights.flatten()[plan.order, None].to(y.dtype)
    return y.new_zeros(num_tokens, y.shape[1]).index_add_(0, plan.tokens, gated)
