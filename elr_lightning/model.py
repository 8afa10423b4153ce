"""The looped language model: input block, shared recurrent block applied k times, output block."""

from __future__ import annotations

import math
from typing import Any, MutableMapping, Optional

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from typing_extensions import override

from elr_lightning.cache import KVCache
from elr_lightning.conditioning import Conditioner
from elr_lightning.config import ModelConfig
from elr_lightning.context import LoopContext, Positions
from elr_lightning.layers import Block, Modulator, Rotary
from elr_lightning.roles import Role, role_table
from elr_lightning.updates import AdaptiveDelta, NonRecurrent, StateUpdate


class RecurrentCore(nn.Module):
    """The shared block R_theta with its state update and conditioner; ``forward`` runs all k loops.

    Keeping the whole k-loop inside one module's ``forward`` lets a sharding strategy wrap it as a
    single unit, so ranks running different k issue the same collectives (DESIGN §6).
    """

    def __init__(
        self, config: ModelConfig, update: StateUpdate, conditioner: Optional[Conditioner]
    ) -> None:
        super().__init__()
        self.config = config
        self.update = update
        self.conditioner = conditioner
        self.layers = _blocks(config, "rec", conditioner)
        #: ``none``, ``loop`` or ``layer``: what the backward pass recomputes (see :meth:`LoopedLM.set_backprop`).
        self.checkpointing = "none"
        #: Backpropagate through the last this many loops only (``None``: all).
        self.backprop_loops: Optional[int] = None

    def forward(self, h_in: Tensor, ctx: LoopContext) -> tuple[Tensor, Optional[Tensor]]:
        """Run ``ctx.loops`` passes (DESIGN §2); return the final state s_k and the last context c_k.

        With gradients on, loops before the last :attr:`backprop_loops` run without a graph
        (truncated backpropagation: their state enters the later loops as a constant, while the
        injected input h_in still gets the later loops' gradients), and under ``loop``
        checkpointing each tracked loop keeps only its input state and recomputes the rest in the
        backward pass. c_k is returned as a fresh tensor, not a view, since sharding wrappers refuse
        views as outputs.
        """
        s = self.update.init(h_in)
        c = None
        tracked = torch.is_grad_enabled()
        first = 1 if self.backprop_loops is None else ctx.loops - self.backprop_loops + 1
        for i in range(1, ctx.loops + 1):
            if self.conditioner is not None:
                c = self.conditioner(i, ctx.loops, ctx.max_loops, h_in)
            loop_ctx = ctx.at(i, c)
            if tracked and i < first:
                with torch.no_grad():
                    s = self.loop(s, h_in, loop_ctx)
            elif tracked and self.checkpointing == "loop":
                s = checkpoint(self.loop, s, h_in, loop_ctx, use_reentrant=False, preserve_rng_state=False)
            else:
                s = self.loop(s, h_in, loop_ctx)
        return s, None if c is None else c.clone()

    def loop(self, s: Tensor, h_in: Tensor, ctx: LoopContext) -> Tensor:
        """One pass of loop ``ctx.loop``: inject h_in into s_{i-1}, run the layers, update to s_i."""
        s_tilde = self.update.inject(s, h_in)
        r = s_tilde
        for layer in self.layers_at(ctx.loop):
            r = run_layer(layer, r, ctx, self.checkpointing == "layer")
        return self.update(s, r, s_tilde)

    def layers_at(self, loop: int) -> nn.ModuleList:
        """The layers loop ``loop`` runs: the same shared ones at every loop."""
        return self.layers


#: Parameters registered on any module so far (a module-registration hook counts them), so
#: :meth:`LoopedLM._folded` notices replaced parameters without walking the modules per call.
_REGISTRATIONS = [0]


def _count_registration(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
    _REGISTRATIONS[0] += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration)


def run_layer(layer: nn.Module, x: Tensor, ctx: LoopContext, recompute: bool) -> Tensor:
    """``layer(x, ctx)``; with ``recompute`` and gradients on, its activations are recomputed in the backward pass.

    The forward pass draws no random numbers, so the RNG state is not saved for the recomputation.
    """
    if recompute and torch.is_grad_enabled():
        return checkpoint(layer, x, ctx, use_reentrant=False, preserve_rng_state=False)
    return layer(x, ctx)


#: The ``activation_checkpointing`` settings of :meth:`LoopedLM.set_backprop`.
CHECKPOINTING = ("none", "loop", "layer")


def _modulators(conditioner: Optional[Conditioner], config: ModelConfig) -> Optional[tuple[Modulator, Modulator]]:
    if conditioner is None:
        return None
    return conditioner.make_modulator(config.d_model), conditioner.make_modulator(config.d_model)


