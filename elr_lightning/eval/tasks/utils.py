"""Dataset hooks of the shipped task YAMLs (``custom_dataset: !function utils.<name>``)."""

from typing import Any

from elr_lightning.eval.reasoning import load_reasoning
from elr_lightning.eval.taskdata import load_task


def line_end(**kwargs: Any) -> Any:
    """The ``line_end`` examples; kwargs are the harness metadata (``data_dir``, ``seed``, ``n``)."""
    return load_task("line_end", **kwargs)


def complete_line(**kwargs: Any) -> Any:
    """The ``complete_line`` examples; kwargs are the harness metadata (``data_dir``, ``seed``, ``n``)."""
    return load_task("complete_line", **kwargs)


def reasoning(**kwargs: Any) -> Any:
    """Held-out instances of one reasoning task and level (``generator``, ``difficulty``; ``n``, ``seed``)."""
    return load_reasoning(**kwargs)
