"""Delayed mixed-depth training (paper §3.4): k = 1 for the first part of training, mixed depths after."""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning_utilities.core.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor
from typing_extensions import override

from elr_lightning.callbacks.switch import DEFAULT_SWITCH_FRACTION, SwitchCallback, SwitchPoint
from elr_lightning.checkpoints.safe_load import load_weights_only
from elr_lightning.sampling import LoopSampler


class DelayedSampler(LoopSampler):
    """k = 1 on every shard before ``switch_step``, then the schedule of ``after``.

    A pure function of ``(seed, step, num_shards)`` like every sampler, so a resumed run replays it
    without extra state. ``after`` sees the absolute step index.

    Args:
        after: The sampler of the mixed-depth phase, e.g. one-loop overrides (eq. 3).
        switch_step: First optimizer step of the mixed-depth phase.
    """

    def __init__(self, after: LoopSampler, switch_step: int) -> None:
        if switch_step < 0:
            raise ValueError(f"switch_step={switch_step} must be >= 0")
        self.after = after
        self.switch_step = switch_step
        self.max_loops = after.max_loops

    @override
    def schedule(self, seed: int, step: int, num_shards: int) -> list[int]:
        if step < self.switch_step:
            return [1] * num_shards
        return self.after.schedule(seed, step, num_shards)


def _normalised_state_dict(raw: Any, path: str) -> dict[str, torch.Tensor]:
    """The model weights of a Lightning checkpoint or a plain state dict, keyed as in ``LoopedLM``."""
    state = raw.get("state_dict", raw) if isinstance(raw, dict) else None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"init_from={path!r} holds neither a Lightning checkpoint nor a state dict of tensors")
    if state and all(key.startswith("model.") for key in state):
        state = {key[len("model.") :]: value for key, value in state.items()}
    return state


