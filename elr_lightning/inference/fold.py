"""Serving at a fixed loop count k: eq. (4)'s conditioning as constants of each loop.

At a fixed k the context c_i = MLP([phi(i / k); phi(k / K)]) of loop i depends on ``(i, k, K)``
alone, so every modulated sublayer's FiLM scale and shift, adapter ``A diag(g(c_i))`` and exit gate
are constants of the loop. A :class:`FoldedLM` runs the model at that k over per-loop layers, in one
of two forms:

* :func:`conditioned_at` (what generation decodes with, through :func:`serving_model`): the layers'
  own weights, shared, with each loop's constants computed once (:class:`ConditionedBlock`);
* :func:`fold_conditioning` (for exporters): the constants folded into copies of the weights, as
  plain unmodulated blocks.

**Weight folding.** With ``A = up.weight`` ``[d, r]``, ``B = down.weight`` ``[r, d]``, ``g = g(c_i)``
and ``(lambda, mu) = film(c_i)``, the pre-map of eq. (4) is affine,

    x^ = M h + m,   M = (I + A diag(g) B) diag(1 + lambda),   m = (I + A diag(g) B) mu,

so each mixer's input linear maps ``W`` (attention ``q`` and ``kv``, MLP ``up``; a mixer names
them in ``fold_inputs``) become ``W M`` with the bias ``W m``, and the exit gate
``(1 + omega) * (W_o y)`` becomes ``diag(1 + omega) W_o`` (attention ``o``, MLP ``down``; its
``fold_outputs``). Each mixer folds itself (:meth:`~elr_lightning.mixers.TokenMixer.folded`). The
folded layers are unmodulated :class:`~elr_lightning.layers.Block` s, so a folded model runs the op
sequence of the non-recurrent baseline plus the state update. (Training folds the conditioning per
loop inside the autograd graph instead: :meth:`~elr_lightning.mixers.TokenMixer.modulated`.)

**Constants with shared weights.** :class:`ConditionedBlock` runs per sublayer the FiLM scale, the
adapter with the shift as two thin matmuls, the normalization, and the gate in the residual add.
On the CPU the norm's per-token scalar is taken after the pre-map, which runs fewer dispatched ops
than ``rms_norm`` itself there, so a conditioned sublayer costs about what a plain one does.
Decoding then runs no conditioner and holds the recurrent weights once. Folded copies need no
extra op but hold the recurrent weights k times, and a decode step reads them all: on the CPU we
measure, an unconditioned model with its recurrent layers copied per loop decoded 1.21x slower at
k = 4 than with them shared, with the same ops. So :func:`serving_model` folds into copies at
k = 1 only, where the copy replaces the original in what a step reads.

Generation calls :func:`serving_model` once per call (prefill and decode steps), never per token,
and it builds the constants anew each time: nothing is kept across calls, so a generation always
decodes the weights as they are, however they were changed in between (an optimizer step, a
replaced parameter, ``p.data`` edits and EMA swaps that no version counter sees,
``load_state_dict``). Building costs about one decode step per call (``bench/generate.py``,
``build_ms``). To decode many generations from unchanged weights without it, build the runner
once (``runner = serving_model(model, k)``) and pass it to ``generate``: it is a snapshot of the
constants, so build it again after any change of the weights."""

from __future__ import annotations

import copy
import math
import warnings
import weakref
from typing import TYPE_CHECKING, Any, MutableMapping, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

from elr_lightning.inference.cache import KVCache
from elr_lightning.config import ModelConfig
from elr_lightning.context import LoopContext
from elr_lightning.core import LoopedForward, RecurrentCore, check_loops
from elr_lightning.layers import Block, Modulator

if TYPE_CHECKING:  # the model module does not import this one
    from elr_lightning.model import LoopedLM

__all__ = ["ConditionedBlock", "FoldedLM", "conditioned_at", "fold_conditioning", "serving_model", "split_constants"]


class _FoldedCore(nn.Module):
    """The recurrent core with one list of layers per loop, its context fixed, and no conditioner."""

    #: The same k-loop as the source core (DESIGN §2), over :meth:`layers_at`.
    forward = RecurrentCore.forward
    loop = RecurrentCore.loop
    run_layers = RecurrentCore.run_layers
    tracked_loops = RecurrentCore.tracked_loops

    def __init__(self, source: RecurrentCore, per_loop: list[list[nn.Module]]) -> None:
        super().__init__()
        self.config, self.update = source.config, source.update
        self.conditioner = None
        self.checkpointing, self.backprop_loops = "none", None
        self.per_loop = nn.ModuleList(nn.ModuleList(layers) for layers in per_loop)

    def layers_at(self, loop: int) -> nn.ModuleList:
        """The layers of loop ``loop``, under its context."""
        return self.per_loop[loop - 1]