def _blocks(config: ModelConfig, block: str, conditioner: Optional[Conditioner]) -> nn.ModuleList:
    """The layers of ``block`` (``in``, ``rec``, ``out``) with their mixers from the patterns."""
    n = {"in": config.n_in, "rec": config.n_rec, "out": config.n_out}[block]
    return nn.ModuleList(
        Block(config, config.layer_index(block, j), *config.layer_mixers(block, j), _modulators(conditioner, config))
        for j in range(n)
    )


class LoopedLM(nn.Module):
    """A latent-recurrent LM whose compute is chosen per call by the loop count k.

    ``forward(input_ids, loops)`` runs ``D_eff(k) = L_in + k L_rec + L_out`` layers (eq. 1); at
    k = 1 every unique layer runs once.

    Args:
        config: Architecture numbers.
        update: The state-update rule; ``AdaptiveDelta()`` (eq. 2) by default.
        conditioner: Loop conditioning (eq. 4) or ``None`` for none.
    """

    def __init__(
        self,
        config: ModelConfig,
        update: Optional[StateUpdate] = None,
        conditioner: Optional[Conditioner] = None,
    ) -> None:
        super().__init__()
        self.config = config
        update = AdaptiveDelta() if update is None else update
        update.build(config.d_model)
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.input_layers = _blocks(config, "in", None)
        self.core = RecurrentCore(config, update, conditioner)
        self.output_layers = _blocks(config, "out", conditioner)
        self.norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight
        self.rotary = Rotary(config)
        self.roles: dict[str, Role] = role_table(self)
        #: Decode with a cache through weights folded per k (see :meth:`forward`); off trades speed for memory.
        self.serve_folded = True
        self._served: tuple[tuple[Any, ...], list[nn.Parameter], dict[int, nn.Module]] = ((), [], {})
        self.init_weights()

    @classmethod
    def baseline(cls, config: ModelConfig) -> "LoopedLM":
        """The non-recurrent baseline: the same layers, no state update or conditioning, run once."""
        return cls(config, update=NonRecurrent(), conditioner=None)

    def set_backprop(self, activation_checkpointing: str = "none", backprop_loops: Optional[int] = None) -> None:
        """Choose what training keeps for the backward pass; the forward's values never change.

        Args:
            activation_checkpointing: ``none`` keeps every activation (memory grows with k);
                ``loop`` keeps each loop's input state and recomputes the loop in the backward pass
                (memory nearly flat in k, about one more forward of the recurrent block); ``layer``
                keeps each layer's input, input and output layers included, and recomputes layer by
                layer (least memory).
            backprop_loops: Backpropagate through the last n loops only; earlier loops run without
                a graph (truncated backpropagation). ``None``: all loops.

        Raises:
            ValueError: an unknown setting or ``backprop_loops < 1``.
        """
        if activation_checkpointing not in CHECKPOINTING:
            raise ValueError(
                f"activation_checkpointing={activation_checkpointing!r} must be one of {CHECKPOINTING}"
            )
        if backprop_loops is not None and (not isinstance(backprop_loops, int) or backprop_loops < 1):
            raise ValueError(f"backprop_loops={backprop_loops!r} must be an integer >= 1, or null for all loops")
        self.core.checkpointing, self.core.backprop_loops = activation_checkpointing, backprop_loops

    @property
    def update(self) -> StateUpdate:
        """The state-update rule."""
        return self.core.update

    @property
    def conditioner(self) -> Optional[Conditioner]:
        """The conditioner, or ``None``."""
        return self.core.conditioner

    def parameters_with_role(self, group: Optional[str] = None, init: Optional[str] = None) -> list[nn.Parameter]:
        """Parameters whose recorded role matches ``group`` and ``init`` (``None`` matches any).

        Roles are looked up by name in :attr:`roles`, so this holds after wrapping or sharding.
        """
        return [
            p
            for name, p in self.named_parameters()
            if (group is None or self.roles[name][1] == group) and (init is None or self.roles[name][0] == init)
        ]

    @override
    def to_empty(self, *, device: Optional[torch.device | str], recurse: bool = True) -> "LoopedLM":
        """Move to ``device`` with uninitialised memory (then call :meth:`init_weights`), keeping the head tied.

        ``nn.Module.to_empty`` gives a plain meta parameter a new object per module, which would
        untie ``head.weight`` from ``embed.weight`` (FSDP2's DTensor parameters keep theirs).
        """
        super().to_empty(device=device, recurse=recurse)
        if self.config.tie_embeddings:
            self.head.weight = self.embed.weight
        return self

    @torch.no_grad()
    def init_weights(self) -> None:
        """Every initialisation decision of the model, in one place.

        1. Embedding and every linear weight: normal(0, ``init_std``); biases: zero.
        2. Residual-branch output projections (attention ``o``, MLP ``down``; tagged
           ``scaled_normal``): normal(0, ``init_std / sqrt(2 D_eff(1))``), so the residual stream's
           variance at init does not grow with depth.
        3. RMSNorm weights: one.
        4. Parameters tagged ``module`` by their seam: the owning module's ``init_parameter``
           (e.g. the decay rates of a linear-attention mixer).
        5. Parameters tagged ``zeros`` by their seam: zero. These are the adaptive-delta gate
           ``W_beta, b_beta, gamma`` (beta starts at 0.5 ln 2, eq. 2) and every conditioning head
           (lambda, mu, g, omega), so a modulated layer equals the plain one exactly (eq. 4).
           The adapter matrices A, B stay normal so the zero-init gate g still receives gradient.
        6. Buffers derived from the config (RoPE tables, conditioning frequencies and flag, scratch):
           recomputed by every submodule's ``reset_buffers()``.

        Tags are read from the role table :attr:`roles`, by name, so this also initialises a model
        built on the meta device, sharded with FSDP2 and materialised with ``to_empty``
        (parameters may be DTensors).

        Raises:
            ValueError: if some parameter got no decision.
        """
        cfg = self.config
        scaled_std = cfg.init_std / math.sqrt(2 * cfg.effective_depth(1))
        decided: set[int] = set()
        for prefix, module in self.named_modules():
            for name, p in module.named_parameters(recurse=False):
                if id(p) in decided:
                    continue
                tag = self.roles[f"{prefix}.{name}" if prefix else name][0]
                if tag == "module":
                    module.init_parameter(name, p)
                elif tag == "zeros":
                    nn.init.zeros_(p)
                elif tag == "ones" or isinstance(module, nn.RMSNorm):
                    nn.init.ones_(p)
                elif tag == "scaled_normal":
                    nn.init.normal_(p, std=scaled_std)
                elif name == "bias":
                    nn.init.zeros_(p)
                elif tag == "normal" or isinstance(module, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(p, std=cfg.init_std)
                else:
                    continue
                decided.add(id(p))
            if callable(reset_buffers := getattr(module, "reset_buffers", None)):
                reset_buffers()
        missing = [n for n, p in self.named_parameters() if id(p) not in decided]
        if missing:
            raise ValueError(f"init_weights has no decision for parameters {missing}; tag them with set_role")

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
    ) -> Tensor:
        """Logits ``[B, T, vocab]`` for ``input_ids`` ``[B, T]`` at loop count ``loops``.

        Args:
            input_ids: Token ids.
            loops: The loop count k >= 1 (k above ``arch.max_loops`` extrapolates the budget).
            attention_mask: ``[B, T_cached + T]`` with 1 for real tokens and 0 for padding.
            cache: A cache policy for incremental decoding; its offset is advanced here.
            aux_losses: A mapping that receives the auxiliary losses the mixers added (by name). Under
                FSDP2 pass a ``collections.UserDict``: the sharded root copies a plain dict argument.

        Incremental decoding (a ``cache``, gradients off) with active conditioning runs through
        :func:`~elr_lightning.fold.fold_conditioning`'s folded layers for ``loops``, built on the first
        such call and kept while no parameter changes (their version counters are compared; no
        device read): decoding then costs what the unconditioned model costs, and holds the recurrent
        layers once per loop of every k served. Set :attr:`serve_folded` to False to decode unfolded.
        """
        if loops < 1:
            raise ValueError(f"loops={loops} must be >= 1")
        if (
            cache is not None
            and self.serve_folded
            and self.conditioner is not None
            and self.conditioner.active
            and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
        ):
            return self._folded(loops)(input_ids, loops, attention_mask, cache, aux_losses)
        return self.run(input_ids, loops, attention_mask, cache, aux_losses)

    def _folded(self, loops: int) -> nn.Module:
        """The folded model for ``loops``, rebuilt after any parameter changed (in place or replaced).

        The parameters are listed once per build (walking the modules costs more than a decode
        step's Python); a parameter registered anywhere since (``_REGISTRATIONS``) lists them again.
        """
        from elr_lightning.fold import fold_conditioning  # fold builds on this module

        key, params, served = self._served
        if key and key[0] == _REGISTRATIONS[0]:
            current = (_REGISTRATIONS[0], *((id(p), p.data_ptr(), p._version) for p in params))
        else:
            params = list(self.parameters())
            current = (_REGISTRATIONS[0], *((id(p), p.data_ptr(), p._version) for p in params))
        if current != key:
            served = {}
        if loops not in served:
            served[loops] = fold_conditioning(self, loops)
            current = (_REGISTRATIONS[0], *current[1:])  # the fold registered its own (new) parameters
        self._served = (current, params, served)
        return served[loops]

    def run(
        self,
        input_ids: Tensor,
        loops: int = 1,
        attention_mask: Optional[Tensor] = None,
        cache: Optional[KVCache] = None,
        aux_losses: Optional[MutableMapping[str, Tensor]] = None,
    ) -> Tensor:
        """The forward pass of :meth:`forward` over this model's own layers (never the folded ones)."""
        if loops < 1:
            raise ValueError(f"loops={loops} must be >= 1")
        ctx = self.loop_context(input_ids, loops, attention_mask, cache)
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
