"""The two seams a layer is made of: a token mixer, then a channel mixer (DESIGN §3).

A layer computes ``x + T(norm(x))`` then ``x + C(norm(x))``, each optionally modulated by the loop
context (eq. 4). The model builds every mixer from ``arch`` (see
:meth:`~elr_lightning.config.ModelConfig.mixer_spec`) as ``cls(config, **init_args)`` and never
looks at which class it got.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch
from torch import Tensor, nn
from torch.func import functional_call

from elr_lightning.context import LoopContext
from elr_lightning.recompute import RecomputedTensors, autocast_off, read_dtype


class Architecture(Protocol):
    """What a mixer is built from: :class:`~elr_lightning.config.ModelConfig` (or any config with its fields).

    The seams sit below the model config, which imports them to check the classes its patterns
    name; so this module names the config by the fields every mixer may read, not by importing it.
    """

    d_model: int
    n_heads: int
    norm_eps: float


@dataclass(frozen=True)
class CacheBytes:
    """Generation-cache memory of one mixer for one sequence.

    Attributes:
        per_token: Bytes that grow with every cached token (attention keys and values).
        fixed: Bytes held whatever the length (recurrent and convolution state).
    """

    per_token: int = 0
    fixed: int = 0


@dataclass(frozen=True)
class Modulation:
    """Eq. (4)'s adapter and exit gate at one loop for one sublayer: a low-rank map and a vector.

    The mixer computes ``y = gate * f(P h)`` with ``P = I + up @ down`` from its input ``h``. The
    FiLM scale and shift are not here: the layer applies them with its RMSNorm (scale folded into
    the norm's weight, shift added in the same pass). Both fields are functions of the context c_i
    alone, computed once per loop in the autograd graph (:meth:`~elr_lightning.layers.Modulator.modulation`).

    Attributes:
        up: ``[d, r]``, the adapter's ``A diag(g(c))``; ``None`` for no adapter.
        down: ``[r, d]``, the adapter's ``B``; ``None`` for no adapter.
        gate: ``[d]``, the exit gate ``1 + omega(c)``.
    """

    up: Optional[Tensor]
    down: Optional[Tensor]
    gate: Tensor


class _LowRankFold(torch.autograd.Function):
    """``W P = W + (W up) down``, eq. (4)'s adapter folded into a weight, with a backward of few passes.

    Autograd's own backward of ``addmm(W, W @ up, down)`` forms the low-rank term of ``W``'s
    gradient as one ``[out, d]`` tensor and then sums it with the incoming gradient into another;
    this one adds the term to the incoming gradient in one ``addmm``, one weight-sized tensor fewer.
    """

    @staticmethod
    def forward(ctx: Any, w: Tensor, up: Tensor, down: Tensor) -> Tensor:
        # Computed in the weight's dtype even under autocast, then cast once to the dtype the linear
        # reads it in (what autocast's cast of the weight would give): no second weight-sized copy.
        dtype = read_dtype(w)
        with autocast_off(w.device.type):
            wu = w @ up
            ctx.save_for_backward(w, up, down, wu)
            return torch.addmm(w, wu, down).to(dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        w, up, down, wu = ctx.saved_tensors
        with autocast_off(grad.device.type):  # in the weight's dtype, as the forward
            grad = grad.to(w.dtype)
            # The rank-r products short and wide ([r, out]): BLAS on the CPU runs these 1.5-2.5x
            # faster than the tall and skinny grad @ down^T and w^T @ t.
            t_rows = down @ grad.T
            return torch.addmm(grad, t_rows.T, up.T), (t_rows @ w).T, wu.T @ grad


def low_rank_fold(w: Tensor, up: Tensor, down: Tensor) -> Tensor:
    """``w + (w @ up) @ down``: the weight ``W`` times ``P = I + up down`` (eq. 4), differentiable in all three.

    The result is in :func:`read_dtype` of ``w`` (autocast's dtype under autocast), computed in ``w``'s.
    """
    return _LowRankFold.apply(w, up, down)


def gated_rows(w: Tensor, gate: Tensor) -> Tensor:
    """``diag(gate) W``: eq. (4)'s exit gate folded into the rows of an output weight, in :func:`read_dtype` of ``w``."""
    return (gate.to(w.dtype)[:, None] * w).to(read_dtype(w))


def adapted(flat: Tensor, up: Tensor, down: Tensor) -> Tensor:
    """``P x = x + (x down^T) up^T`` for ``flat`` ``[tokens, d]``: eq. (4)'s adapter on the activations.

    In ``flat``'s dtype even under autocast (the rank-r products cost little in any dtype): the
    caller passes the input in the dtype the mixer's Linears read it in, so that they share ``P x``.
    """
    with autocast_off(flat.device.type):
        return torch.addmm(flat, flat @ down.T.to(flat.dtype), up.T.to(flat.dtype))


class _Mixer(nn.Module):
    """What token and channel mixers share: construction, folding and cache accounting."""

    #: Names of the ``nn.Linear`` submodules that read the (modulated) mixer input: folding
    #: eq. (4)'s affine pre-map multiplies into these. Empty means the mixer cannot be folded.
    fold_inputs: tuple[str, ...] = ()
    #: Names of the ``nn.Linear`` submodules whose output is the mixer output: folding scales their rows
    #: by the exit gate.
    fold_outputs: tuple[str, ...] = ()

    def __init__(self, config: Architecture) -> None:
        super().__init__()
        self.config = config

    def forward(self, x: Tensor, ctx: LoopContext, layer: int) -> Tensor:
        """Map the normalised (and modulated) input ``x`` ``[B, T, d]`` to ``[B, T, d]``.

        Args:
            x: The sublayer input.
            ctx: The loop context of this forward pass and loop.
            layer: This layer's number, the key under which it reads and writes ``ctx``'s stores.
        """
        raise NotImplementedError

    def modulated(self, x: Tensor, ctx: LoopContext, layer: int, mod: Modulation) -> Tensor:
        """``mod.gate * self(P x, ctx, layer)`` with ``P = I + mod.up @ mod.down`` (eq. 4).

        The default folds each term into the weights where that is cheaper than a pass over the
        activations, inside the autograd graph, and runs ``forward`` once with the folded weights
        (``torch.func.functional_call``):

        * the adapter: every Linear named in :attr:`fold_inputs` runs with ``W P = W + (W up) down``
          when their output widths sum to fewer than the tokens of ``x``; else ``P x`` is one
          ``addmm`` over the activations, shared by all of them, computed from ``x`` cast once to
          the dtype they read (bf16 under autocast; a mixer that names none gets ``x``'s dtype);
        * the gate: every Linear named in :attr:`fold_outputs` runs with its rows scaled when its
          input width is below the tokens of ``x``; else the output is multiplied.

        In training (gradients on, no activation checkpointing, eager) the folded weights and
        ``P x`` are rebuilt in the backward pass rather than kept
        (:class:`~elr_lightning.recompute.RecomputedTensors`): eq. 4 then holds activations, not a
        copy of the weights per loop.

        Folding is exact when the mixer reads its input only through ``fold_inputs`` and writes
        its output only through ``fold_outputs`` (the contract of :meth:`folded`). A mixer that
        names neither gets the modulation on its activations. Which form runs depends on shapes
        only, never on tensor values.
        """
        tokens = x.numel() // x.shape[-1]
        weights: dict[str, Tensor] = {}
        inputs = [getattr(self, name) for name in self.fold_inputs]
        outputs = [getattr(self, name) for name in self.fold_outputs]
        rebuild = torch.is_grad_enabled() and not ctx.checkpointed and not torch.compiler.is_compiling()
        with RecomputedTensors(rebuild) as keep:
            if mod.up is not None and mod.down is not None:
                if inputs and outputs and sum(linear.out_features for linear in inputs) < tokens:
                    for name, linear in zip(self.fold_inputs, inputs):
                        w = linear.weight
                        up, down = mod.up.to(w.dtype), mod.down.to(w.dtype)
                        weights[f"{name}.weight"] = keep.add(low_rank_fold, w, up, down)
                else:
                    # The input in the dtype its Linears read it in (the cast each would make and keep),
                    # once: P x is rebuilt from it. A mixer that names none gets its input's dtype.
                    dtype = read_dtype(inputs[0].weight) if inputs else x.dtype
                    flat = x.reshape(tokens, x.shape[-1]).to(dtype)
                    x = keep.add(adapted, flat, mod.up, mod.down).view(x.shape)
            fold_gate = bool(inputs and outputs) and all(linear.in_features < tokens for linear in outputs)
            if fold_gate:
                for name, linear in zip(self.fold_outputs, outputs):
                    weights[f"{name}.weight"] = keep.add(gated_rows, linear.weight, mod.gate)
                    if linear.bias is not None:
                        weights[f"{name}.bias"] = mod.gate.to(linear.bias.dtype) * linear.bias
            y = functional_call(self, weights, (x, ctx, layer)) if weights else self(x, ctx, layer)
        return y if fold_gate else mod.gate.to(y.dtype) * y

    def cache_bytes(self, dtype: torch.dtype) -> CacheBytes:
        """Generation-cache memory of this mixer per cache slot and sequence (nothing by default)."""
        return CacheBytes()

    def flops_per_token(self, context: float) -> float:
        """Forward FLOPs per token at a mean causal context of ``context`` positions.

        The default counts ``2 x`` the elements of every weight with two or more dimensions (each
        multiplied once per token); mixers that do more (attention scores, a recurrence) or less
        (a mixture of experts runs a few experts) override it.
        """
        return 2.0 * sum(p.numel() for p in self.parameters() if p.ndim >= 2)

    def active_parameters(self) -> int:
        """Parameters each token uses: all of them by default (a mixture of experts uses top-k experts)."""
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def folded(self, pre: Tensor, shift: Tensor, gate: Tensor) -> "_Mixer":
        """A copy computing ``gate * self(pre @ h + shift)``, for serving at a fixed loop count.

        ``pre`` ``[d, d]``, ``shift`` ``[d]`` and ``gate`` ``[d]`` are in float64 (see
        :mod:`elr_lightning.inference.fold`). The default multiplies ``pre`` and ``shift`` into every Linear
        named in :attr:`fold_inputs` (which gain a bias) and ``gate`` into the rows of every Linear
        named in :attr:`fold_outputs`; it is exact when the mixer reads its input only through those
        maps and writes its output only through those. Override it otherwise.

        Raises:
            NotImplementedError: the mixer names no ``fold_inputs``.
        """
        if not self.fold_inputs or not self.fold_outputs:
            raise NotImplementedError(
                f"{type(self).__name__} names no fold_inputs/fold_outputs; it cannot be folded (serve it unfolded)"
            )
        out = copy.deepcopy(self)
        for name in self.fold_inputs:
            source: nn.Linear = getattr(self, name)
            w = source.weight.double()
            folded = nn.Linear(source.in_features, source.out_features, bias=True, device=w.device)
            bias = w @ shift + (source.bias.double() if source.bias is not None else 0.0)
            folded.weight.copy_(w @ pre)
            folded.bias.copy_(bias)
            setattr(out, name, folded.to(source.weight.dtype))
        for name in self.fold_outputs:
            linear: nn.Linear = getattr(out, name)
            linear.weight.copy_(gate[:, None] * linear.weight.double())
            if linear.bias is not None:
                linear.bias.copy_(gate * linear.bias.double())
        return out.requires_grad_(False).eval()


class TokenMixer(_Mixer):
    """Seam contract for what mixes information across positions (attention, linear attention).

    Construction: ``cls(config, **init_args)`` with the model's :class:`ModelConfig` and the
    ``init_args`` of its ``arch.mixers`` entry. Declare the init and optimizer group of parameters
    that need more than the defaults with :func:`~elr_lightning.roles.set_role` (output projections:
    ``init="scaled_normal"``; parameters with ``init="module"`` are initialised by the mixer's own
    ``init_parameter(name, param)``).

    ``forward(x, ctx, layer)`` must be causal: position t depends on positions <= t only. It must
    respect the padding in ``ctx.positions`` (padding neither attends nor feeds any state). For
    incremental decoding, a mixer keeps what later tokens need in ``ctx.cached(layer)`` (``None``
    when there is no cache): attention appends keys and values with ``store.update``; a
    recurrent mixer reads the state before the new tokens with ``store.state(name)`` and writes the
    state after them with ``store.set_state(name, tensor)``. Then a forward over a prompt followed
    by one over the next token equals one forward over both (the per-loop policy is exact).
    Report that memory in :meth:`cache_bytes`.
    """


class ChannelMixer(_Mixer):
    """Seam contract for the per-token feed-forward (SwiGLU, mixture of experts).

    Construction as for :class:`TokenMixer`. ``forward(x, ctx, layer)`` maps each position on its
    own: no information may flow between positions.

    A channel mixer may keep per-token state across the loops of one forward pass in
    ``ctx.scratch(layer, loop)``: e.g. a mixture of experts computes its routes at loop 1
    (``ctx.scratch(layer)["routes"] = routes`` when ``ctx.loop == 1``) and replays them at loops
    2..k (``ctx.scratch(layer, 1)["routes"]``). Scratch stores live for one forward pass; under
    incremental decoding each forward pass covers the new tokens only, which is what per-token
    routes need. A decode step whose rows stop at different depths runs a later loop on some of
    loop 1's rows only: ``ctx.rows`` names them (``None``: all), and the mixer reads those rows of
    what loop 1 stored (:class:`~elr_lightning.mixers.MoE` cuts its dispatch plan to them). A mixer may add an auxiliary loss with ``ctx.add_aux_loss(name, value)``; the
    caller collects it with ``LoopedLM.forward(..., aux_losses=dict)``.

    Every parameter should take part in every forward pass at every k (multiply by a zero gate
    rather than skip), or DDP needs ``find_unused_parameters`` and FSDP refuses (DESIGN §6).

    A mixer that routes tokens (:attr:`routed`) honours ``arch.route_replay`` and may report its
    per-expert load in :meth:`end_step`, which the training module calls once per optimizer step on
    every rank.

    Conditioning (eq. 4) reaches a mixer through :meth:`modulated`, called instead of ``forward``
    in modulated layers. The default folds the adapter and gate into the Linears named in
    ``fold_inputs`` / ``fold_outputs``; a mixer whose weights are not such Linears (e.g. experts
    stored as one ``[E, d, h]`` tensor) names none and gets the activation form, or overrides
    :meth:`modulated` (e.g. folding ``P`` into every expert's input weights). Either way it must
    equal ``mod.gate * self(P x)``. Under activation checkpointing a loop's forward runs twice;
    scratch written at loop i is written again with equal values, and auxiliary losses added
    during the recomputation are not collected again. Statistics kept outside the graph (e.g. an
    expert load) must be counted once per ``ctx.scratch(layer)``: the recomputation sees the same
    store (:class:`~elr_lightning.mixers.MoE` marks it).
    """

    #: Whether the mixer routes tokens to experts (and so can replay routes across loops).
    routed: bool = False

    def end_step(self, reduce: Callable[[Tensor], Tensor]) -> Optional[Tensor]:
        """Called after each optimizer step's backward, on every rank; ``None`` by default.

        A routed mixer sums what it counted during the step over the ranks with ``reduce`` (a
        collective: every rank calls it the same number of times whatever k it ran), updates state
        kept outside the gradient (e.g. a balancing bias) and returns the per-expert load ``[E]``
        of the step, which the module logs.
        """
        return None

    def discard_step(self) -> None:
        """Forget what was counted since the last :meth:`end_step` (e.g. by a strategy's setup probes).

        The training module calls it on every rank when training starts. Nothing by default.
        """
