"""The step's memory trackers: torch's ``MemTracker`` and ``FSDPMemTracker`` keeping the global peak, per phase.

:mod:`elr_lightning.estimate.memory` traces a training step under them; :mod:`elr_lightning.estimate.replay`
measures a layer call inside one with the peak set aside (:meth:`_PeakOnly.probe`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType, _RefType, _State

#: Tracker categories summed into each column of :class:`StepMemory`; every other category (buffers,
#: inputs, activations, temporaries) is ``activations``.
_PARAMS = {_MemRefType.PARAM, _FSDPRefType.SHARDED_PARAM, _FSDPRefType.UNSHARDED_PARAM, _FSDPRefType.ALL_GATHER}
_GRADS = {_MemRefType.GRAD, _FSDPRefType.SHARDED_GRAD, _FSDPRefType.UNSHARDED_GRAD, _FSDPRefType.REDUCE_SCATTER}
_OPTIMIZER = {_MemRefType.OPT, _FSDPRefType.OPT}
#: What FSDP2's CPU offload keeps in host memory: the rank's parameter and gradient shards, and the optimizer's state
#: (AdamW allocates it beside its parameters).
_HOST = {_FSDPRefType.SHARDED_PARAM, _FSDPRefType.SHARDED_GRAD, _FSDPRefType.OPT}
#: What stays on the device of an offloaded step while the host runs the update (clipping, the optimizer step):
#: gathered units, unsharded gradients, their collectives' buffers, the module buffers and the batch.
_DEVICE_RESIDENT = {
    _FSDPRefType.UNSHARDED_PARAM, _FSDPRefType.ALL_GATHER, _FSDPRefType.UNSHARDED_GRAD, _FSDPRefType.REDUCE_SCATTER,
    _FSDPRefType.BUFFER, _FSDPRefType.INP,
}  # fmt: skip


class _PeakOnly:
    """Keep the trackers' global peak and skip their per-module peaks.

    ``MemTracker`` updates the peak of every module it has seen after every operation, a cost that
    grows with the model's size times its operation count; the estimate reads the global peak only.

    With :attr:`offloaded` set, every snapshot is split as FSDP2's CPU offload places it: the peak
    kept is the device's part (every category but the shards, their gradients and the optimizer's
    state; while :attr:`updating`, the categories that stay on the device only, since clipping and
    the optimizer step then run on the host), and :attr:`host_peak` the largest host part.

    The peak is also kept per phase of the step (:attr:`phase_peaks`, :attr:`phase_host`): ``step``
    (the micro-batches' forward and backward passes) and ``update`` (from :attr:`updating` on:
    clipping and the optimizer step). Each phase's peak is affine in k and in the micro-batch where
    the whole step's is not (the update's does not grow with either), which the fast estimate uses
    (:mod:`elr_lightning.estimate.steps`).
    """

    _curr_mem_snap: dict[torch.device, dict[Any, int]]
    _peak_mem: dict[torch.device, int]
    _peak_mem_snap: dict[torch.device, dict[Any, int]]
    offloaded: bool = False
    updating: bool = False
    host_peak: int = 0
    phase_peaks: dict[str, dict[torch.device, dict[Any, int]]]
    phase_host: dict[str, int]
    _probing: Optional[list[int]] = None

    @property
    def phase(self) -> str:
        """``update`` once :attr:`updating` is set, else ``step``."""
        return "update" if self.updating else "step"

    def __enter__(self) -> Any:
        # the trackers start the peak from the snapshot on entry, which holds the host's part too
        self.phase_peaks, self.phase_host = {"step": {}}, {"step": 0}
        entered = super().__enter__()  # type: ignore[misc]
        if self.offloaded:
            self._peak_mem_snap = {device: self._device_part(snap) for device, snap in self._curr_mem_snap.items()}
            self._peak_mem = {device: snap[_TOTAL_KEY] for device, snap in self._peak_mem_snap.items()}
        self.phase_peaks["step"] = {device: dict(snap) for device, snap in self._peak_mem_snap.items()}
        return entered

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # a tensor's device (most of a step's operations: the autograd engine asks for it for every gradient,
        # FSDP2 for every parameter it gathers) allocates nothing: skip the tracker's bookkeeping for it
        if func is torch.ops.prim.device.default:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)  # type: ignore[misc]

    def probe(self, fn: Callable[[], Any]) -> tuple[Any, int, int]:
        """Run ``fn`` with the step's peak set aside (its allocations are tracked, its peak not kept); give its
        result, the bytes alive on the device at its start, and the most alive during it (for
        :mod:`elr_lightning.estimate.replay`)."""
        outer = self._probing
        start = self._device_total()
        self._probing = [start]
        # the module tracker's hooks stay out of ``fn``: they would take a backward pass run inside the step's
        # forward pass for the step's, and the gradient hooks they put on a graph never run backward keep it alive
        modules = self._mod_tracker
        modules.__exit__()
        try:
            result = fn()
        finally:
            modules.__enter__()
            top = max(self._probing[0], self._device_total())
            self._probing = outer
        if outer is not None:
            outer[0] = max(outer[0], top)
        return result, start, top

    def _device_total(self) -> int:
        """The bytes alive on the device now (the device's part under offload, as :meth:`_device_part` splits it)."""
        total = 0
        for snapshot in self._curr_mem_snap.values():
            if not self.offloaded:
                total += snapshot[_TOTAL_KEY]
                continue
            for kind, n in snapshot.items():
                if isinstance(kind, _RefType) and ((kind in _DEVICE_RESIDENT) if self.updating else (kind not in _HOST)):
                    total += n
        return total

    def _update_peak_stats(self, peak_state: _State) -> None:
        if self._probing is not None:
            self._probing[0] = max(self._probing[0], self._device_total())
            return
        phase = self.phase_peaks.setdefault(self.phase, {})
        for device, snapshot in self._curr_mem_snap.items():
            if self.offloaded:
                snapshot = self._device_part(snapshot)
            if self._peak_mem.get(device, 0) < snapshot[_TOTAL_KEY]:
                self._peak_mem[device] = snapshot[_TOTAL_KEY]
                self._peak_mem_snap[device] = dict(snapshot)
            if phase.get(device, {}).get(_TOTAL_KEY, -1) < snapshot[_TOTAL_KEY]:
                phase[device] = dict(snapshot)

    def _device_part(self, snapshot: dict[Any, int]) -> dict[Any, int]:
        kinds = {kind: n for kind, n in snapshot.items() if isinstance(kind, _RefType)}
        if self.updating:
            device = {kind: n for kind, n in kinds.items() if kind in _DEVICE_RESIDENT}
        else:
            device = {kind: n for kind, n in kinds.items() if kind not in _HOST}
        host = sum(kinds.values()) - sum(device.values())
        self.host_peak = max(self.host_peak, host)
        self.phase_host[self.phase] = max(self.phase_host.get(self.phase, 0), host)
        return {**device, _TOTAL_KEY: sum(device.values())}


class StepTracker(_PeakOnly, MemTracker):
    """``MemTracker`` for a looped LM's training step (global peak only, see :class:`_PeakOnly`).

    The fast form of eq. 4 calls a mixer through ``torch.func.functional_call`` with its weights
    replaced by folded ones (:meth:`~elr_lightning.mixers.base._Mixer.modulated`). Those are
    activations, not leaves, and ``MemTracker`` would register gradient hooks on them when the
    mixer's first call is such a call, which fails; the mixer's own parameters are tracked already
    (by the root's first call, or by ``track_external``).
    """

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True) -> tuple[int, int]:
        if any(not p.is_leaf for p in module.parameters()):
            return 0, 0
        return super()._track_module_params_and_buffers(module, install_grad_hooks)


class FSDPStepTracker(_PeakOnly, FSDPMemTracker):
    """``FSDPMemTracker`` keeping the global peak only (see :class:`_PeakOnly`)."""


__all__ = ["FSDPStepTracker", "StepTracker"]