def _summarise(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def load_weights_where_present(model: nn.Module, path: str) -> list[str]:
    """Load the weights of ``path`` into ``model`` strictly where present; report what is new.

    ``path`` is a Lightning checkpoint of an ``ELRModule`` or a state dict of the looped model
    (keys as in :class:`~elr_lightning.model.LoopedLM`, with or without the ``model.`` prefix) —
    e.g. a one-loop run of this library, or a plain non-recurrent run of the same architecture,
    whose state dict has no gate or conditioning tensors. Every tensor of the file must exist in
    ``model`` with the same shape; tensors of ``model`` absent from the file keep their
    initialisation (``LoopedLM.init_weights``: zero gate and heads, so the new parts start as in a
    fresh model).

    The file is read with ``weights_only=True``, like every checkpoint this library reads: a file that
    holds a pickled object is refused in one line (:mod:`elr_lightning.checkpoints.safe_load`), never unpickled;
    convert a checkpoint of an earlier version once with ``elr upgrade-checkpoint OLD NEW --trust``.

    Args:
        model: The looped model (``ELRModule.model``).
        path: The checkpoint or state-dict file.

    Returns:
        Names of the tensors of ``model`` that the file did not provide (newly initialised).

    Raises:
        ValueError: The file has tensors ``model`` lacks, or tensors of another shape.
    """
    state = checked_weights(model, path)
    own = model.state_dict()
    if any(value.is_meta for value in own.values()):
        raise ValueError(f"init_from={path!r}: the model is still on the meta device; load it once materialised")
    if any(isinstance(value, DTensor) for value in own.values()):
        # Sharded (FSDP2): distribute the full tensors onto each rank's shards.
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
    else:
        model.load_state_dict(state, strict=False)
    return sorted(set(own) - set(state))


def checked_weights(model: nn.Module, path: str) -> dict[str, torch.Tensor]:
    """The tensors of ``path`` (see :func:`load_weights_where_present`), checked against ``model``'s names
    and shapes; ``model`` may still be on the meta device.

    Raises:
        ValueError: The file has tensors ``model`` lacks, or tensors of another shape.
    """
    raw = load_weights_only(path)
    state = _normalised_state_dict(raw, path)
    own = model.state_dict()
    unexpected = sorted(set(state) - set(own))
    mismatched = sorted(
        f"{key} {tuple(state[key].shape)} vs {tuple(own[key].shape)}"
        for key in set(state) & set(own)
        if state[key].shape != own[key].shape
    )
    if unexpected or mismatched:
        raise ValueError(
            f"init_from={path!r} does not fit this architecture: "
            + (f"tensors this model lacks: {_summarise(unexpected)}. " if unexpected else "")
            + (f"shapes differ (file vs model): {_summarise(mismatched)}. " if mismatched else "")
            + "Use model.init_args.arch of the run that wrote it."
        )
    return state


class DelayedMixedDepth(SwitchCallback):
    """Train at k = 1 until the switch, then with mixed loop counts (paper §3.4, eq. 5).

    The callback installs a :class:`DelayedSampler` as the module's sampler: every shard runs k = 1
    before the switch step and ``sampler``'s schedule from the switch step on. The schedule is a
    pure function of the optimizer step, so a run resumed from any checkpoint, before or after the
    switch, replays it exactly; the callback saves the switch step and refuses a resume that would
    move it.

    Before the switch the conditioning heads must take no part (paper §3.3): a model with a
    conditioner needs :class:`~elr_lightning.callbacks.ZeroInitConditioning` beside this callback,
    which follows this callback's switch step unless told otherwise.
    ``callbacks/delayed_mixed_depth.yaml`` adds both.

    To start the mixed phase from an existing one-loop checkpoint, name it in ``init_from``: its
    weights are loaded strictly where present (see :func:`load_weights_where_present`), the
    tensors it lacks (gate, conditioning heads) keep their zero/normal init and are listed in the
    log, and the switch defaults to step 0. Resuming this run later restores its own checkpoint
    over those weights.

    Args:
        sampler: The sampler after the switch; the module's own ``sampler`` when ``None``.
        switch_fraction: Fraction of the planned training tokens (``trainer.estimated_stepping_batches``
            x tokens per step) trained at k = 1. Default 0.75, or 0 with ``init_from``.
        switch_step: Absolute optimizer step of the switch; overrides ``switch_fraction``.
        init_from: A one-loop checkpoint (or state dict) to start from.
    """

    def __init__(
        self,
        sampler: Optional[LoopSampler] = None,
        switch_fraction: Optional[float] = None,
        switch_step: Optional[int] = None,
        init_from: Optional[str] = None,
    ) -> None:
        super().__init__()
        if switch_fraction is None and switch_step is None:
            switch_fraction = 0.0 if init_from is not None else DEFAULT_SWITCH_FRACTION
        self.switch = SwitchPoint(switch_fraction, switch_step)
        self.sampler = sampler
        self.init_from = init_from
        self._load_pending = False

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        conditioner = getattr(pl_module.model, "conditioner", None)
        if conditioner is not None and not self._has_zero_init(trainer):
            raise ValueError(
                "DelayedMixedDepth trains at k = 1 without conditioning before the switch, but the model has a "
                "conditioner and no ZeroInitConditioning callback brings its heads in at the switch: add "
                "elr_lightning.callbacks.ZeroInitConditioning (callbacks/delayed_mixed_depth.yaml adds both), "
                "or set model.init_args.conditioner: null"
            )
        self._load_pending = False
        if self.init_from is not None:
            if any(p.is_meta for p in pl_module.model.parameters()):
                # meta_init: loading into meta tensors is a no-op, and the strategy initialises the shards
                # afterwards; check the file now, load it once the shards hold memory (on_fit_start).
                checked_weights(pl_module.model, self.init_from)
                self._load_pending = True
            else:
                self._load(pl_module)

    def _load(self, pl_module: "pl.LightningModule") -> None:
        new = load_weights_where_present(pl_module.model, self.init_from)
        rank_zero_info(
            f"DelayedMixedDepth: loaded {self.init_from}; newly initialised: {_summarise(new) if new else 'none'}"
        )

    @staticmethod
    def _has_zero_init(trainer: "pl.Trainer") -> bool:
        return any(isinstance(cb, SwitchCallback) and cb.activates_conditioning for cb in trainer.callbacks)

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._load_pending and trainer.ckpt_path is None:  # a resumed run has its own weights
            self._load(pl_module)
        self._load_pending = False
        current = pl_module.sampler
        after = self.sampler if self.sampler is not None else current
        if isinstance(after, DelayedSampler):
            after = after.after
        self.switch_step = self.switch.resolve(trainer)
        pl_module.set_sampler(DelayedSampler(after, self.switch_step))
        self.check_resume()
        rank_zero_info(
            f"DelayedMixedDepth: k = 1 until step {self.switch_step} ({self.switch.describe()}), "
            f"then {after!r}"
        )
