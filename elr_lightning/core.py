"""The recurrent core and the forward pass that a looped model and its folded copies share.

:class:`RecurrentCore` runs the k loops of the shared block (DESIGN §2); :class:`LoopedForward`
runs embedding, input block, core, output block and head over whatever layers a model holds, so
:class:`~elr_lightning.model.LoopedLM` and :class:`~elr_lightning.inference.fold.FoldedLM` compute the same
function with the same cache numbering.
"""

from __future__ import annotations

import numbers
from contextlib import nullcontext
from typing import MutableMapping, Optional

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from elr_lightning.cache_store import KVCache
from elr_lightning.conditioning import Conditioner
from elr_lightning.config import ModelConfig
from elr_lightning.context import LoopContext, Positions
from elr_lightning.layers import Block, Modulator, layer_modulations
from elr_lightning.mixers import Rotary
from elr_lightning.updates import StateUpdate


class RecurrentCore(nn.Module):
    """The shared block R_theta with its state update and conditioner; ``forward`` runs all k loops.

    Keeping the whole k-loop inside one module's ``forward`` lets a sharding strategy wrap it as a
    single unit, so ranks running different k issue the same collectives (DESIGN §6). A strategy
    that shards each recurrent layer on its own instead gives every forward the same number of
    passes (``LoopContext.passes``): the passes after loop k call every layer on zero rows.
    """

    def __init__(
        self, config: ModelConfig, update: StateUpdate, conditioner: Optional[Conditioner]
    ) -> None:
        super().__init__()
        self.config = config
        self.update = update
        self.conditioner = conditioner
        self.layers = blocks(config, "rec", conditioner)
        #: ``none``, ``loop`` or ``layer``: what the backward pass recomputes (see :meth:`LoopedLM.set_backprop`).
        self.checkpointing = "none"
        #: Backpropagate through the last this many loops only (``None``: all).
        self.backprop_loops: Optional[int] = None
        #: Compute eq. 4's terms of all the layers of a loop at once, in the loop (one matmul for their heads).
        #: A strategy that shards each layer on its own turns it off: a layer's heads are then gathered only
        #: inside its own ``forward``, which computes its terms there (the same values).
        self.batch_modulations = True

    def tracked_loops(self, loops: int) -> int:
        """How many of a forward's ``loops`` loops keep a graph: the last :attr:`backprop_loops` of them, else all."""
        return loops if self.backprop_loops is None else min(loops, self.backprop_loops)

    def forward(self, h_in: Tensor, ctx: LoopContext) -> tuple[Tensor, Optional[Tensor]]:
        """Run ``ctx.loops`` passes (DESIGN §2); return the final state s_k and the last context c_k.

        With gradients on, loops before the last :attr:`backprop_loops` run without a graph
        (truncated backpropagation: their state enters the later loops as a constant, while the
        injected input h_in still gets the later loops' gradients), and under ``loop``
        checkpointing each tracked loop keeps only its input state and recomputes the rest in the
        backward pass. c_k is returned as a fresh tensor, not a view, since sharding wrappers refuse
        views as outputs. Where ``ctx.passes`` exceeds k, :meth:`idle_passes` follow the loops; s_k
        is unchanged (its zero rows are concatenated to it).
        """
        s = self.update.init(h_in)
        c = None
        tracked = torch.is_grad_enabled()
        first = ctx.loops - self.tracked_loops(ctx.loops) + 1
        for i in range(1, ctx.loops + 1):
            truncated = tracked and i < first
            with torch.no_grad() if truncated else nullcontext():  # a truncated loop keeps nothing, its context neither
                if self.conditioner is not None:
                    c = self.conditioner(i, ctx.loops, ctx.max_loops, h_in)
                loop_ctx = ctx.at(i, c)
                if tracked and not truncated and self.checkpointing == "loop":
                    s = checkpoint(
                        self.loop, s, h_in, loop_ctx.under_checkpoint(), use_reentrant=False, preserve_rng_state=False
                    )
                else:
                    s = self.loop(s, h_in, loop_ctx)
        if ctx.passes is not None and ctx.passes > ctx.loops:
            s = torch.cat([s, self.idle_passes(h_in, ctx, None if c is None else c.detach()).to(s.dtype)])
        return s, None if c is None else c.clone()

    def idle_passes(self, h_in: Tensor, ctx: LoopContext, cond: Optional[Tensor]) -> Tensor:
        """Loops k + 1 .. ``ctx.passes`` on zero rows; their output, of zero rows.

        Each idle pass calls every recurrent layer as loop i of a forward at ``ctx.passes`` loops
        would (:meth:`LoopContext.idle <elr_lightning.context.LoopContext.idle>`, under c_k), on a
        tensor of no rows: no arithmetic, but a layer sharded on its own gathers its weights, and in
        the backward pass gathers them again and reduce-scatters its (zero) gradient, as at a real
        loop. So ranks at different k issue the same collectives. The passes that a forward at
        ``ctx.passes`` loops would run without a graph (truncated backpropagation) run without one,
        and the others are checkpointed as real loops are. The state update and the conditioner,
        which belong to the core's own unit, are not called.

        The first pass that keeps a graph starts from a fresh tensor that requires grad, as a real
        tracked loop's input does (h_in enters it): FSDP2 registers a unit's post-backward hook on
        the forward's inputs that require grad only, and without it the layer stays gathered after
        its backward, so this rank would issue one all-gather fewer than its peers in the backward
        pass (a hang) whenever idle passes without a graph precede it (truncated backpropagation).
        """
        tracked = torch.is_grad_enabled()
        x = h_in.new_zeros((0, *h_in.shape[1:]))
        with_graph = self.tracked_loops(ctx.passes) - self.tracked_loops(ctx.loops)  # the last idle passes keep one
        for i in range(ctx.loops + 1, ctx.passes + 1):
            keeps = tracked and i > ctx.passes - with_graph
            if keeps and not x.requires_grad:
                x = x.detach().requires_grad_()
            with nullcontext() if keeps or not tracked else torch.no_grad():
                idle = ctx.idle(i, cond)
                if keeps and self.checkpointing == "loop":
                    x = checkpoint(self.run_layers, x, idle.under_checkpoint(), use_reentrant=False, preserve_rng_state=False)
                else:
                    x = self.run_layers(x, idle)
        return x

    def loop(self, s: Tensor, h_in: Tensor, ctx: LoopContext) -> Tensor:
        """One pass of loop ``ctx.loop``: inject h_in into s_{i-1}, run the layers, update to s_i.

        Eq. 4's terms of all the loop's layers under c_i are computed here at once (one matmul for the
        heads, while :attr:`batch_modulations`), inside the loop, so that ``loop`` checkpointing
        recomputes them rather than keeping weight-sized terms for every loop.
        """
        if ctx.cond is not None and ctx.modulations is None and self.batch_modulations:
            ctx = ctx.at(ctx.loop, ctx.cond, layer_modulations(self.layers_at(ctx.loop), ctx.cond))
        s_tilde = self.update.inject(s, h_in)
        return self.update(s, self.run_layers(s_tilde, ctx), s_tilde)

    def run_layers(self, x: Tensor, ctx: LoopContext) -> Tensor:
        """The layers of loop ``ctx.loop`` applied to ``x`` in turn (``layer`` checkpointing recomputes each)."""
        for layer in self.layers_at(ctx.loop):
            x = run_layer(layer, x, ctx, self.checkpointing == "layer")
        return x

    def layers_at(self, loop: int) -> nn.ModuleList:
        """The layers loop ``loop`` runs: the same shared ones at every loop."""
        return self.layers


