"""The switch point of delayed mixed-depth training (paper §3.4), shared by the switch callbacks."""

from __future__ import annotations

import math
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

#: Default switch: 75% of the planned training tokens are trained at k = 1 (paper §3.4).
DEFAULT_SWITCH_FRACTION = 0.75


class SwitchPoint:
    """The optimizer step at which the mixed-depth phase begins.

    Either an absolute ``step`` or a ``fraction`` of the planned training tokens. Every optimizer
    step trains the same number of tokens, so the fraction of tokens is the fraction of steps:
    ``step = round(fraction * trainer.estimated_stepping_batches)``.

    Args:
        fraction: Fraction of planned training tokens before the switch, in [0, 1].
        step: Absolute optimizer step of the switch (>= 0); takes precedence over ``fraction``.

    Raises:
        ValueError: Neither or an out-of-range value is given.
    """

    def __init__(self, fraction: Optional[float] = None, step: Optional[int] = None) -> None:
        if step is None and fraction is None:
            raise ValueError("give the switch as switch_fraction (of planned tokens) or switch_step")
        if step is not None and (not isinstance(step, int) or step < 0):
            raise ValueError(f"switch_step={step!r} must be an integer >= 0")
        if step is None and not 0.0 <= fraction <= 1.0:
            raise ValueError(f"switch_fraction={fraction} must be in [0, 1] (a fraction of planned training tokens)")
        self.fraction = fraction
        self.step = step

    def resolve(self, trainer: "pl.Trainer") -> int:
        """The switch step for this run.

        Raises:
            ValueError: A fractional switch in a run without a finite length.
        """
        if self.step is not None:
            return self.step
        total = trainer.estimated_stepping_batches
        if not math.isfinite(total):
            raise ValueError(
                "switch_fraction needs a run of known length: set trainer.max_steps (or max_epochs), "
                "or give switch_step"
            )
        return int(round(self.fraction * total))

    def describe(self) -> str:
        """How the switch was specified, for messages."""
        return f"switch_step={self.step}" if self.step is not None else f"switch_fraction={self.fraction}"


class SwitchCallback(Callback):
    """Base of the switch callbacks: holds the resolved ``switch_step`` and checkpoints it.

    Subclasses set :attr:`switch_step` at ``on_fit_start`` and then call :meth:`check_resume`.
    Resuming a checkpoint whose switch step differs from this run's is refused, whichever of
    ``load_state_dict`` and ``on_fit_start`` comes first.
    """

    #: Whether this callback brings the conditioning heads in at the switch (what
    #: :class:`~elr_lightning.callbacks.DelayedMixedDepth` needs beside it for a conditioned model).
    activates_conditioning: bool = False

    def __init__(self) -> None:
        self.switch_step: Optional[int] = None
        self._resumed_switch_step: Optional[int] = None

    def check_resume(self) -> None:
        """Refuse to resume a run whose switch step differs from the checkpoint's.

        Raises:
            ValueError: The saved and the current switch steps differ.
        """
        saved, current = self._resumed_switch_step, self.switch_step
        if saved is not None and current is not None and saved != current:
            raise ValueError(
                f"{type(self).__name__}: the checkpoint was trained with the switch at step {saved}, this run puts "
                f"it at step {current} (the fraction is of trainer.estimated_stepping_batches, so changing "
                f"max_steps moves it). Resume with the same schedule, e.g. switch_step: {saved}"
            )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"switch_step": self.switch_step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resumed_switch_step = state_dict["switch_step"]
        self.check_resume()
