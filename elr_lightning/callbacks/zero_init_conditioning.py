"""Bring the loop-conditioning heads (eq. 4) in at the switch, zero-initialised, without changing any output."""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning_utilities.core.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from elr_lightning.callbacks.delayed_mixed_depth import DelayedMixedDepth
from elr_lightning.callbacks.switch import SwitchCallback, SwitchPoint
from elr_lightning.conditioning import Conditioner
from elr_lightning.model import LoopedLM

#: The optimizer group that holds the conditioning parameters (``elr_lightning.optim.param_groups``).
CONDITIONING_GROUP = "conditioning"


def conditioning_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every parameter in the ``conditioning`` group of each :class:`LoopedLM` in ``model``."""
    return [p for lm in model.modules() if isinstance(lm, LoopedLM) for p in lm.parameters_with_role(CONDITIONING_GROUP)]


def zero_heads(model: nn.Module) -> list[nn.Parameter]:
    """The zero-initialised conditioning heads (FiLM lambda/mu, adapter gate g, exit gate omega)."""
    return [
        p
        for lm in model.modules()
        if isinstance(lm, LoopedLM)
        for p in lm.parameters_with_role(CONDITIONING_GROUP, init="zeros")
    ]


class ZeroInitConditioning(SwitchCallback):
    """Switch the conditioner on at the switch step with its heads at exactly zero (paper §3.3, eq. 4).

    "Allocate at setup, activate at the switch" (DESIGN §5): the heads exist from ``__init__`` and
    sit in their own ``conditioning`` optimizer group from step 0, so DDP registers them at wrap
    time and the LR scheduler covers them. Until the switch the conditioner's persistent ``active``
    buffer is off, the model runs the plain layers and the heads get no gradient, so AdamW keeps no
    state for them and applies no weight decay. At the first batch of the switch step the callback

    1. re-zeroes the heads (FiLM lambda/mu, adapter gate g, exit gate omega), so the modulated
       layers equal the plain ones bit for bit whatever touched the heads before;
    2. drops any optimizer state of the conditioning parameters, so they enter AdamW exactly as
       parameters added fresh at that step (a no-op unless something gave them zero gradients);
    3. sets ``active``. The flag is saved with the weights, so a resume before or after the switch
       restores it, and this callback flips it only on the transition.

    The outputs right after the switch equal those right before it (the heads are zero); from the
    switch step on the heads get gradients and train at the scheduled LR of their group.

    Under DDP (``find_unused_parameters=True``) and under
    :class:`~elr_lightning.strategies.OneLoopOverrideFSDPStrategy` (FSDP2) the inactive heads are
    skipped alike on every rank and their gradients stay ``None``: nothing is reduced for them and
    AdamW keeps no state (``tests/checkpoints/test_resume.py`` checks both with two processes). A sharded setup
    that must touch every parameter instead (``reduce_scatter_unused_params=True``, or a
    multiply-by-zero gate) gives them zero gradients: AdamW, without weight decay in this group,
    leaves them unchanged but counts steps, and step 2 above discards that state at the switch.

    Args:
        switch_fraction: Fraction of planned training tokens before the switch. With neither this
            nor ``switch_step``, the switch is that of the trainer's :class:`DelayedMixedDepth`
            callback (the usual pairing; ``callbacks/delayed_mixed_depth.yaml``).
        switch_step: Absolute switch step; overrides ``switch_fraction``.
    """

    activates_conditioning = True

    def __init__(self, switch_fraction: Optional[float] = None, switch_step: Optional[int] = None) -> None:
        super().__init__()
        own = switch_fraction is not None or switch_step is not None
        self.switch = SwitchPoint(switch_fraction, switch_step) if own else None

    @staticmethod
    def _conditioner(pl_module: "pl.LightningModule") -> Conditioner:
        conditioner = getattr(getattr(pl_module, "model", None), "conditioner", None)
        if conditioner is None:
            raise ValueError(
                "ZeroInitConditioning needs a model with a conditioner: set model.init_args.conditioner "
                "(e.g. elr_lightning.conditioning.LoopConditioner), or remove the callback"
            )
        return conditioner

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        self._conditioner(pl_module).set_active(False)

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._check_optimizer(trainer, pl_module)
        if self.switch is not None:
            self.switch_step = self.switch.resolve(trainer)
        else:
            partner = [cb for cb in trainer.callbacks if isinstance(cb, DelayedMixedDepth)]
            if not partner:
                raise ValueError(
                    "ZeroInitConditioning without switch_step or switch_fraction follows a DelayedMixedDepth "
                    "callback, but the trainer has none: add one, or give this callback its own switch"
                )
            self.switch_step = partner[0].switch.resolve(trainer)
        self.check_resume()

    @staticmethod
    def _check_optimizer(trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        wanted = {id(p) for p in conditioning_parameters(pl_module)}
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                if group.get("name") == CONDITIONING_GROUP and wanted == {id(p) for p in group["params"]}:
                    return
        raise ValueError(
            "ZeroInitConditioning needs every conditioning parameter in an optimizer param group named "
            f"{CONDITIONING_GROUP!r} from step 0 (elr_lightning.optim.param_groups builds it); adding groups later "
            "breaks the LR scheduler, resuming and DDP"
        )

    @override
    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        if self.switch_step is None:
            raise RuntimeError("ZeroInitConditioning: on_fit_start, which resolves the switch step, has not run")
        conditioner = self._conditioner(pl_module)
        wanted = trainer.global_step >= self.switch_step
        if wanted == conditioner.active:
            return
        if not wanted:
            raise ValueError(
                f"conditioning is active at step {trainer.global_step}, before the switch at step {self.switch_step}: "
                "the checkpoint was trained with conditioning on; resume it without ZeroInitConditioning, or with "
                "its own switch step"
            )
        self.activate(trainer, pl_module)

    def activate(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Re-zero the heads, clear their optimizer state and switch conditioning on."""
        with torch.no_grad():
            for p in zero_heads(pl_module):
                p.zero_()
        params = conditioning_parameters(pl_module)
        for optimizer in trainer.optimizers:
            for p in params:
                optimizer.state.pop(p, None)
        self._conditioner(pl_module).set_active(True)
        rank_zero_info(f"ZeroInitConditioning: conditioning on at step {trainer.global_step}, heads zeroed")