def run_layer(layer: nn.Module, x: Tensor, ctx: LoopContext, recompute: bool) -> Tensor:
    """``layer(x, ctx)``; with ``recompute`` and gradients on, its activations are recomputed in the backward pass.

    The forward pass draws no random numbers, so the RNG state is not saved for the recomputation.
    """
    if recompute and torch.is_grad_enabled():
        return checkpoint(layer, x, ctx.under_checkpoint(), use_reentrant=False, preserve_rng_state=False)
    return layer(x, ctx)


def check_loops(loops: object) -> None:
    """Refuse a loop count k that is not an integer >= 1 (a bool, a float such as ``2.0``, a string).

    Raises:
        ValueError: naming ``loops`` and what it must be.
    """
    if isinstance(loops, bool) or not isinstance(loops, numbers.Integral) or loops < 1:
        raise ValueError(f"loops={loops!r} must be an integer >= 1")


#: The ``activation_checkpointing`` settings of :meth:`LoopedLM.set_backprop`.
CHECKPOINTING = ("none", "loop", "layer")


def _modulators(conditioner: Optional[Conditioner], config: ModelConfig) -> Optional[tuple[Modulator, Modulator]]:
    if conditioner is None:
        return None
    return conditioner.make_modulator(config.d_model), conditioner.make_modulator(config.d_model)


def blocks(config: ModelConfig, block: str, conditioner: Optional[Conditioner]) -> nn.ModuleList:
    """The layers of ``block`` (``in``, ``rec``, ``out``) with their mixers from the patterns."""
    n = {"in": config.n_in, "rec": config.n_rec, "out": config.n_out}[block]
    return nn.ModuleList(
        Block(config, config.layer_index(block, j), *config.layer_mixers(block, j), _modulators(conditioner, config))
        for j in range(n)
    )


