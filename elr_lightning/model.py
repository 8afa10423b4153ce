"""The looped language model: input block, shared recurrent block applied k times, output block."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Optional

import torch
from torch import Tensor, nn
from typing_extensions import override

from elr_lightning.conditioning import Conditioner
from elr_lightning.config import ModelConfig
from elr_lightning.core import CHECKPOINTING, LoopedForward, RecurrentCore, blocks
from elr_lightning.mixers import Rotary
from elr_lightning.roles import Role, role_table
from elr_lightning.updates import AdaptiveDelta, NonRecurrent, StateUpdate

class LoopedLM(LoopedForward):
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
        self.input_layers = blocks(config, "in", None)
        self.core = RecurrentCore(config, update, conditioner)
        self.output_layers = blocks(config, "out", conditioner)
        self.norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight
        self.rotary = Rotary(config)
        self.roles: dict[str, Role] = role_table(self)
        #: Whether generation decodes through weights folded per k (:func:`~elr_lightning.inference.fold.serving_model`)
        #: when conditioning is active; False decodes unfolded (less memory, slower). ``forward`` never reads it.
        self.serve_folded = True
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
        if backprop_loops is not None and (
            isinstance(backprop_loops, bool) or not isinstance(backprop_loops, int) or backprop_loops < 1
        ):
            raise ValueError(f"backprop_loops={backprop_loops!r} must be an integer >= 1, or null for all loops")
        self.core.checkpointing, self.core.backprop_loops = activation_checkpointing, backprop_loops

    def set_conditioning_form(self, folded: bool = True) -> None:
        """Run eq. 4 folded into the weights per loop (``True``, fast) or as the paper writes it on the activations.

        The two forms compute the same function and gradients (to round-off); the reference form
        is the one to read and to test a new fast form against.
        """
        for block in [*self.core.layers, *self.output_layers]:
            block.fold_conditioning = bool(folded)

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
    def assign_weights(self, state: Mapping[str, Tensor]) -> None:
        """Take ``state``'s tensors as parameters and initialise the rest, on a model built on the meta device.

        The tensors are assigned, not copied (``load_state_dict(assign=True)``), so memory holds one
        copy of them, in their own dtype; every parameter that ``state`` lacks is allocated on the
        CPU and gets its :meth:`init_weights` decision, and every buffer is recomputed. ``elr
        retrofit`` builds a model from a Hugging Face checkpoint this way.

        Raises:
            ValueError: ``state`` has a key the model does not.
        """
        for module in self.modules():  # buffers first: the state-dict load hooks read them
            for name, b in list(module._buffers.items()):
                if b is not None and b.is_meta:
                    module._buffers[name] = torch.empty_like(b, device="cpu")
            if callable(reset_buffers := getattr(module, "reset_buffers", None)):
                reset_buffers()
        unexpected = self.load_state_dict(state, strict=False, assign=True).unexpected_keys
        if unexpected:
            raise ValueError(f"assign_weights: the model has no parameters {unexpected[:3]}")
        self.init_weights(only_meta=True)

    def _materialize_meta(self) -> set[int]:
        """Allocate every meta parameter and buffer on the CPU (uninitialised, ties kept); the new parameters' ids."""
        fresh: dict[int, nn.Parameter] = {}
        for module in self.modules():
            for name, p in list(module._parameters.items()):
                if p is not None and p.is_meta:
                    if id(p) not in fresh:
                        fresh[id(p)] = nn.Parameter(torch.empty_like(p, device="cpu"), p.requires_grad)
                    module._parameters[name] = fresh[id(p)]
            for name, b in list(module._buffers.items()):
                if b is not None and b.is_meta:
                    module._buffers[name] = torch.empty_like(b, device="cpu")
        if self.config.tie_embeddings:
            self.head.weight = self.embed.weight
        return {id(p) for p in fresh.values()}

    @torch.no_grad()
    def init_weights(self, only_meta: bool = False) -> None:
        """Every initialisation decision of the model, in one place.

        1. Embedding and every linear weight: normal(0, ``init_std``); biases: zero.
        2. Residual-branch output projections (attention ``o``, MLP ``down``; tagged
           ``scaled_normal``): normal(0, ``init_std / sqrt(2 D_eff(1))``), so the residual stream's
           variance at init does not grow with depth.
        3. RMSNorm weights: one.
        4. Parameters tagged ``module`` by their seam: the owning module's ``init_parameter``
           (e.g. the decay rates of a linear-attention mixer, and the adaptive-delta ``gamma``, set so
           that beta starts at the rule's ``initial_step``, 0.5 ln 2 by default, eq. 2).
        5. Parameters tagged ``zeros`` by their seam: zero. These are the adaptive-delta gate
           ``W_beta, b_beta`` and every conditioning head
           (lambda, mu, g, omega), so a modulated layer equals the plain one exactly (eq. 4).
           The adapter matrices A, B stay normal so the zero-init gate g still receives gradient.
        6. Buffers derived from the config (RoPE tables, conditioning frequencies and flag, scratch):
           recomputed by every submodule's ``reset_buffers()``.

        Tags are read from the role table :attr:`roles`, by name, so this also initialises a model
        built on the meta device, sharded with FSDP2 and materialised with ``to_empty``
        (parameters may be DTensors).

        Args:
            only_meta: Initialise only the parameters still on the meta device, allocated on the CPU
                first (with the meta buffers), and keep every other parameter's value: for a model
                built on the meta device that took its other weights with ``load_state_dict(...,
                assign=True)`` (``elr retrofit``).

        Raises:
            ValueError: if some parameter got no decision.
        """
        cfg = self.config
        scaled_std = cfg.init_std / math.sqrt(2 * cfg.effective_depth(1))
        fresh = self._materialize_meta() if only_meta else None
        decided: set[int] = set()
        for prefix, module in self.named_modules():
            for name, p in module.named_parameters(recurse=False):
                if fresh is not None and id(p) not in fresh:
                    decided.add(id(p))
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
