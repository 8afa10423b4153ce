"""A layer of the three blocks: a token mixer and a channel mixer, each pre-norm and optionally modulated."""

from __future__ import annotations

from typing import Optional

import torch.nn.functional as F
from torch import Tensor, nn

from elr_lightning.config import ModelConfig
from elr_lightning.context import LoopContext
from elr_lightning.mixers import ChannelMixer, Modulation, TokenMixer
from elr_lightning.mixers.base import _Mixer

__all__ = ["Block", "Modulator"]


class Modulator(nn.Module):
    """Seam contract for the per-sublayer modulation of eq. (4), built by a :class:`Conditioner`.

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

    def pre(self, h: Tensor, c: Tensor) -> Tensor:
        """Modulate the normalised sublayer input (FiLM and low-rank adapter in eq. 4)."""
        raise NotImplementedError

    def post(self, y: Tensor, c: Tensor) -> Tensor:
        """Modulate the sublayer output before the residual add (exit gate in eq. 4)."""
        raise NotImplementedError

    def affine(self, c: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The modulation under a fixed context as ``(M, m, gate)``, computed in ``c``'s dtype.

        ``pre(h, c) = h @ M.T + m`` and ``post(y, c) = gate * y``. Optional: a modulator that is
        affine in ``h`` implements it so :func:`elr_lightning.serving.fold_conditioning` can fold it
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
        """Apply the layer at ``ctx``'s loop; ``ctx.cond`` is c_i, or ``None`` for the plain layer."""
        x = x + self._sublayer(x, self.attn_norm, self.attn, self.attn_mod, ctx)
        return x + self._sublayer(x, self.mlp_norm, self.mlp, self.mlp_mod, ctx)

    def _sublayer(
        self, x: Tensor, norm: nn.RMSNorm, mixer: _Mixer, mod: Optional[Modulator], ctx: LoopContext
    ) -> Tensor:
        """The residual branch ``f(norm(x))``, modulated under ``ctx.cond`` (eq. 4).

        The reference form applies the modulator's ``pre`` and ``post`` to the activations, as eq. 4
        reads. The fast form (while :attr:`fold_conditioning`, the default) folds a modulator with a
        :meth:`Modulator.modulation`: its scale into the norm's weight and its shift added in place to
        the norm's output, the adapter and gate by the mixer
        (:meth:`~elr_lightning.mixers.TokenMixer.modulated`). Both compute the same function
        (``tests/test_eq4_forms.py``).
        """
        c = ctx.cond
        if c is None or mod is None:
            return mixer(norm(x), ctx, self.index)
        if not self.fold_conditioning:
            return mod.post(mixer(mod.pre(norm(x), c), ctx, self.index), c)  # eq. 4 as the paper writes it
        try:
            scale, shift, terms = mod.modulation(c)
        except NotImplementedError:
            return mod.post(mixer(mod.pre(norm(x), c), ctx, self.index), c)
        weight = scale if norm.weight is None else norm.weight * scale
        h = F.rms_norm(x, norm.normalized_shape, weight, norm.eps)
        # In place: the norm's backward reads its input and weight, never its output. An addcmul here
        # costs a slower three-operand pass and, in the backward, one more pass to scale by its value.
        return mixer.modulated(h.add_(shift.to(h.dtype)), ctx, self.index, terms)
