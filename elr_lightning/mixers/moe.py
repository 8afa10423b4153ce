"""Mixture-of-experts channel mixer with cross-loop route replay.

A router scores the E experts of each token, the top-k run (dropless, see
:mod:`elr_lightning.mixers.dispatch`) and their SwiGLU outputs are summed with the top-k softmax
weights, normalised to sum to one when top_k > 1 and the raw probability at top_k = 1 (Switch
Transformer: normalised, one expert's weight would be p / p = 1 and the LM loss would never reach
the router); an optional shared expert runs on every token.

**Route replay.** Inside the recurrent block the same layer runs at loops 1..k. Under replay, loop 1
routes (router top-k and the dispatch sort) and stores the plan in the per-forward scratch of
``(layer, loop 1)``; loops 2..k reuse it and skip the top-k and the sort. Under incremental decoding
each forward pass covers the new tokens only, so the scratch holds the routes of exactly those
(layer, token) pairs: loop 1 of a decode step routes the new token and loops 2..k replay. A decode
step whose rows run to different depths runs a later loop on some of loop 1's rows
(``LoopContext.rows``); the plan is cut to those rows (:func:`~elr_lightning.mixers.dispatch.select_tokens`),
so each row replays its own routes, as it would alone. Modes (the paper's table 4.3):

* ``dynamic`` (A): route at every loop.
* ``replay_inference`` (B): route at every loop while training; in eval mode as ``replay``.
* ``replay`` (C, as the paper defines it): the expert assignments, the experts and their gate
  weights, are computed once on loop 1 and reused at loops 2..k, which skip the router entirely.
* ``replay_experts`` (this library's variant of C): loops 2..k reuse loop 1's experts and dispatch
  plan, but recompute the gate weights from their own router logits at those experts. The router
  is a d x E matmul, cheap next to the experts, so the saving (top-k and sort) mostly stays, while
  the mixture follows each loop's state and the router learns from every loop.

Under truncated backpropagation (``backprop_loops < k``) loop 1 runs without a graph; the first
loop that carries gradient routes again and the later loops replay its routes (:meth:`MoE._replays_here`).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

from elr_lightning.config import ROUTE_REPLAY, ModelConfig
from elr_lightning.context import LoopContext
from elr_lightning.errors import is_integer
from elr_lightning.mixers.base import ChannelMixer
from elr_lightning.mixers.dispatch import (
    DISPATCH,
    DispatchPlan,
    combine,
    compute_dtype,
    expert_swiglu,
    grouped_mm_supported,
    plan_dispatch,
    select_tokens,
)
from elr_lightning.roles import set_role

#: The reasons ``dispatch="grouped"`` has already warned about (each once per process).
_GROUPED_WARNED: set[str] = set()

#: The name of the load-balancing loss in ``LoopContext.add_aux_loss`` (logged as ``train/moe_aux_loss``).
AUX_LOSS = "moe_aux_loss"


class MoE(ChannelMixer):
    """Top-k routed SwiGLU experts, optionally a shared expert, with cross-loop route replay.

    Load balancing: the Switch-Transformer loss ``coef * E * sum_i f_i P_i`` (f_i the fraction of
    token copies sent to expert i, P_i the mean router probability of i) at every call that routes,
    averaged over the loops that route, so its scale does not grow with k; and, with
    ``balance_rate > 0``, auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias added to the
    scores for the top-k choice only (not to the gate weights), moved after every optimizer step by
    ``balance_rate * sign(mean load - load_i)`` from the step's load summed over all ranks
    (:meth:`end_step`), outside the gradient.

    Args:
        config: The architecture (``d_model``).
        num_experts: Routed experts E (>= 1).
        top_k: Experts per token (1 <= top_k <= E).
        expert_dim: Hidden width of each routed expert; ``None`` means ``arch.d_ff`` / ``top_k``.
        shared_expert_dim: Hidden width of a shared expert every token runs; 0 for none.
        aux_loss_coef: Coefficient of the balance loss (>= 0; 0 turns it off).
        balance_rate: Step of the auxiliary-loss-free bias update (>= 0; 0 turns it off).
        normalize_weights: Whether the chosen experts' probabilities are divided by their sum (as
            ``norm_topk_prob`` in Hugging Face's Qwen MoE); ``None`` normalises when ``top_k > 1`` and
            gates with the raw probability at ``top_k = 1``. ``True`` at ``top_k = 1`` gates every token
            with 1, so only the balance loss trains the router (what checkpoints of this library's
            ``top_k = 1`` models computed before it followed Switch Transformer).
        replay: ``dynamic``, ``replay_inference``, ``replay`` or ``replay_experts`` (see the module
            docstring); ``None`` takes ``arch.route_replay``, else ``dynamic``.
        dispatch: ``auto`` (``torch._grouped_mm`` where supported, else a loop over experts),
            ``grouped`` (asks for it; warns once per reason and loops where it cannot run) or ``loop``.
    """

    routed = True

    def __init__(
        self,
        config: ModelConfig,
        num_experts: int = 8,
        top_k: int = 2,
        expert_dim: Optional[int] = None,
        shared_expert_dim: int = 0,
        aux_loss_coef: float = 0.01,
        balance_rate: float = 0.0,
        normalize_weights: Optional[bool] = None,
        replay: Optional[str] = None,
        dispatch: str = "auto",
    ) -> None:
        super().__init__(config)
        if not is_integer(num_experts):
            raise ValueError(f"num_experts={num_experts!r} must be an integer >= 1; give the layer at least one expert")
        if not is_integer(top_k) or top_k > num_experts:
            raise ValueError(f"top_k={top_k!r} must be in 1..num_experts={num_experts}; lower top_k or add experts")
        expert_dim = max(1, config.ff_dim // top_k) if expert_dim is None else expert_dim
        if not is_integer(expert_dim):
            raise ValueError(f"expert_dim={expert_dim!r} must be an integer >= 1")
        if not is_integer(shared_expert_dim, 0):
            raise ValueError(f"shared_expert_dim={shared_expert_dim!r} must be an integer >= 0 (0: no shared expert)")
        if aux_loss_coef < 0:
            raise ValueError(f"aux_loss_coef={aux_loss_coef} must be >= 0 (0 turns the balance loss off)")
        if balance_rate < 0:
            raise ValueError(f"balance_rate={balance_rate} must be >= 0 (0 turns bias balancing off)")
        replay = replay if replay is not None else config.route_replay or "dynamic"
        if replay not in ROUTE_REPLAY:
            raise ValueError(f"replay={replay!r} is not a route replay mode; use one of {ROUTE_REPLAY}")
        if dispatch not in DISPATCH:
            raise ValueError(f"dispatch={dispatch!r} must be one of {DISPATCH}")
        d = config.d_model
        self.num_experts, self.top_k, self.expert_dim = num_experts, top_k, expert_dim
        self.aux_loss_coef, self.balance_rate = aux_loss_coef, balance_rate
        self.normalize_weights = top_k > 1 if normalize_weights is None else bool(normalize_weights)
        self.replay, self.dispatch = replay, dispatch
        self.router = nn.Linear(d, num_experts, bias=False)
        self.w_up = set_role(nn.Parameter(torch.empty(num_experts, d, 2 * expert_dim)), init="normal")
        self.w_down = set_role(nn.Parameter(torch.empty(num_experts, expert_dim, d)), init="scaled_normal")
        self.shared_up = nn.Linear(d, 2 * shared_expert_dim, bias=False) if shared_expert_dim else None
        self.shared_down = nn.Linear(shared_expert_dim, d, bias=False) if shared_expert_dim else None
        if self.shared_down is not None:
            set_role(self.shared_down.weight, init="scaled_normal")
        self.register_buffer("expert_bias", torch.zeros(num_experts))
        self._load: Optional[Tensor] = None  # not a buffer: DDP would broadcast rank 0's over the others

    def reset_buffers(self) -> None:
        """Zero the balancing bias (called by ``LoopedLM.init_weights``, also after a meta-device build)."""
        self.expert_bias.zero_()

    def replays(self, ctx: LoopContext) -> bool:
        """Whether this call reuses loop 1's routes.

        Loops 2..k do under ``replay`` and ``replay_experts``, and under ``replay_inference`` in eval mode.
        """
        return ctx.loop >= 2 and self.replaying()

    def replaying(self) -> bool:
        """Whether loops 2..k replay in the current mode (training or eval)."""
        return self.replay in ("replay", "replay_experts") or (self.replay == "replay_inference" and not self.training)

    def _replays_here(self, ctx: LoopContext, first: dict[str, Any]) -> bool:
        """Whether this call reuses the routes stored in ``first`` (the scratch of ``(layer, 1)``).

        Under truncated backpropagation (``backprop_loops < k``) loop 1 routes without a graph, so
        its routes would give the router no gradient at all (replayed gates) or only the LM loss's
        (recomputed gates), and its balance loss would be a constant. The first loop that carries
        gradient routes again instead, and later loops replay its routes. The loop that routed is
        recorded, so activation checkpointing's recomputation of that loop routes again too.
        """
        if not self.replays(ctx) or "plan" not in first:
            return False
        if first["routed_at"] == ctx.loop:
            return False
        return first["tracked"] or not torch.is_grad_enabled()

    def _grouped(self, x: Tensor) -> bool:
        """Whether this call runs ``torch._grouped_mm``: where asked for (``auto``, ``grouped``) and supported.

        ``grouped`` where it cannot run (rows not 16-byte aligned in the compute dtype, a device or
        dtype it does not take) uses the loop path and warns once per reason and process, as
        ``GatedDeltaProduct(kernels="fla")`` does, instead of failing inside ``torch._grouped_mm``.
        """
        if self.dispatch == "loop":
            return False
        if grouped_mm_supported(x, self.w_up) and grouped_mm_supported(x, self.w_down):
            return True
        if self.dispatch == "grouped":
            why = (
                f"torch._grouped_mm cannot run widths d_model={self.w_up.shape[1]}, expert_dim={self.expert_dim} "
                f"in {compute_dtype(x)} on {x.device.type} (rows must be multiples of 16 bytes; on CUDA bf16 on "
                "compute capability 9.0+)"
            )
            if why not in _GROUPED_WARNED:
                _GROUPED_WARNED.add(why)
                warnings.warn(f"MoE: dispatch='grouped' but {why}; using the loop over experts instead", stacklevel=3)
        return False

    def route(self, logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Top-k routing of router ``logits`` ``[N, E]``: ``(probs, experts, weights)``.

        ``probs`` is the float32 softmax over experts; ``experts`` ``[N, top_k]`` the top-k of
        ``probs + expert_bias`` (the bias steers the choice only); ``weights`` the gates of those
        experts (:meth:`gates`).
        """
        probs = logits.float().softmax(dim=-1)
        experts = torch.topk(probs + self.expert_bias, self.top_k, dim=-1, sorted=False).indices
        return probs, experts, self.gates(probs, experts)

    def gates(self, probs: Tensor, experts: Tensor) -> Tensor:
        """The gate weights ``[N, top_k]`` of ``experts`` under router probabilities ``probs`` ``[N, E]``.

        The chosen probabilities, divided by their sum per token when ``normalize_weights``.
        """
        chosen = probs.gather(-1, experts)
        return chosen / chosen.sum(dim=-1, keepdim=True) if self.normalize_weights else chosen

    @override
    def forward(self, x: Tensor, ctx: LoopContext, layer: int) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        first = ctx.scratch(layer, 1)
        aux = None
        if self._replays_here(ctx, first):
            plan: DispatchPlan = first["plan"]
            tokens = None if ctx.rows is None else _tokens_of(ctx.rows, shape)
            if tokens is not None:  # this loop runs on some of loop 1's rows: their own routes
                plan = select_tokens(plan, tokens)
            if self.replay == "replay_experts":
                weights = self.gates(self.router(x).float().softmax(dim=-1), plan.experts)
            else:
                weights = first["weights"] if tokens is None else first["weights"][tokens]
        else:
            probs, experts, weights = self.route(self.router(x))
            plan = plan_dispatch(experts, self.num_experts)
            tracked = torch.is_grad_enabled()
            if self.replay != "dynamic" and (ctx.loop == 1 or self.replays(ctx)):
                first.update(plan=plan, weights=weights, routed_at=ctx.loop, tracked=tracked)
            if self.training:
                aux = self._account(probs, plan, ctx, ctx.scratch(layer))
                if self.replaying() and not tracked:
                    aux = None  # no graph to carry it: the first loop with gradient routes again and adds it
        y = combine(expert_swiglu(x, self.w_up, self.w_down, plan, self._grouped(x)), weights, plan, x.shape[0])
        if self.shared_up is not None and self.shared_down is not None:
            gate, up = self.shared_up(x).chunk(2, dim=-1)
            y = y + self.shared_down(F.silu(gate) * up)
        if aux is not None:
            ctx.add_aux_loss(AUX_LOSS, aux)
        return y.reshape(shape)

    def _account(self, probs: Tensor, plan: DispatchPlan, ctx: LoopContext, store: dict[str, Any]) -> Optional[Tensor]:
        """Count this routing call's load; its balance loss, or ``None`` (training only).

        ``store`` is this layer's scratch at this loop. Activation checkpointing runs the forward
        again in the backward pass with the same context; the routes it counted the first time are
        not counted again: they are added with weight 0, so that a compiled layer (``compile_layers``)
        runs the same graph in the forward pass and in its recomputation (a graph that differed
        would save other tensors, which checkpointing refuses).
        """
        counts = plan.counts.detach().float()
        load = self._load if self._load is not None else torch.zeros_like(counts)
        self._load = load + counts * (0.0 if store.get("load_counted", False) else 1.0)
        store["load_counted"] = True
        if self.aux_loss_coef == 0:
            return None
        routing_calls = ctx.loops if ctx.loop >= 1 and not self.replaying() else 1
        f = counts / counts.sum()
        return self.aux_loss_coef * self.num_experts * (f * probs.mean(dim=0)).sum() / routing_calls

    @override
    @torch.no_grad()
    def end_step(self, reduce: Callable[[Tensor], Tensor]) -> Optional[Tensor]:
        """Sum the step's expert load over ranks, move the balancing bias, return the load ``[E]``."""
        load = self._load if self._load is not None else self.expert_bias.new_zeros(self.num_experts)
        self._load = None
        load = reduce(load.to(self.expert_bias.device))
        if self.balance_rate > 0:
            self.expert_bias.add_(self.balance_rate * torch.sign(load.mean() - load))
        return load

    @override
    def discard_step(self) -> None:
        self._load = None

    @override
    def folded(self, pre: Tensor, shift: Tensor, gate: Tensor) -> "MoE":
        """Refused: a mixture of experts is served with eq. (4)'s constants and its weights shared.

        Folding the pre-map into the router and every expert's up-projection, and the gate into
        every expert's down-projection, would copy all E experts once per loop (k times the layer's
        largest weights) and give each expert a bias its dispatch does not take, to save what
        :func:`~elr_lightning.inference.fold.serving_model` already keeps small: decoding with the
        constants and shared weights ran at 0.97x (k = 1) and 1.03x (k = 4) of the same model's
        decode rate without conditioning, the op sequence a weight fold would run
        (``bench/moe.py --only decode``, CPU, d = 256, 16 experts, top-2).

        Raises:
            NotImplementedError: always, saying to serve with ``serving_model`` (``elr generate --fold``).
        """
        raise NotImplementedError(
            "MoE cannot be folded into copies of its weights (every expert would be copied per loop); serve it "
            "with its conditioning constants instead: serving_model(model, k) or elr generate --fold"
        )

    @override
    def flops_per_token(self, context: float) -> float:
        """Active forward FLOPs: the router, ``top_k`` routed experts and the shared expert."""
        d = self.config.d_model
        shared = self.shared_down.in_features if self.shared_down is not None else 0
        return 2.0 * d * self.num_experts + 2.0 * 3 * d * (self.top_k * self.expert_dim + shared)

    @override
    def active_parameters(self) -> int:
        """Parameters a token uses: the router, ``top_k`` of the E experts and the shared expert."""
        routed = self.w_up.numel() + self.w_down.numel()
        return sum(p.numel() for p in self.parameters()) - routed + routed * self.top_k // self.num_experts


def _tokens_of(rows: Union[slice, Tensor], shape: torch.Size) -> Union[slice, Tensor]:
    """The flattened tokens of ``rows`` of a pass's batch (a slice of consecutive rows, or indices), whose input
    ``[B, ..., d]`` of ``shape`` holds those B rows."""
    per_row = math.prod(shape[1:-1])
    if per_row == 1:
        return rows
    if isinstance(rows, slice):
        return slice((rows.start or 0) * per_row, (rows.start or 0) * per_row + shape[0] * per_row)
    return (rows[:, None] * per_row + torch.arange(per_row, device=rows.device)).flatten()