class FoldedLM(LoopedForward):
    """An inference-only :class:`LoopedLM` at one loop count k, its conditioning fixed for that k.

    ``forward(input_ids, loops, attention_mask, cache)`` is :meth:`LoopedLM.forward` at
    ``loops == k`` over the given layers: the same state update, injection and cache slots
    ``(layer, loop)``. The embedding, input layers, final norm, head and RoPE tables are the
    source's own modules, shared, not copied. :func:`fold_conditioning` builds one from plain
    blocks with the conditioning folded into copies of their weights;
    :func:`serving_model` from blocks that share the source's weights and
    hold each loop's modulation constants.

    Args:
        source: The model to serve.
        loops: The loop count k it is built for.
        recurrent_layers: One list of ``n_rec`` layers ``layer(x, ctx)`` per loop ``1..k``, each under
            that loop's context.
        output_layers: The ``n_out`` output layers (under c_k).
    """

    def __init__(
        self,
        source: LoopedLM,
        loops: int,
        recurrent_layers: list[list[nn.Module]],
        output_layers: list[nn.Module],
    ) -> None:
        super().__init__()
        self.config: ModelConfig = source.config
        self.loops = loops
        self.embed = source.embed
        self.input_layers = source.input_layers
        self.core = _FoldedCore(source.core, recurrent_layers)
        self.output_layers = nn.ModuleList(output_layers)
        self.norm = source.norm
        self.head = source.head
        self.rotary = source.rotary

    @override
    def forward(
        self,
        input_ids: Tensor,
        loops: int,
        attention_mask: Optional[Tensor] = None,
        cache: Optional[KVCache] = None,
        aux_losses: Optional[MutableMapping[str, Tensor]] = None,
    ) -> Tensor:
        """Logits ``[B, T, vocab]``, as :meth:`LoopedLM.forward` at ``loops`` (which must be k).

        Raises:
            ValueError: ``loops`` is not the loop count this model was folded for.
        """
        if loops != self.loops:
            raise ValueError(f"this model is folded for loops={self.loops}, called with loops={loops}; fold again")
        return super().forward(input_ids, loops, attention_mask, cache, aux_losses)


def _fold_block(block: Block, c: Tensor) -> Block:
    """An unmodulated copy of ``block`` computing it under the context ``c``; the mixers fold themselves."""
    folded = copy.copy(block)
    folded._modules = {name: copy.deepcopy(block._modules[name]) for name in ("attn_norm", "mlp_norm")}
    folded.attn = block.attn.folded(*block.attn_mod.affine(c))
    folded.mlp = block.mlp.folded(*block.mlp_mod.affine(c))
    folded.attn_mod, folded.mlp_mod = None, None
    return folded.requires_grad_(False).eval()


@torch.no_grad()
def fold_conditioning(model: LoopedLM, loops: int) -> FoldedLM:
    """Fold ``model``'s loop conditioning (eq. 4) into its linear maps, for serving at ``loops``.

    Each recurrent layer gets one folded copy per loop i = 1..k (under c_i) and each output layer
    one (under c_k); input layers are unmodulated and shared. Folding runs in float64 and casts to
    the weights' dtype; each modulator supplies its affine form (``Modulator.affine``). Without a conditioner, or with an inactive one, there is
    nothing to fold: the result shares the source's layers, once for every loop.

    Memory: the recurrent weights are held k times, so the result's layer weights are
    ``D_eff(k) / D_eff(1)`` (eq. 1) of the source's; it shares the embedding, head and input layers
    with the source, which stays alive beside it. A serving trade-off for one fixed k; fold again
    for another k.

    Args:
        model: The trained model (left unchanged).
        loops: The loop count k >= 1 to serve at.

    Returns:
        An inference-only :class:`FoldedLM` that accepts ``loops == k`` only.

    Raises:
        ValueError: ``loops`` is not an integer >= 1.
        NotImplementedError: A modulator does not implement ``affine``.
    """
    check_loops(loops)
    config, conditioner = model.config, model.conditioner
    like = model.embed.weight

    def fold(blocks: nn.ModuleList, c: Optional[Tensor]) -> list[Block]:
        if c is None:
            return list(blocks)
        return [_fold_block(block, c.double()) for block in blocks]

    contexts = [
        None if conditioner is None else conditioner(i, loops, config.max_loops, like) for i in range(1, loops + 1)
    ]
    recurrent = [fold(model.core.layers, c) for c in contexts]
    folded = FoldedLM(model, loops, recurrent, fold(model.output_layers, contexts[-1]))
    folded.training = False  # the folded copies are in eval mode; the shared modules keep the source's mode
    return folded


