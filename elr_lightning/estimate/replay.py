"""Replayed layers: each kind of layer call traced once, then its memory replayed at every call (the fast path).

A traced step costs time in proportion to the operations it dispatches, and most of them are the
layers' own: the same recurrent layers at every loop, and layers of one kind (one mixer, one shape)
over and over in each block. Under :class:`LayerReplay` the first call of each *kind of call* runs
the layer for real, inside the step's tracker with its peak set aside (:meth:`StepTracker.probe
<elr_lightning.estimate.trackers._PeakOnly.probe>`), on detached copies of its inputs, measuring

* the forward pass's peak above its start, what it keeps (output and saved activations) and which
  of its inputs its graph keeps alive (one more forward pass, on copies of its own);
* the backward pass's peak above its start and which inputs and parameters get a gradient, once
  with the parameters' gradients absent (they are created) and once present (they are added to in
  place, as under gradient accumulation and at a shared layer's later loops).

Every call of that kind, the first included, then runs :class:`_Replayed` instead of the layer: an
autograd function that allocates, in the same order, what the layer allocated at its peaks and
what it keeps, returns an output of the layer's shape, and in the backward pass allocates the
gradients the layer produces. The tracker, the sharding strategy's hooks, activation
checkpointing and the autograd engine see the layer's memory at its moments, so the step's peak
is the traced one; ``tests/estimate/test_replay.py`` compares every k and mode on dense, hybrid and
MoE configs under DDP and FSDP2 with the full trace.

A kind of call is the module's class, submodules and parameters (names, shapes, dtypes), the
shapes, strides and dtypes of its input and of every tensor of its loop context and other
arguments, whether the context is checkpointed, grad mode and autocast. The loop index and the
layer number are not part of it: a layer's memory at one input shape must not depend on them
except through its inputs. A call that writes to its forward pass's stores (a mixture of experts
keeps loop 1's routes and adds a balance loss) is never replayed; a layer whose calls are not
runs its own code, in which its mixers' calls (:class:`~elr_lightning.mixers.base._Mixer`'s
``forward`` and ``modulated``) are replayed where theirs are: a mixture-of-experts layer replays
its token mixer and traces its experts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef

from elr_lightning.context import LoopContext, _Stores
from elr_lightning.mixers.base import _Mixer


@dataclasses.dataclass(frozen=True)
class _Backward:
    """One backward pass of a layer: ``peak`` bytes above its start, and which inputs get a gradient."""

    peak: int
    grads: tuple[bool, ...]


@dataclasses.dataclass(frozen=True)
class LayerProfile:
    """The memory of one kind of layer call (see the module docstring), in bytes.

    Attributes:
        output: ``(shape, stride, dtype)`` of the layer's output.
        forward_peak: The forward pass's peak above its start.
        kept: What the forward pass keeps besides its output (saved activations).
        saved_inputs: Positions of the inputs that the forward pass keeps alive (saved, or kept by a mixer's own
            saved-tensor hooks to rebuild what it saves).
        fresh: The backward pass where the parameters have no gradient yet (``None``: no graph).
        accumulating: The backward pass where every parameter has one.
    """

    output: tuple[torch.Size, tuple[int, ...], torch.dtype]
    forward_peak: int
    kept: int
    saved_inputs: tuple[int, ...]
    fresh: Optional[_Backward]
    accumulating: Optional[_Backward]


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _touch(nbytes: int, device: torch.device) -> None:
    """Allocate ``nbytes`` and free them: a transient peak."""
    if nbytes > 0:
        torch.empty(nbytes, dtype=torch.uint8, device=device)


class _Replayed(torch.autograd.Function):
    """A layer call's memory without its arithmetic (:class:`LayerProfile`): inputs, then the layer's parameters."""

    @staticmethod
    def forward(ctx: Any, profile: LayerProfile, n_inputs: int, checkpointed: bool, *tensors: Tensor) -> Tensor:  # type: ignore[override]
        device = tensors[0].device
        _touch(profile.forward_peak, device)
        shape, stride, dtype = profile.output
        out = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        kept = torch.empty(profile.kept, dtype=torch.uint8, device=device)
        saved = [tensors[i] for i in profile.saved_inputs]
        # inside activation checkpointing what a layer saves goes to the checkpoint, which drops it and recomputes it
        # in the backward pass: save the kept bytes the same way there; elsewhere hold them here, to free them at
        # the moment the layer's own would be freed
        if checkpointed:
            ctx.save_for_backward(kept, *saved)
            ctx.kept = None
        else:
            ctx.save_for_backward(*saved)
            ctx.kept = kept
        ctx.profile, ctx.n_inputs, ctx.checkpointed = profile, n_inputs, checkpointed
        ctx.inputs = [(t.shape, t.stride(), t.dtype) for t in tensors[:n_inputs]]
        ctx.params = tensors[n_inputs:]
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        profile: LayerProfile = ctx.profile
        saved = ctx.saved_tensors
        kept = saved[0] if ctx.checkpointed else ctx.kept
        del saved
        ctx.kept = None
        params = ctx.params
        getting = [p for p, gets in zip(params, profile.fresh.grads[ctx.n_inputs :]) if gets]  # type: ignore[union-attr]
        accumulating = bool(getting) and all(p.grad is not None for p in getting)
        backward = profile.accumulating if accumulating else profile.fresh
        assert backward is not None
        device = grad.device
        shapes: list[Optional[tuple[torch.Size, tuple[int, ...], torch.dtype]]] = []
        for i, gets in enumerate(backward.grads):
            if not gets or (accumulating and i >= ctx.n_inputs):  # added to the parameter's gradient in place
                shapes.append(None)
            elif i < ctx.n_inputs:
                shapes.append(ctx.inputs[i])
            else:
                p = params[i - ctx.n_inputs]
                shapes.append((p.shape, p.stride(), p.dtype))
        size = sum(math.prod(s[0]) * s[2].itemsize for s in shapes if s is not None)
        # the layer's peak, with its gradients alive at it where they fit under it; else its saved bytes are freed
        # first (the layer frees its saved activations as its backward pass runs, and the end state is under the peak)
        kept_bytes = 0 if backward.peak >= size else _nbytes(kept)
        if kept_bytes:
            kept = None
        made = [None if s is None else torch.empty_strided(*s[:2], dtype=s[2], device=device) for s in shapes]
        _touch(backward.peak - size + kept_bytes, device)
        return (None, None, None, *made)


def _context_tensors(value: Any, found: list[Tensor]) -> Any:
    """The layout of ``value`` (a loop context, its fields) with its tensors appended to ``found``, for a signature."""
    if isinstance(value, Tensor):
        found.append(value)
        return (tuple(value.shape), value.stride(), value.dtype, value.requires_grad)
    if isinstance(value, (_Stores, nn.Module)):
        return type(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value), tuple((f.name, _context_tensors(getattr(value, f.name), found)) for f in dataclasses.fields(value)))
    if isinstance(value, dict):
        return tuple((key, _context_tensors(value[key], found)) for key in sorted(value))
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_context_tensors(item, found) for item in value))
    if isinstance(value, slice):
        return ("slice", value.start, value.stop, value.step)
    return value if value is None or isinstance(value, (bool, str)) else type(value)


def _with_tensors(value: Any, swap: dict[int, Tensor]) -> Any:
    """``value`` with each tensor ``t`` replaced by ``swap[id(t)]`` (the stores left as they are)."""
    if isinstance(value, Tensor):
        return swap.get(id(value), value)
    if isinstance(value, (_Stores, nn.Module)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: _with_tensors(getattr(value, f.name), swap) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **changes)
    if isinstance(value, dict):
        return {key: _with_tensors(item, swap) for key, item in value.items()}
    if isinstance(value, tuple):
        items = [_with_tensors(item, swap) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [_with_tensors(item, swap) for item in value]
    return value


def _stores_written(stores: _Stores) -> bool:
    return bool(stores.aux) or any(bool(entry) for entry in stores.scratch.values())


class LayerReplay:
    """The profiles of the layer calls met while tracing steps on one fake model, and the wrappers that replay them.

    :meth:`installed` puts the wrappers on a step's layers, with the tracker's ``probe``
    (:meth:`~elr_lightning.estimate.trackers._PeakOnly.probe`) to measure new kinds of call.
    """

    def __init__(self) -> None:
        self.profiles: dict[Any, Optional[LayerProfile]] = {}
        self._probe: Optional[Callable[[Callable[[], Any]], tuple[Any, int, int]]] = None
        #: Layer calls replayed and traced (non-replayable kinds) in the steps traced so far.
        self.replayed = 0
        self.traced = 0
        self._measuring = False

    @contextlib.contextmanager
    def installed(
        self, layers: list[nn.Module], probe: Callable[[Callable[[], Any]], tuple[Any, int, int]]
    ) -> Iterator[None]:
        """Replay the calls of ``layers`` (``forward(x, ctx)``) and of their mixers (``forward(x, ctx, layer)``,
        ``modulated(x, ctx, layer, terms)``) while inside, measuring new kinds with ``probe``. A layer whose kind is
        not replayable runs its own code, in which its mixers' calls are replayed where theirs are."""
        self._probe = probe
        wrapped: list[tuple[nn.Module, str]] = []
        for layer in layers:
            wrapped.append((layer, "forward"))
            for module in layer.modules():
                if isinstance(module, _Mixer):
                    wrapped += [(module, "forward"), (module, "modulated")]
        wrapped = list({(id(module), name): (module, name) for module, name in wrapped}.values())  # a shared module once
        for module, name in wrapped:
            setattr(module, name, self._wrap(module, name, getattr(type(module), name).__get__(module)))
        try:
            yield
        finally:
            for module, name in wrapped:
                delattr(module, name)
            self._probe = None

    def _wrap(self, module: nn.Module, name: str, call: Callable[..., Tensor]) -> Callable[..., Tensor]:
        # the parameters are read at each call: a sharding strategy swaps them for gathered ones inside the call
        structure = (type(module), name, tuple(type(m) for m in module.modules()))

        def replayed(x: Tensor, ctx: LoopContext, *rest: Any) -> Tensor:
            if self._measuring:  # a call inside a measured one runs as it is
                return call(x, ctx, *rest)
            tensors = [x]
            layout = _context_tensors((ctx, rest), tensors)
            params = [p for p in module.parameters() if p.requires_grad]
            key = (
                structure,
                tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters()),
                _context_tensors(x, []),
                layout,
                torch.is_grad_enabled(),
                torch.is_autocast_enabled(x.device.type) and torch.get_autocast_dtype(x.device.type),
            )
            if key not in self.profiles:
                self._measuring = True
                try:
                    self.profiles[key] = self._measure(call, x, ctx, rest, tensors, params)
                finally:
                    self._measuring = False
            profile = self.profiles[key]
            if profile is None:
                self.traced += 1
                return call(x, ctx, *rest)
            self.replayed += 1
            return _Replayed.apply(profile, len(tensors), ctx.checkpointed, *tensors, *params)

        return replayed

    def _measure(
        self,
        call: Callable[..., Tensor],
        x: Tensor,
        ctx: LoopContext,
        rest: tuple[Any, ...],
        tensors: list[Tensor],
        params: list[Tensor],
    ) -> Optional[LayerProfile]:
        """The profile of ``call(x, ctx, *rest)`` (``tensors``: those of its arguments), or ``None`` where it writes to
        its forward pass's stores."""
        assert self._probe is not None
        probe = self._probe
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in tensors]

        def run(inputs: list[Tensor]) -> tuple[Tensor, _Stores]:
            stores = _Stores()
            swap = {id(t): given for t, given in zip(tensors, inputs)}
            context = dataclasses.replace(_with_tensors(ctx, swap), _stores=stores)
            # hooks of this call's own, over a checkpoint's: what the layer saves is measured as it would be kept
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                return call(inputs[0], context, *_with_tensors(rest, swap)), stores

        (out, stores), start, top = probe(lambda: run(leaves))
        wrt = [t for t in [*leaves, *params] if t.requires_grad]
        if _stores_written(stores):
            if out.requires_grad:  # run backward all the same: a graph never run backward may outlive its references
                self._backward(out, wrt, leaves, params, accumulate=False)
            return None
        output = (out.shape, out.stride(), out.dtype)
        forward_peak = top - start
        kept = max(0, probe(lambda: None)[1] - start - _nbytes(out))
        fresh = accumulating = None
        if out.requires_grad:
            fresh = self._backward(out, wrt, leaves, params, accumulate=False)
            del out
            (out, _), _, _ = probe(lambda: run(leaves))
            accumulated = self._backward(out, wrt, leaves, params, accumulate=True)
            accumulating = dataclasses.replace(accumulated, grads=fresh.grads)  # every parameter has one here
        del out
        saved_inputs = self._kept_alive(run, tensors, params) if fresh is not None else ()
        return LayerProfile(output, forward_peak, kept, saved_inputs, fresh, accumulating)

    def _kept_alive(
        self, run: Callable[[list[Tensor]], tuple[Tensor, _Stores]], tensors: list[Tensor], params: list[Tensor]
    ) -> tuple[int, ...]:
        """Positions of ``tensors`` that a forward pass with a graph (``run``) keeps alive.

        Each is given as a copy of its own that nothing else holds (one that requires grad made by an op, not a
        leaf, which autograd would hold); the copies whose memory outlives the forward pass's other references
        are the ones its graph keeps (saved, or held by a mixer's own saved-tensor hooks). The graph is then
        run backward, which frees it: a graph never run backward may outlive its references (saved-tensor hooks
        that hold their own tensor make a cycle through autograd that the garbage collector does not see).
        """
        assert self._probe is not None

        def forward() -> tuple[tuple[int, ...], Tensor, Tensor]:
            anchor = torch.zeros((), device=tensors[0].device, requires_grad=True)
            copies = [t.detach().clone() + anchor.to(t.dtype) if t.requires_grad else t.detach().clone() for t in tensors]
            alive = [StorageWeakRef(c.untyped_storage()) for c in copies]
            out = run(copies)[0]
            del copies
            return tuple(i for i, ref in enumerate(alive) if not ref.expired()), out, anchor

        (kept, out, anchor), _, _ = self._probe(forward)
        self._backward(out, [anchor, *(p for p in params if p.requires_grad)], [anchor], params, accumulate=False)
        return kept

    def _backward(
        self, out: Tensor, wrt: list[Tensor], leaves: list[Tensor], params: list[Tensor], accumulate: bool
    ) -> _Backward:
        """The backward pass of ``out`` to ``wrt``: the parameters' gradients created, or added to (``accumulate``)."""
        assert self._probe is not None
        probe = self._probe
        before = {id(p): p.grad for p in params}
        grad = probe(lambda: torch.empty_like(out))[0]
        try:
            for p in params:
                p.grad = (p.grad if p.grad is not None else torch.empty_like(p)) if accumulate else None
            _, start, top = probe(lambda: torch.autograd.backward(out, grad, inputs=wrt))
            got = {id(t) for t in [*leaves, *params] if t.grad is not None}
        finally:
            for t in leaves:
                t.grad = None
            for p in params:
                p.grad = before[id(p)]
        return _Backward(top - start, tuple(id(t) in got for t in [*leaves, *params]))


__all__ = ["LayerProfile", "LayerReplay"]
