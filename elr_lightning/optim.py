"""Optimizer param groups and the warmup-then-cosine LR schedule."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn
from torch.optim import Optimizer
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, LRScheduler, SequentialLR

from elr_lightning.model import LoopedLM
from elr_lightning.roles import GROUPS

#: Groups that take weight decay.
DECAY_GROUPS = ("decay",)


def check_lr_scale(lr_scale: Optional[dict[str, float]]) -> None:
    """Refuse an ``lr_scale`` naming no optimizer group or holding a multiplier that is not a finite number > 0.

    Raises:
        ValueError: Naming the field, the groups and the rule.
    """
    for group, scale in (lr_scale or {}).items():
        if group not in GROUPS or not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            raise ValueError(
                f"model.init_args.lr_scale={lr_scale}: keys must be optimizer groups {', '.join(GROUPS)} and "
                "values finite numbers > 0"
            )


def param_groups(
    model: LoopedLM, weight_decay: float, lr: Optional[float] = None, lr_scale: Optional[dict[str, float]] = None
) -> list[dict]:
    """Named AdamW param groups: ``decay`` (matrices), ``no_decay`` (norms, biases), ``gate``
    (adaptive-delta gate) and ``conditioning`` (eq. 4 heads, their own group so a callback can
    bring them in at the switch). Only ``decay`` gets weight decay. Empty groups are kept, so the
    optimizer layout does not depend on the configuration (resumes stay compatible).

    With ``lr``, every group gets its own ``lr``: ``lr`` times its ``lr_scale`` entry (default 1).

    Raises:
        ValueError: A trainable parameter has no recorded role (it was added after the model was
            built), or landed in no group or in two.
    """
    buckets: dict[str, list[nn.Parameter]] = {name: [] for name in GROUPS}
    for name, p in model.named_parameters():
        if p.requires_grad:
            if name not in model.roles:
                raise ValueError(
                    f"parameter {name!r} has no recorded role: LoopedLM.roles is built when the model is; create the "
                    "parameter in your plug-in's build() (or __init__) and tag it with elr_lightning.roles.set_role"
                )
            buckets[model.roles[name][1]].append(p)
    check_lr_scale(lr_scale)
    groups = [
        {"name": name, "params": params, "weight_decay": weight_decay if name in DECAY_GROUPS else 0.0}
        for name, params in buckets.items()
    ]
    if lr is not None:
        for group in groups:
            group["lr"] = lr * (lr_scale or {}).get(group["name"], 1.0)
    placed = [id(p) for g in groups for p in g["params"]]
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    if len(placed) != len(set(placed)) or set(placed) != trainable:
        raise ValueError(
            f"{len(placed) - len(set(placed))} parameter(s) landed in two optimizer groups and "
            f"{len(trainable - set(placed))} in none; give each parameter one role with elr_lightning.roles.set_role"
        )
    return groups


def adamw(groups: list[dict], **kwargs: Any) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` over ``groups``, with torch's fused kernel wherever every parameter allows it.

    Torch's own default runs the fused or multi-tensor update on CUDA only; on the CPU it loops over
    the parameter tensors in Python, one update of about ten ops per tensor. The fused kernel
    updates them all in one op, on the CPU and on accelerators (``tests/test_optim.py`` checks that
    it steps as the loop does). Parameters on a device or of a dtype without it keep torch's choice.
    The implementation is this run's, not the checkpoint's: loading an optimizer state saved by
    another one keeps it.

    Args:
        groups: The param groups (:func:`param_groups`).
        **kwargs: ``AdamW`` arguments (``lr``, ``betas``...); an explicit ``fused`` or ``foreach`` wins.
    """
    params = [p for group in groups for p in group["params"]]
    supported = _get_fused_kernels_supported_devices()
    fusable = bool(params) and all(p.device.type in supported and torch.is_floating_point(p) for p in params)
    if fusable and "fused" not in kwargs and "foreach" not in kwargs:
        kwargs["fused"] = True
    optimizer = torch.optim.AdamW(groups, **kwargs)
    choice = {key: optimizer.defaults[key] for key in ("fused", "foreach")}

    def keep_implementation(optimizer: Optimizer) -> None:
        for group in optimizer.param_groups:
            group.update(choice)

    optimizer.register_load_state_dict_post_hook(keep_implementation)
    return optimizer


def clip_without_scaler(precision: Precision, optimizer: Optimizer, clip_val: float, algorithm: str) -> bool:
    """Clip ``optimizer``'s gradients where Lightning's mixed precision refuses to though nothing is scaled.

    Lightning's ``MixedPrecision.clip_gradients`` refuses every optimizer that unscales gradients
    itself (``_step_supports_amp_scaling``: torch's fused AdamW, which :func:`adamw` picks on CUDA and
    on the CPU), since under ``16-mixed`` their gradients are still scaled when Lightning would clip
    them. Under ``bf16-mixed`` there is no grad scaler and nothing to unscale, yet the refusal made
    every run with ``gradient_clip_val`` fail at its first optimizer step. There the gradients are
    clipped as under full precision (:class:`~lightning.pytorch.plugins.precision.Precision`'s
    ``clip_gradients``); with a scaler, nothing is done here and Lightning's check stands.

    Returns:
        Whether it clipped.
    """
    if not isinstance(precision, MixedPrecision) or precision.scaler is not None or clip_val <= 0:
        return False
    Precision.clip_gradients(precision, optimizer, clip_val, GradClipAlgorithmType(algorithm))
    return True


def warmup_cosine(optimizer: Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> LRScheduler:
    """Linear warmup over ``warmup_steps`` then cosine decay to ``min_lr_ratio * lr`` at ``total_steps``.

    Built from torch's own schedulers; the same factor applies to every group.
    """
    warmup_steps = max(0, min(warmup_steps, total_steps - 1))
    base = min(g["lr"] for g in optimizer.param_groups)
    if warmup_steps == 0:
        return CosineAnnealingLR(optimizer, T_max=max(1, total_steps), eta_min=base * min_lr_ratio)
    warmup = LinearLR(optimizer, start_factor=1.0 / (warmup_steps + 1), total_iters=warmup_steps)
    cosine = CosineAnnealingLR(optimizer, T_max=max(1, total_steps - warmup_steps), eta_min=base * min_lr_ratio)
    return SequentialLR(optimizer, [warmup, cosine], milestones=[warmup_steps])
