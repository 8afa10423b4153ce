"""The checks :class:`~elr_lightning.module.ELRModule` makes of its arguments and, at setup, of its data."""

from __future__ import annotations

from typing import Any, Optional

from elr_lightning.config import MAX_LOOPS, ModelConfig
from elr_lightning.errors import is_integer
from elr_lightning.optim import check_lr_scale
from elr_lightning.sampling import LoopSampler
from elr_lightning.checkpoints.trust import shown


def checked_sampler(sampler: LoopSampler, arch: ModelConfig) -> LoopSampler:
    """``sampler``, if its ``max_loops`` fits the loop budget ``arch.max_loops``.

    Raises:
        ValueError: ``sampler.max_loops`` exceeds ``arch.max_loops``.
    """
    if sampler.max_loops > arch.max_loops:
        raise ValueError(
            f"sampler.max_loops={sampler.max_loops} exceeds arch.max_loops={arch.max_loops}; "
            "raise arch.max_loops (the loop budget K) or lower the sampler's"
        )
    return sampler


#: ``ELRModule(depth_layout=...)``: which shards of a step share a loop count (see its docstring).
DEPTH_LAYOUTS = ("ranks", "micro_batches")


def check_module_args(
    *,
    virtual_ranks: Any,
    val_loops: Optional[Any],
    lr: float,
    lr_scale: Optional[dict[str, float]],
    weight_decay: float,
    warmup_steps: int,
    min_lr_ratio: float,
    compile_layers: bool,
    compile_model: bool,
    depth_layout: str = "ranks",
) -> None:
    """Refuse ``ELRModule`` arguments out of range, each named as ``model.init_args.<field>``.

    Raises:
        ValueError: Naming the field and the values it takes.
    """
    if not is_integer(virtual_ranks):
        raise ValueError(f"model.init_args.virtual_ranks={virtual_ranks!r} must be an integer >= 1")
    if val_loops is not None and not (
        isinstance(val_loops, (list, tuple)) and val_loops and all(map(is_integer, val_loops))
    ):
        raise ValueError(
            f"model.init_args.val_loops={shown(val_loops)} must be a non-empty list of integer loop counts >= 1, "
            "e.g. [1, 2]"
        )
    if val_loops is not None and max(val_loops) > MAX_LOOPS:
        raise ValueError(
            f"model.init_args.val_loops holds {max(val_loops)}, over the maximum loop count {MAX_LOOPS} (each "
            "loop count validated at gets its own metrics); validate at fewer loops"
        )
    for name, value, ok, rule in (
        ("lr", lr, lr > 0, "> 0"),
        ("weight_decay", weight_decay, weight_decay >= 0, ">= 0"),
        ("warmup_steps", warmup_steps, warmup_steps >= 0, ">= 0"),
        ("min_lr_ratio", min_lr_ratio, 0 <= min_lr_ratio <= 1, "in [0, 1]"),
    ):
        if not ok:
            raise ValueError(f"model.init_args.{name}={value} must be {rule}")
    if compile_layers and compile_model:
        raise ValueError("model.init_args.compile_layers and compile_model are both true; set one of them")
    if depth_layout not in DEPTH_LAYOUTS:
        raise ValueError(f"model.init_args.depth_layout={depth_layout!r} must be one of {', '.join(DEPTH_LAYOUTS)}")
    check_lr_scale(lr_scale)


def check_meta_init(module: Any) -> None:
    """Refuse ``meta_init: true`` under a strategy that does not materialise meta-device models.

    Raises:
        ValueError: Naming the strategy to use, or ``meta_init: false``.
    """
    strategy = module.trainer.strategy
    if module.hparams.meta_init and not getattr(strategy, "materializes_meta_models", False):
        # Lightning's teardown moves the module to the CPU, which fails on meta tensors and would
        # bury this error; uninitialised memory is never touched, so this costs no RAM.
        module.model.to_empty(device="cpu")
        raise ValueError(
            f"model.init_args.meta_init: true needs OneLoopOverrideFSDPStrategy (it materialises and "
            f"initialises the sharded model); this run uses {type(strategy).__name__}. "
            "Set trainer.strategy to it or meta_init: false"
        )


def check_data_fits(datamodule: Any, arch: ModelConfig, virtual_ranks: int, stage: str) -> None:
    """Refuse a data module whose tokenizer, batch size or sequence length does not fit the model.

    Args:
        datamodule: The trainer's data module, or ``None``; absent attributes are not checked.
        arch: The model's architecture.
        virtual_ranks: Shards per local batch (checked against ``batch_size`` when fitting).
        stage: Lightning's setup stage.

    Raises:
        ValueError: Naming the fields and the fix.
    """
    tokenizer = getattr(datamodule, "tokenizer", None)
    if tokenizer is not None and tokenizer.vocab_size > arch.vocab_size:
        raise ValueError(
            f"the tokenizer's vocabulary ({tokenizer.vocab_size}) is larger than arch.vocab_size="
            f"{arch.vocab_size}; set model.init_args.arch.vocab_size >= {tokenizer.vocab_size}"
        )
    batch_size = getattr(datamodule, "batch_size", None)
    if stage == "fit" and isinstance(batch_size, int) and batch_size < virtual_ranks:
        raise ValueError(
            f"model.init_args.virtual_ranks={virtual_ranks} is larger than data.batch_size={batch_size}: "
            "each virtual rank needs at least one sequence; raise data.batch_size or lower virtual_ranks"
        )
    seq_len = getattr(datamodule, "seq_len", None)
    if seq_len is not None and seq_len > arch.max_seq_len:
        raise ValueError(
            f"data.seq_len={seq_len} exceeds arch.max_seq_len={arch.max_seq_len} (the RoPE "
            "table); raise arch.max_seq_len or lower data.seq_len"
        )
