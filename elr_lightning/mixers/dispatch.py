"""Dropless expert dispatch: sort token copies by expert, run the experts as grouped matmuls, combine.

A token routed to ``top_k`` experts becomes ``top_k`` copies. :func:`plan_dispatch` sorts the copies
by expert once (a stable argsort) and counts them per expert; :func:`expert_swiglu` then runs every
expert's SwiGLU on its contiguous slice of the sorted copies, and :func:`combine` scatters the gated
results back to their tokens. No token is dropped and no Python loop runs over tokens.

The grouped matmul is ``torch._grouped_mm`` where the device and dtype support it (see
:func:`grouped_mm_supported`), else a loop over the experts' contiguous slices (under ``torch.compile``
an operator of its own, :func:`expert_matmul`, so that the graph does not break at its
data-dependent slice sizes). Autocast does not cover ``torch._grouped_mm`` or that operator, so
they cast the tokens and weights to the autocast dtype themselves (:func:`compute_dtype`), as
autocast does for the eager loop's matmuls. Both use every
expert's weights at every call, also an expert with no token (an empty slice multiplies, giving a zero
gradient), so DDP and FSDP reduce the same parameters on every rank.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

#: The dtypes ``torch._grouped_mm`` computes in; any other (float64) takes the loop over experts.
GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

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
        """``counts`` as a Python list: the slice sizes of the eager loop path, read on first use only
        (a host sync; the grouped path never reads it)."""
        return self.known_sizes if self.known_sizes is not None else self.counts.tolist()


def plan_dispatch(experts: Tensor, num_experts: int) -> DispatchPlan:
    """Sort the copies of ``experts`` ``[N, top_k]`` by expert: the plan every later step reuses.

    On the meta device or under ``FakeTensorMode``, where routes have shapes but no values (a
    ``meta_init`` model probed by a strategy's setup, ``elr estimate``), the copies are counted as
    spread evenly over the experts: every shape downstream is right (the copies' total does not
    depend on the routes) and every expert's weights take part, as they do on real data.
    """
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    known_sizes = None
    if flat.is_meta or (not torch.compiler.is_compiling() and is_fake(flat)):  # dynamo cannot trace is_fake
        share, extra = divmod(flat.numel(), num_experts)
        known_sizes = [share + (e < extra) for e in range(num_experts)]
        counts = torch.tensor(known_sizes, device=flat.device)
    else:  # a scatter, not ``bincount``: its output size depends on the values, so compilers cannot trace it
        counts = flat.new_zeros(num_experts).scatter_add_(0, flat, torch.ones_like(flat))
    return DispatchPlan(
        experts=experts,
        order=order,
        tokens=order // experts.shape[1],
        counts=counts,
        offsets=counts.cumsum(0).to(torch.int32),
        known_sizes=known_sizes,
    )


def select_tokens(plan: DispatchPlan, tokens: Union[slice, Tensor]) -> DispatchPlan:
    """The plan of some of ``plan``'s tokens (``tokens`` indexes its ``experts`` rows): the same experts per token.

    Their copies are sorted again (stably, so in the order they hold in ``plan``); no token is routed again.
    """
    return plan_dispatch(plan.experts[tokens], plan.counts.shape[0])


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype a matmul on ``x`` computes in: autocast's where it is on for ``x``'s device, else ``x``'s."""
    device = x.device.type  # the meta device has no autocast (asking about it raises)
    if x.dtype.is_floating_point and torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def grouped_mm_supported(x: Tensor, weight: Tensor, dtype: Optional[torch.dtype] = None) -> bool:
    """Whether ``torch._grouped_mm`` runs ``x @ weight[e]`` here in ``dtype`` (default :func:`compute_dtype`).

    It needs this torch to have it, tensors of one dtype among :data:`GROUPED_MM_DTYPES` (or an
    autocast ``dtype`` both are cast to; float64 takes the loop), rows aligned to 16 bytes (the inner and outer widths a multiple of 16 bytes in
    ``dtype``), and on CUDA bf16 on a Hopper-class device (compute capability 9.0 or later). Under
    ``torch.compile`` (``compile_layers``) and under ``FakeTensorMode`` (``elr estimate``) bf16 on
    the CPU too: the shape function of ``torch._grouped_mm`` refuses other dtypes, though the eager
    CPU kernel takes them.
    """
    dtype = compute_dtype(x) if dtype is None else dtype
    if not hasattr(torch, "_grouped_mm") or dtype not in GROUPED_MM_DTYPES or not weight.dtype.is_floating_point:
        return False
    if dtype == x.dtype and weight.dtype != x.dtype:  # nothing casts them to one dtype
        return False
    size = torch.empty((), dtype=dtype, device="meta").element_size()
    if (weight.shape[1] * size) % 16 or (weight.shape[2] * size) % 16:
        return False
    if x.device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return x.device.type == "cpu" and (dtype == torch.bfloat16 or not (torch.compiler.is_compiling() or is_fake(x)))


def grouped_matmul(x: Tensor, weight: Tensor, plan: DispatchPlan, grouped: bool) -> Tensor:
    """``x[rows of expert e] @ weight[e]`` for every expert: ``[M, n] x [E, n, m] -> [M, m]``.

    Args:
        x: The sorted token copies, expert by expert.
        weight: The experts' stacked weights.
        plan: The dispatch plan (slice sizes and offsets).
        grouped: Use ``torch._grouped_mm`` (see :func:`grouped_mm_supported`); else loop over experts
            (:func:`expert_matmul`). Both compute in :func:`compute_dtype`.
    """
    if grouped:
        dtype = compute_dtype(x)
        return torch._grouped_mm(x.to(dtype), weight.to(dtype), offs=plan.offsets)
    if torch.compiler.is_compiling():  # autocast does not reach into the operator: cast as it would
        dtype = compute_dtype(x)
        return expert_matmul(x.to(dtype), weight.to(dtype), plan.counts)
    return _loop_matmul(x, weight, plan.sizes)


def _loop_matmul(x: Tensor, weight: Tensor, sizes: list[int]) -> Tensor:
    parts = torch.split(x, sizes)
    return torch.cat([part @ weight[e] for e, part in enumerate(parts)])


@torch.library.custom_op("elr_lightning::expert_matmul", mutates_args=())
def expert_matmul(x: Tensor, weight: Tensor, counts: Tensor) -> Tensor:
    """The loop path of :func:`grouped_matmul` under ``torch.compile``: ``x``'s slice of ``counts[e]`` rows
    times ``weight[e]``, per expert.

    An operator of its own, so that the compiler keeps it whole: the slice sizes are read from
    ``counts`` on the host, a data-dependent shape the compiler would break its graph at, while the
    output's shape ``[M, m]`` is known from the inputs' (:func:`_expert_matmul_shape`). Its
    gradients are the same per-slice products autograd takes of the loop (:func:`_expert_matmul_backward`).
    Eager calls loop directly, reading the sizes once per plan (:attr:`DispatchPlan.sizes`).
    """
    return _loop_matmul(x, weight, counts.tolist())


@torch.library.custom_op("elr_lightning::expert_matmul_weight_grad", mutates_args=())
def expert_matmul_weight_grad(x: Tensor, grad: Tensor, counts: Tensor) -> Tensor:
    """The gradient of :func:`expert_matmul` in ``weight``: ``x_e^T grad_e`` for every expert ``e``, ``[E, n, m]``."""
    sizes = counts.tolist()
    return torch.stack([a.T @ b for a, b in zip(torch.split(x, sizes), torch.split(grad, sizes))])


@expert_matmul.register_fake
def _expert_matmul_shape(x: Tensor, weight: Tensor, counts: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[2])


@expert_matmul_weight_grad.register_fake
def _expert_matmul_weight_grad_shape(x: Tensor, grad: Tensor, counts: Tensor) -> Tensor:
    return x.new_empty(counts.shape[0], x.shape[1], grad.shape[1])


def _save_expert_matmul_inputs(ctx, inputs: tuple[Tensor, Tensor, Tensor], output: Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _expert_matmul_backward(ctx, grad: Tensor) -> tuple[Optional[Tensor], Optional[Tensor], None]:
    x, weight, counts = ctx.saved_tensors
    grad_x = expert_matmul(grad, weight.transpose(1, 2), counts) if ctx.needs_input_grad[0] else None
    grad_weight = expert_matmul_weight_grad(x, grad, counts) if ctx.needs_input_grad[1] else None
    return grad_x, grad_weight, None


expert_matmul.register_autograd(_expert_matmul_backward, setup_context=_save_expert_matmul_inputs)


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
