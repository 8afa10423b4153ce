"""Which parameters a forward pass of a :class:`~elr_lightning.model.LoopedLM` leaves out, per k.

DDP's reducer and FSDP2's reduce-scatter need to know (DESIGN §6); the ELR strategies and the
module's check of Lightning's plain DDP share this probe.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, XLAStrategy

from elr_lightning.model import LoopedLM


@contextmanager
def _conditioning(model: LoopedLM, active: bool) -> Iterator[None]:
    conditioner = model.conditioner
    if conditioner is None:
        yield
        return
    saved = conditioner.active
    conditioner.set_active(active)
    try:
        yield
    finally:
        conditioner.set_active(saved)


def _reached_parameters(output: torch.Tensor) -> set[int]:
    """``id`` of every leaf tensor the autograd graph of ``output`` accumulates a gradient into."""
    reached: set[int] = set()
    seen: set[Any] = set()
    stack = [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            reached.add(id(variable))
        stack.extend(fn for fn, _ in node.next_functions)
    return reached


def unused_parameters(model: LoopedLM, loops: Iterable[int]) -> dict[tuple[bool, int], list[str]]:
    """The trainable parameters a forward pass leaves out, per conditioning state and loop count.

    Runs ``model`` on a two-token input at each k, with the conditioner (if any) as it is and,
    when it is off, switched on as well (the state after a delayed switch, DESIGN §5), and walks
    the autograd graph; no gradient is computed and the model is left as it was. Data-dependent
    use (for example MoE experts that receive no token) is not covered.

    Args:
        model: The model, unsharded.
        loops: Loop counts to probe.

    Returns:
        ``{(conditioner_active, k): names}`` with ``names`` sorted.
    """
    conditioner = model.conditioner
    states = [True] if conditioner is None else sorted({conditioner.active, True})
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    tokens = torch.zeros(1, 2, dtype=torch.long, device=model.embed.weight.device)
    result: dict[tuple[bool, int], list[str]] = {}
    with torch.enable_grad():
        for active in states:
            with _conditioning(model, active):
                for k in loops:
                    reached = _reached_parameters(model(tokens, k))
                    result[(active, k)] = [name for name, p in named if id(p) not in reached]
    return result


def first_unused(model: LoopedLM) -> Optional[str]:
    """Where :func:`unused_parameters` first finds parameters left out at k = 1..K, in words, or ``None``.

    For an error message: ``"N take no part at k=K with the conditioner on|off (e.g. [...])"``.
    """
    usage = unused_parameters(model, range(1, model.config.max_loops + 1))
    for (active, k), names in usage.items():
        if names:
            state = "on" if active else "off"
            return f"{len(names)} take no part at k={k} with the conditioner {state} (e.g. {names[:3]})"
    return None


def check_plain_ddp(strategy: Any, model: LoopedLM) -> None:
    """Refuse Lightning's own DDP without ``find_unused_parameters`` when some parameter of ``model`` sits out.

    ``trainer.devices > 1`` without ``trainer.strategy`` gives Lightning's ``DDPStrategy``, whose
    reducer fails at the second step (or hangs) when a parameter takes no part in the loss: the
    conditioning heads before the delayed switch (DESIGN §5) or a parameter unused at some k.
    The model is probed (two tokens, every k) before DDP wraps it, so the run stops at once
    with the fix. :class:`~elr_lightning.strategies.OneLoopOverrideDDPStrategy` makes its own check.

    Raises:
        ValueError: Naming the unused parameters and the strategy to use.
    """
    # DeepSpeed and XLA subclass DDPStrategy but wrap the model in their own engines, not torch's DDP.
    torch_ddp = isinstance(strategy, DDPStrategy) and not isinstance(strategy, (DeepSpeedStrategy, XLAStrategy))
    elr_strategy = hasattr(strategy, "data_parallel_rank")  # the DataParallelLayout protocol of the ELR strategies
    if not torch_ddp or elr_strategy:
        return
    # Lightning keeps DistributedDataParallel's arguments here and has no public accessor for them.
    if getattr(strategy, "_ddp_kwargs", {}).get("find_unused_parameters", False):
        return
    unused = first_unused(model)
    if unused is not None:
        raise ValueError(
            f"trainer.strategy: Lightning's {type(strategy).__name__} (what trainer.devices > 1 picks by default) "
            f"needs every parameter in the loss, but {unused}; set trainer.strategy.class_path "
            "elr_lightning.strategies.OneLoopOverrideDDPStrategy"
        )
