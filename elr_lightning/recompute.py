"""Saved tensors rebuilt in the backward pass instead of kept: eq. (4)'s weight-sized terms per loop.

Eq. (4)'s fast form (:meth:`~elr_lightning.mixers.TokenMixer.modulated`) builds, per loop, copies of
the weights it folds the conditioning into (``W P``, the gated output rows) and of the conditioning
heads it stacks for one matmul (:meth:`~elr_lightning.conditioning.FiLMAdapterModulator.modulations`).
The ops reading them would keep each copy for the backward pass: one copy of the recurrent block's
weights per loop. :class:`RecomputedTensors` keeps how to rebuild them instead; the backward pass
rebuilds each from the parameters and the rank-r terms when it needs it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch
from torch import Tensor

__all__ = ["RecomputedTensors", "autocast_off", "read_dtype"]


def read_dtype(w: Tensor) -> torch.dtype:
    """The dtype a ``Linear`` reads its weight ``w`` in here: autocast's where it is on for ``w``'s device."""
    state = _autocast_state(w.device.type)
    if state is not None and state[0] and w.is_floating_point() and w.dtype != torch.float64:
        return state[1]
    return w.dtype


def autocast_off(device: str) -> contextlib.AbstractContextManager[Any]:
    """Autocast switched off for ``device`` (the type, e.g. ``"cpu"``); a no-op where it has none (meta)."""
    return torch.autocast(device, enabled=False) if torch.amp.is_autocast_available(device) else contextlib.nullcontext()


def _autocast_state(device: str) -> Optional[tuple[bool, torch.dtype]]:
    """Whether autocast is on for ``device`` and its dtype; ``None`` where the device has no autocast (meta)."""
    if not torch.amp.is_autocast_available(device):  # asking the meta device about autocast raises
        return None
    return torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)


class _Made:
    """A tensor :meth:`RecomputedTensors.add` made: the call that made it, and the autocast state it ran under."""

    def __init__(self, out: Tensor, fn: Callable[..., Tensor], args: tuple[Tensor, ...]) -> None:
        self.out, self.fn, self.args = out, fn, args
        self.device = out.device.type
        self.autocast = _autocast_state(self.device)


class _Rebuild:
    """How to rebuild one saved view of a tensor :class:`RecomputedTensors` registered."""

    def __init__(self, made: _Made, view: Tensor) -> None:
        self.fn, self.args, self.device, self.autocast = made.fn, made.args, made.device, made.autocast
        self.versions = tuple(arg._version for arg in made.args)
        self.size, self.stride, self.offset = view.size(), view.stride(), view.storage_offset()

    def __call__(self) -> Tensor:
        if any(arg._version != v for arg, v in zip(self.args, self.versions)):
            raise RuntimeError(
                "a tensor eq. 4's folded weights are rebuilt from was modified in place between the forward "
                "and the backward pass; modify parameters only after backward()"
            )
        as_forward = contextlib.nullcontext() if self.autocast is None else torch.autocast(
            self.device, dtype=self.autocast[1], enabled=self.autocast[0]
        )
        with as_forward:  # the autocast state the forward ran under
            return self.fn(*self.args).as_strided(self.size, self.stride, self.offset)


class _Kept:
    """A saved tensor kept as it is, with its version: unpacking checks it was not modified in place since.

    Saved-tensor hooks take over what autograd otherwise checks itself when it unpacks a saved tensor
    (its ``_version``, which every in-place op bumps and a ``detach`` shares), so the check is made
    here, with autograd's own words: a mixer that modifies a tensor its forward saved (``s =
    sigmoid(g); s.mul_(2)``) raises as it does without conditioning, instead of a wrong gradient.
    """

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor.detach()
        self.version = tensor._version

    def __call__(self) -> Tensor:
        if self.tensor._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{self.tensor.type()} {list(self.tensor.shape)}] is at version {self.tensor._version}; expected "
                f"version {self.version} instead (saved inside eq. 4's conditioned mixer). Use an out-of-place op there"
            )
        return self.tensor


def _unpack(packed: Any) -> Tensor:
    """A :class:`_Kept` tensor checked and returned, or a :class:`_Rebuild` rebuilt."""
    return packed()


class RecomputedTensors:
    """Saved-tensor hooks under which autograd keeps how to rebuild the tensors :meth:`add` made, not the tensors.

    Every other tensor saved inside the context is kept as usual, checked on unpacking as autograd
    checks it (:class:`_Kept`), and the function and gradients are unchanged: the backward pass
    calls the same function on the same inputs (it checks that none was modified in place since). With ``create_graph=True`` the rebuild is itself
    differentiable.

    Inside the context these hooks are the innermost, so other saved-tensor hooks (torch's
    ``save_on_cpu``, activation checkpointing) do not see what is saved within it: the caller
    enables it only where that costs nothing, e.g. outside activation checkpointing (which keeps
    nothing of a checkpointed pass anyway) or around ops that save only small tensors besides the
    rebuilt ones. Under ``torch.compile`` leave it off: the compiler's partitioner decides what is saved.

    A context manager holding torch's ``saved_tensors_hooks`` while enabled, and touching nothing of
    it otherwise, so that a compiled graph traces it without a break.

    Args:
        enabled: Whether to install the hooks; otherwise :meth:`add` just calls its function.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._made: dict[int, _Made] = {}
        self._hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None

    def add(self, fn: Callable[..., Tensor], *args: Tensor) -> Tensor:
        """``fn(*args)``, registered so that what the backward pass saves of it is rebuilt from ``args``.

        ``fn`` must be cheap next to the ops that read its result and return a new tensor.
        """
        out = fn(*args)
        if self.enabled:
            self._made[id(out)] = _Made(out, fn, args)
        return out

    def _pack(self, tensor: Tensor) -> Any:
        base = tensor if tensor._base is None else tensor._base
        made = self._made.get(id(base))
        if made is None or made.out is not base:
            return _Kept(tensor)
        return _Rebuild(made, tensor)

    def __enter__(self) -> "RecomputedTensors":
        if self.enabled:
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
            self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._made.clear()  # the graph keeps the hooks and the recipes only: the copies die with the forward
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
            self._hooks = None