#: One sublayer's eq. (4) operands in one of :class:`ConditionedBlock`'s forms (tensors, and the norm's eps).
_Constants = tuple[Any, ...]


def _fused_norm(device: torch.device) -> bool:
    """Whether :class:`ConditionedBlock` runs its fused form on ``device`` by default: where ``rms_norm`` is one op.

    On the CPU ``rms_norm`` dispatches about eight ops (``pow``, ``mean``, ``rsqrt``, ...).
    """
    return device.type != "cpu"


def _modulation(norm: nn.RMSNorm, mod: Modulator, c: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(w s, m, A g, B, gate)`` of eq. (4) for one sublayer under ``c``; a missing adapter as rank 0."""
    try:
        scale, shift, terms = mod.modulation(c)
    except NotImplementedError as err:
        raise NotImplementedError(
            f"{type(mod).__name__} does not implement modulation(); its conditioning has no constant form"
        ) from err
    weight = scale if norm.weight is None else norm.weight * scale
    d = weight.shape[-1]
    up = torch.zeros(d, 0, dtype=weight.dtype, device=weight.device) if terms.up is None else terms.up
    down = torch.zeros(0, d, dtype=weight.dtype, device=weight.device) if terms.down is None else terms.down
    return weight, shift, up, down, terms.gate


def _fused_constants(norm: nn.RMSNorm, mod: Modulator, c: Tensor) -> _Constants:
    """``(weight, eps, one, down, up, gate)``: eq. (4) for one sublayer after a fused ``rms_norm``.

    ``P (w s * rms(x) + m) = h + (A g)(B h) + P m`` with ``h = w s * rms(x)``: the shift ``P m``
    rides the adapter's products as one more rank whose input is the constant 1, so the sublayer
    runs ``rms_norm`` with the weight ``w s``, then ``t = [0.., 1] + [B; 0] h`` and
    ``h + [A g | P m] t``: two thin products and no other pass. ``down`` is ``[r + 1, d]`` and
    ``up`` ``[d, r + 1]``, both contiguous (matrix-vector products read them row by row).
    """
    weight, shift, up, down, gate = _modulation(norm, mod, c)
    p_shift = shift + up @ (down @ shift)
    one = torch.zeros(up.shape[1] + 1, dtype=weight.dtype, device=weight.device)
    one[-1] = 1.0
    down = torch.cat((down, torch.zeros_like(weight)[None]), dim=0).contiguous()
    up = torch.cat((up, p_shift[:, None]), dim=1).contiguous()
    return weight, norm.eps, one, down, up, gate


def _fused_residual(x: Tensor, mixer: nn.Module, consts: _Constants, ctx: LoopContext, layer: int) -> Tensor:
    """``x + gate * mixer(P (w s * rms(x) + m))`` from :func:`_fused_constants`' operands (eq. 4)."""
    weight, eps, one, down, up, gate = consts
    h = F.rms_norm(x, weight.shape, weight, eps)
    if h.numel() == h.shape[-1]:  # one token of one sequence: matrix-vector products dispatch faster
        v = h.view(-1)
        h = torch.addmv(v, up, torch.addmv(one, down, v)).view_as(h)
    else:
        flat = h.view(-1, h.shape[-1])
        h = torch.addmm(flat, torch.addmm(one, flat, down.T), up.T).view_as(h)
    return torch.addcmul(x, mixer(h, ctx, layer), gate)


def split_constants(norm: nn.RMSNorm, mod: Modulator, c: Tensor) -> tuple[Tensor, ...]:
    """``(u, down, up, shift, root_eps, gate)``: eq. (4) for one sublayer with the norm's scalar taken last.

    ``rms(x) = x / sqrt(mean(x^2) + eps)`` scales each token by one number, so it commutes with the
    linear pre-map: ``P (w s * rms(x) + m) = (u * x + (A g)(B diag(u) x)) / hypot(||x||, sqrt(d eps)) + P m``
    with ``u = sqrt(d) w s``. The sublayer then runs the FiLM scale, the adapter and the
    normalization as six small ops (a product, two thin products, a norm, ``hypot`` and ``addcdiv``).
    """
    weight, shift, up, down, gate = _modulation(norm, mod, c)
    d = weight.shape[-1]
    eps = torch.finfo(weight.dtype).eps if norm.eps is None else norm.eps
    u = weight * math.sqrt(d)
    p_shift = shift + up @ (down @ shift)
    root_eps = torch.tensor(math.sqrt(d * eps), dtype=weight.dtype, device=weight.device)
    return u, (down * u).contiguous(), up.contiguous(), p_shift, root_eps, gate


def _split_residual(x: Tensor, mixer: nn.Module, consts: _Constants, ctx: LoopContext, layer: int) -> Tensor:
    """``x + gate * mixer(P (w s * rms(x) + m))`` from :func:`split_constants`' operands (eq. 4)."""
    u, down, up, shift, root_eps, gate = consts
    if x.numel() == x.shape[-1]:  # one token of one sequence: matrix-vector products dispatch faster
        v = x.reshape(-1)
        y = torch.addmv(v * u, up, torch.mv(down, v))
        h = torch.addcdiv(shift, y, torch.hypot(torch.linalg.vector_norm(v), root_eps)).view_as(x)
    else:
        flat = x.reshape(-1, x.shape[-1])
        y = torch.addmm(flat * u, flat @ down.T, up.T)
        norm = torch.hypot(torch.linalg.vector_norm(flat, dim=-1, keepdim=True), root_eps)
        h = torch.addcdiv(shift, y, norm).view_as(x)
    return torch.addcmul(x, mixer(h, ctx, layer), gate)


class ConditionedBlock(nn.Module):
    """A modulated :class:`~elr_lightning.layers.Block` at one fixed context c_i, for inference.

    Runs the block's own mixers (shared, not copied) with eq. (4)'s constants for c_i, computed at
    construction, so ``forward(x, ctx)`` equals ``block(x, ctx.at(i, c_i))`` to fp32 round-off.
    Per sublayer: ``x + gate * f(P (w s * rms(x) + m))`` with ``P = I + (A diag g) B``, in one of
    two forms with the same result:

    * fused: ``rms_norm`` with the weight ``w s``, then the adapter and shift as two thin matmuls
      (:func:`_fused_constants`): three ops where ``rms_norm`` is one kernel (CUDA);
    * split: the norm's per-token scalar taken after the pre-map (:func:`split_constants`): six
      small ops. On the CPU ``rms_norm`` itself runs as about eight ops (``pow``, ``mean``,
      ``rsqrt``, ...), and a one-token decode step is bound by per-op latency, so this form costs
      about what the plain layer's ``rms_norm`` does.

    The constants are plain tensors, read without a module lookup per token: they neither follow
    later changes of the block's parameters nor move with ``.to()``; build the block again on the
    device and dtype it runs with (:func:`serving_model` does).

    Args:
        block: A recurrent or output block whose modulators implement ``Modulator.modulation``.
        c: The context c_i.
        fused_norm: The fused form (``True``) or the split form (``False``); ``None``: the split
            form on the CPU, the fused form on other devices.

    Raises:
        NotImplementedError: a modulator does not implement ``modulation``.
    """

    def __init__(self, block: Block, c: Tensor, fused_norm: Optional[bool] = None) -> None:
        super().__init__()
        if fused_norm is None:
            fused_norm = _fused_norm(c.device)
        constants = _fused_constants if fused_norm else split_constants
        self.sublayer = _fused_residual if fused_norm else _split_residual
        self.index = block.index
        self.attn, self.mlp = block.attn, block.mlp
        self.constants = (
            constants(block.attn_norm, block.attn_mod, c),
            constants(block.mlp_norm, block.mlp_mod, c),
        )

    def forward(self, x: Tensor, ctx: LoopContext) -> Tensor:
        """The block's output at its fixed context (``ctx.cond`` is not read)."""
        x = self.sublayer(x, self.attn, self.constants[0], ctx, self.index)
        return self.sublayer(x, self.mlp, self.constants[1], ctx, self.index)


@torch.inference_mode(False)
@torch.no_grad()
def conditioned_at(model: LoopedLM, loops: int, fused_norm: Optional[bool] = None) -> FoldedLM:
    """``model`` at ``loops`` with each loop's conditioning constants computed once, weights shared.

    Every recurrent layer gets one :class:`ConditionedBlock` per loop i = 1..k (under c_i), every
    output layer one (under c_k); the mixers, embedding, input layers and head are the model's
    own. Without active conditioning the result runs the model's own layers at every loop.

    Args:
        model: The model (left unchanged; its training mode is not touched).
        loops: The loop count k >= 1.
        fused_norm: :class:`ConditionedBlock`'s form (``None``: the default on the model's device).

    Returns:
        A :class:`FoldedLM` that accepts ``loops == k`` only.

    Raises:
        ValueError: ``loops`` is not an integer >= 1.
        NotImplementedError: A modulator does not implement ``modulation``.
    """
    check_loops(loops)
    conditioner, like = model.conditioner, model.embed.weight

    def at(blocks: nn.ModuleList, c: Optional[Tensor]) -> list[nn.Module]:
        if c is None:
            return list(blocks)
        return [block if block.attn_mod is None else ConditionedBlock(block, c, fused_norm) for block in blocks]

    contexts = [
        None if conditioner is None else conditioner(i, loops, model.config.max_loops, like)
        for i in range(1, loops + 1)
    ]
    return FoldedLM(model, loops, [at(model.core.layers, c) for c in contexts], at(model.output_layers, contexts[-1]))


def _build(model: LoopedLM, loops: int, fused_norm: Optional[bool] = None) -> FoldedLM:
    """At k = 1 off the CPU the constants folded into copies of the weights (where every mixer folds), else shared.

    At k = 1 every layer runs once per token, so a folded copy replaces the original in what a
    decode step reads: no more weight traffic and no extra op (it holds the recurrent and output
    layers twice in memory). That pays where :class:`ConditionedBlock` runs the fused form (two
    thin matmuls more than a plain layer). On the CPU its split form costs about what a plain
    layer's ``rms_norm`` does, and it decoded 1.01x the unconditioned model at k = 1 against the
    folded copies' 0.98x (their input maps gain a bias), so the weights stay shared there. At
    k > 1 copies would be read once per loop (k times the recurrent weights; 0.79-0.83x the
    unconditioned model's decode rate at k = 4 on a CPU), so the weights stay shared everywhere.
    """
    if fused_norm is None:
        fused_norm = _fused_norm(model.embed.weight.device)
    if loops == 1 and fused_norm:
        try:
            return fold_conditioning(model, 1)
        except NotImplementedError:  # e.g. a mixture of experts: its mixer has no weight fold
            pass
    return conditioned_at(model, loops, fused_norm)


#: Models whose conditioning was found to have no constant form, weakly held: the warning is said once per model.
_WARNED: "weakref.WeakSet[LoopedLM]" = weakref.WeakSet()


def serving_model(
    model: Union[LoopedLM, FoldedLM], loops: int, fold: Optional[bool] = None
) -> Union[LoopedLM, FoldedLM]:
    """The module a generation at ``loops`` decodes with: :func:`conditioned_at` ``(model, loops)`` or ``model``.

    Call it once per generation (prefill and decode steps), not per token. With active
    conditioning it returns the model with that k's conditioning constants computed now from the
    current weights (the same logits to fp32 round-off, without running the conditioner per token).
    Nothing is cached across calls, so no change of the weights can leave it stale; the result is a
    snapshot of the constants, to be built again after the weights change.

    Args:
        model: The model; a :class:`FoldedLM` is returned as it is.
        loops: The loop count k of the generation.
        fold: ``None`` follows ``model.serve_folded`` (on unless switched off); ``True`` asks for
            the constant form; ``False`` decodes with ``model`` as it is.

    Returns:
        The module to call as ``runner(input_ids, loops, attention_mask, cache)``.

    Raises:
        NotImplementedError: ``fold=True`` for a model whose modulators have no constant form
            (no ``Modulator.modulation``). With ``fold=None`` such a model decodes as it is, and a
            warning says so once per model.
    """
    if isinstance(model, FoldedLM):
        return model
    wanted = getattr(model, "serve_folded", True) if fold is None else fold
    conditioner = model.conditioner
    if not wanted or conditioner is None or not conditioner.active:
        return model
    try:
        return _build(model, loops)
    except NotImplementedError as err:  # a modulator that only offers pre() and post()
        if fold:
            raise
        if model not in _WARNED:
            _WARNED.add(model)
            warnings.warn(f"decoding unfolded (the conditioner runs per token): {err}", stacklevel=3)
        return model