class LoopedForward(nn.Module):
    """The forward pass of a looped LM over the layers it holds (eq. 1: L_in + k L_rec + L_out layers).

    A subclass sets ``config`` (:class:`ModelConfig`), ``embed``, ``input_layers``, ``core`` (a
    module whose ``forward(h_in, ctx)`` returns ``(s_k, c_k)``), ``output_layers``, ``norm``,
    ``head`` and ``rotary`` (:class:`Rotary`).
    """

    config: ModelConfig
    rotary: Rotary

    def positions(
        self, batch: int, length: int, device: torch.device, attention_mask: Optional[Tensor], offset: int
    ) -> Positions:
        """RoPE tables, causal/padding mask and padding for ``length`` new tokens after ``offset`` cached ones."""
        end = offset + length
        if end > self.config.max_seq_len:
            raise ValueError(
                f"sequence of {end} tokens exceeds arch.max_seq_len={self.config.max_seq_len} (the RoPE "
                "table); raise arch.max_seq_len or use shorter sequences (data.seq_len)"
            )
        cos, sin = self.rotary(offset, length)
        if attention_mask is None and offset == 0:
            return Positions(cos, sin, None, True, None, offset)
        q_pos = torch.arange(offset, end, device=device)[:, None]
        k_pos = torch.arange(end, device=device)[None, :]
        mask = (k_pos <= q_pos)[None, None]
        if attention_mask is not None:
            if attention_mask.shape != (batch, end):
                raise ValueError(
                    f"attention_mask has shape {tuple(attention_mask.shape)}; expected {(batch, end)} "
                    "(cached plus new tokens)"
                )
            mask = mask & attention_mask.bool()[:, None, None, :]
            mask = mask | (k_pos == q_pos)[None, None]
            padding = attention_mask[:, offset:].bool()
            return Positions(cos, sin, mask, False, padding, offset)  # no host read of the mask
        return Positions(cos, sin, mask, False, None, offset)

    def loop_context(
        self, input_ids: Tensor, loops: int, attention_mask: Optional[Tensor] = None, cache: Optional[KVCache] = None
    ) -> LoopContext:
        """The loop context of a forward pass over ``input_ids`` at loop ``0`` (the input block)."""
        b, t = input_ids.shape
        offset = 0 if cache is None else cache.offset
        positions = self.positions(b, t, input_ids.device, attention_mask, offset)
        return LoopContext(positions, loops, self.config.max_loops, cache=cache)

    def forward(
        self,
        input_ids: Tensor,
        loops: int = 1,
        attention_mask: Optional[Tensor] = None,
        cache: Optional[KVCache] = None,
        aux_losses: Optional[MutableMapping[str, Tensor]] = None,
        passes: Optional[int] = None,
    ) -> Tensor:
        """Logits ``[B, T, vocab]`` for ``input_ids`` ``[B, T]`` at loop count ``loops``.

        A pure function of its inputs and parameters. Generation decodes a conditioned model through
        each loop's eq. 4 constants computed once per k (:func:`~elr_lightning.inference.fold.serving_model`);
        calling ``forward`` directly runs the layers as trained.

        Args:
            input_ids: Token ids.
            loops: The loop count k >= 1 (k above ``arch.max_loops`` extrapolates the budget).
            attention_mask: ``[B, T_cached + T]`` with 1 for real tokens and 0 for padding.
            cache: A cache policy for incremental decoding; its offset is advanced here.
            aux_losses: A mapping that receives the auxiliary losses the mixers added (by name). Under
                FSDP2 pass a ``collections.UserDict``: the sharded root copies a plain dict argument.
            passes: Passes of the recurrent block, >= ``loops`` (``None``: ``loops``); those after loop
                k call its layers on zero rows and change no value (``LoopContext.passes``). A
                strategy that shards each recurrent layer on its own asks for the deepest k of the
                shard's peers on the other ranks.

        Raises:
            ValueError: ``loops`` is not an integer >= 1, or ``passes`` is below it.
        """
        check_loops(loops)
        if passes is not None and (isinstance(passes, bool) or not isinstance(passes, int) or passes < loops):
            raise ValueError(f"passes={passes!r} must be an integer >= loops={loops} (or None)")
        ctx = self.loop_context(input_ids, loops, attention_mask, cache)
        ctx.passes = passes
        x = self.embed(input_ids)
        per_layer = self.core.checkpointing == "layer"
        for layer in self.input_layers:
            x = run_layer(layer, x, ctx, per_layer)
        s, c = self.core(x, ctx)
        out_ctx = ctx.at(0, c)
        for layer in self.output_layers:
            s = run_layer(layer, s, out_ctx, per_layer)
        if cache is not None:
            cache.advance(input_ids.shape[1])
        if aux_losses is not None:
            aux_losses.update(ctx.aux_losses)
        return self.head(self.norm(s))
