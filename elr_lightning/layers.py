"""A layer of the three blocks: a token mixer and a channel mixer, each pre-norm and optionally modulated."""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch.nn.functional as F
from torch import Tensor, nn

from elr_lightning.config import ModelConfig
from elr_lightning.context import LoopContext
from elr_lightning.mixers import ChannelMixer, Modulation, TokenMixer
from elr_lightning.mixers.base import _Mixer

__all__ = ["Block", "Modulator", "layer_modulations"]

#: Eq. (4)'s terms of one sublayer under a context c_i: ``(scale, shift, terms)`` (see :meth:`Modulator.modulation`).
Terms = tuple[Tensor, Tensor, Modulation]


class Modulator(nn.Module):
    """Seam contract for the per-sublayer modulation of eq. (4), built by a
    :class:`~elr_lightning.conditioning.Conditioner`.

    A pre-norm sublayer ``y = x + f(RMSNorm(x))`` becomes, with a context ``c``::

        h = RMSNorm(x); h = modulator.pre(h, c); y = x + modulator.post(f(h), c)

    With all heads at their zero init, ``pre`` and ``post`` must return their input bit for bit,
    so inserting a modulator never changes a trained model's function.

    ``pre`` and ``post`` define the function. A modulator whose ``pre`` is ``P (s * h + m)`` for a
    scale ``s``, shift ``m`` and ``P = I + U D`` of low rank, and whose ``post`` is a gate, may also
    implements :meth:`modulation`; the layer then folds it into the sublayer's weights per loop
    (:meth:`~elr_lightning.mixers.TokenMixer.modulated`) and runs as many passes over the
    activations as a plain layer.
    """

    def modulation(self, c: Tensor) -> tuple[Tensor, Tensor, Modulation]:
        """``(s, m, terms)``: the FiLM scale ``s`` and shift ``m`` ``[d]``, applied with the norm, and the rest.

        Optional; without it the layer applies :meth:`pre` and :meth:`post` to the activations.
        """
        raise NotImplementedError

    @classmethod
    def modulations(cls, modulators: Sequence["Modulator"], c: Tensor) -> list[Terms]:
        """:meth:`modulation` of each of ``modulators`` (instances of ``cls``) under one context ``c``.

        The model asks once per loop for all the sublayers it runs under ``c``, so a class may
        compute their heads together (one matmul for all); the result must equal the calls one by
        one. Raises ``NotImplementedError`` where :meth:`modulation` does.
        """
        return [mod.modulation(c) for mod in modulators]

    def pre(self, h: Tensor, c: Tensor) -> Tensor:
        """Modulate the normalised sublayer input (FiLM and low-rank adapter in eq. 4)."""
        raise NotImplementedError

    def post(self, y: Tensor, c: Tensor) -> Tensor:
        """Modulate the sublayer output before the residual add (exit gate in eq. 4)."""
        raise NotImplementedError

    def affine(self, c: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The modulation under a fixed context as ``(M, m, gate)``, computed in ``c``'s dtype.

        ``pre(h, c) = h @ M.T + m`` and ``post(y, c) = gate * y``. Optional: a modulator that is
        affine in ``h`` implements it so :func:`elr_lightning.inference.fold.fold_conditioning` can fold it
        into the sublayer's linear maps for serving at a fixed k.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement affine(); it cannot be folded")


class Block(nn.Module):
    """One pre-norm layer: ``x + T(norm(x))`` then ``x + C(norm(x))`` (DESIGN §3).

    The token mixer ``T`` and channel mixer ``C`` are built from ``arch`` by name (see
    :meth:`~elr_lightning.config.ModelConfig.layer_mixers`). Recurrent and output layers carry two
    :class:`Modulator` s that apply the loop context c_i (eq. 4) around each mixer. The attribute
    names ``attn`` / ``mlp`` (and their norms and modulators) are the state-dict names of every
    checkpoint, whatever the mixers are.

    Args:
        config: The architecture.
        index: This layer's number in the stack (:meth:`~elr_lightning.config.ModelConfig.layer_index`).
        token: Pattern entry of the token mixer (``None``: that of input layer 0).
        channel: Pattern entry of the channel mixer (``None``: that of input layer 0).
        modulators: ``(token mixer's, channel mixer's)`` modulators, or ``None`` for a plain layer.
    """

    def __init__(
        self,
        config: ModelConfig,
        index: int = 0,
        token: Optional[str] = None,
        channel: Optional[str] = None,
        modulators: Optional[tuple[Modulator, Modulator]] = None,
    ) -> None:
        super().__init__()
        self.index = index
        self.attn_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        default_token, default_channel = config.layer_mixers("in", 0)
        self.attn: TokenMixer = config.build_mixer(token or default_token)
        self.mlp_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.mlp: ChannelMixer = config.build_mixer(channel or default_channel)
        self.attn_mod, self.mlp_mod = modulators if modulators is not None else (None, None)
        #: Fold eq. 4 into the weights per loop (fast) instead of the reference form on the activations.
        self.fold_conditioning = True

    def forward(self, x: Tensor, ctx: LoopContext) -> Tensor:
        """Apply the layer at ``ctx``'s loop; ``ctx.cond`` is c_i, or ``None`` for the plain layer.

        The folded form reads its eq. (4) terms from ``ctx.modulations`` where the caller computed
        them for all its layers at once (:func:`layer_modulations`), else computes its own two.
        """
        attn, mlp = None, None
        if ctx.cond is not None and self.attn_mod is not None and self.fold_conditioning:
            mods = ctx.modulations if ctx.modulations is not None and self.index in ctx.modulations else None
            attn, mlp = (mods or layer_modulations([self], ctx.cond))[self.index]
        x = x + self._sublayer(x, self.attn_norm, self.attn, self.attn_mod, attn, ctx)
        return x + self._sublayer(x, self.mlp_norm, self.mlp, self.mlp_mod, mlp, ctx)

    def _sublayer(
        self,
        x: Tensor,
        norm: nn.RMSNorm,
        mixer: _Mixer,
        mod: Optional[Modulator],
        terms: Optional[Terms],
        ctx: LoopContext,
    ) -> Tensor:
        """The residual branch ``f(norm(x))``, modulated under ``ctx.cond`` (eq. 4).

        The reference form applies the modulator's ``pre`` and ``post`` to the activations, as eq. 4
        reads; it runs where ``terms`` is ``None``. The fast form (while :attr:`fold_conditioning`, the
        default, for a modulator with a :meth:`Modulator.modulation`) folds the modulator's ``terms``:
        its scale into the norm's weight and its shift added in place to the norm's output, the
        adapter and gate by the mixer (:meth:`~elr_lightning.mixers.TokenMixer.modulated`). Both
        compute the same function (``tests/test_eq4_forms.py``).
        """
        c = ctx.cond
        if c is None or mod is None:
            return mixer(norm(x), ctx, self.index)
        if terms is None:
            return mod.post(mixer(mod.pre(norm(x), c), ctx, self.index), c)  # eq. 4 as the paper writes it
        scale, shift, terms = terms
        weight = scale if norm.weight is None else norm.weight * scale
        h = F.rms_norm(x, norm.normalized_shape, weight, norm.eps)
        # In place: the norm's backward reads its input and weight, never its output. An addcmul here
        # costs a slower three-operand pass and, in the backward, one more pass to scale by its value.
        return mixer.modulated(h.add_(shift.to(h.dtype)), ctx, self.index, terms)


def layer_modulations(layers: Iterable[Block], c: Tensor) -> dict[int, tuple[Optional[Terms], Optional[Terms]]]:
    """Eq. (4)'s terms of every folded, modulated sublayer of ``layers`` under one context ``c``, by layer index.

    Each entry is ``(token mixer's, channel mixer's)`` terms, ``None`` for a modulator without
    :meth:`Modulator.modulation` (that sublayer runs the reference form). Layers in the reference
    form, and plain layers, get no entry. Modulators of one class are asked together
    (:meth:`Modulator.modulations`), so a class can compute all its heads in one matmul.
    """
    folded = [layer for layer in layers if layer.attn_mod is not None and layer.fold_conditioning]
    mods = [mod for layer in folded for mod in (layer.attn_mod, layer.mlp_mod)]
    terms: list[Optional[Terms]] = [None] * len(mods)
    classes: list[type[Modulator]] = []
    for mod in mods:
        if type(mod) not in classes:
            classes.append(type(mod))
    for cls in classes:
        index = [i for i, mod in enumerate(mods) if type(mod) is cls]
        try:
            for i, term in zip(index, cls.modulations([mods[i] for i in index], c)):
                terms[i] = term
        except NotImplementedError:
            continue
    return {layer.index: (terms[2 * j], terms[2 * j + 1]) for j, layer in enumerate(folded)}
