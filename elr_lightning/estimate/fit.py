"""The memory estimate ``elr fit`` logs once at the start of a run on a GPU (:meth:`ELRCLI.before_fit
<elr_lightning.lightning_cli.ELRCLI.before_fit>`), with a one-line warning when it exceeds the device.

The run's own step is traced (:mod:`elr_lightning.estimate.memory`): the trainer's strategy, ranks,
precision and clipping, the module's backward setting, the data module's micro-batch, every local
shard at k = K. On any device whose memory :func:`cuda_total_memory` does not know (the CPU) nothing
is traced, so CPU runs start as fast as before.
"""

from __future__ import annotations

import inspect
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional, TextIO

import torch

from elr_lightning.module import ELRModule

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from elr_lightning.estimate.memory import StepMemory, Target

_GIB = 2**30


def cuda_total_memory(device: torch.device) -> Optional[int]:
    """Total memory of ``device`` if it is a CUDA device, else ``None`` (no estimate is logged)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.get_device_properties(device).total_memory)


def target_of_trainer(trainer: "pl.Trainer") -> "Target":
    """The :class:`~elr_lightning.estimate.memory.Target` of a live trainer (before its strategy is set up).

    Raises:
        ValueError: A strategy or precision the estimate does not cover.
    """
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

    from elr_lightning.estimate.memory import Target, gdp_path, lightning_precision

    strategy = trainer.strategy
    options: dict[str, Any] = {}
    if isinstance(strategy, ModelParallelStrategy):
        kind = "fsdp"
        options["reshard_after_forward"] = bool(getattr(strategy, "reshard_after_forward", True))
        options["recurrent_units"] = str(getattr(strategy, "recurrent_units", "core"))
        options["cpu_offload"] = bool(getattr(strategy, "cpu_offload", False))
    elif isinstance(strategy, DDPStrategy):
        kind = "ddp"
        options["gradient_as_bucket_view"] = bool(getattr(strategy, "_ddp_kwargs", {}).get("gradient_as_bucket_view"))
    elif isinstance(strategy, SingleDeviceStrategy):
        kind = "single"
    else:
        raise ValueError(f"the memory estimate does not cover {type(strategy).__name__}")
    clip = trainer.gradient_clip_val if trainer.gradient_clip_algorithm != "value" else None
    precision = lightning_precision(trainer.precision)
    return Target(
        strategy=kind,
        world_size=trainer.num_nodes * trainer.num_devices,
        precision=precision,
        gradient_clip_val=float(clip) if clip else None,
        fla_kernels=gdp_path(precision, trainer.strategy.root_device.type)[0],
        accumulate_grad_batches=int(trainer.accumulate_grad_batches),
        accelerator=trainer.strategy.root_device.type,
        **options,
    )


def log_fit_estimate(
    trainer: "pl.Trainer",
    module: ELRModule,
    datamodule: Any,
    total_memory: Optional[Callable[[torch.device], Optional[int]]] = None,
    headroom: Optional[float] = None,
    stream: Optional[TextIO] = None,
) -> Optional["StepMemory"]:
    """At the start of ``elr fit`` on a GPU: estimate the run's worst step once and say whether it fits.

    Only global rank 0, and only where ``total_memory`` (default :func:`cuda_total_memory`) knows
    the root device's memory, so on a CPU nothing is traced. The step is the run's own: its
    strategy, ranks, precision and clipping, every local shard at k = K under the module's
    ``activation_checkpointing``, at the data module's ``batch_size`` x ``seq_len``, with its gradient
    accumulation. Prints one line (with the GDP layers' path where the model has some, and a note
    under ``compile_model``, which is not modelled), and a second, a warning, when the peak exceeds
    the memory less ``headroom`` (default: :func:`~elr_lightning.estimate.memory.default_headroom` of the device). Under
    FSDP2's ``cpu_offload`` the line adds the host memory per rank. A run
    the estimate cannot cover logs why in one line and trains on.

    Returns:
        The estimate, or ``None`` where none was made.
    """
    memory = (total_memory or cuda_total_memory)(trainer.strategy.root_device)
    if memory is None or not trainer.is_global_zero:
        return None
    out = sys.stderr if stream is None else stream
    model = module.model
    try:
        # torch's memory tools: imported on a GPU only
        from elr_lightning.estimate.memory import Setting, default_headroom, fake_training, gdp_path, has_gdp_layers

        headroom = default_headroom(trainer.strategy.root_device.type)[0] if headroom is None else headroom
        target = target_of_trainer(trainer)
        setting = Setting(
            model.config.max_loops,
            model.core.checkpointing,
            model.core.backprop_loops,
            getattr(datamodule, "batch_size", None),
            getattr(datamodule, "seq_len", None),
        )
        accepted = inspect.signature(type(module).__init__).parameters
        hparams = {key: value for key, value in module.hparams.items() if key in accepted}  # not the CLI's _class_path

        def build() -> ELRModule:
            with torch.device("meta"):
                return type(module)(**hparams)

        start = time.perf_counter()
        with fake_training(build, target) as trace:
            estimate = trace(setting)
    except Exception as err:  # noqa: BLE001 - the estimate is advice: training goes on without it
        print(f"elr: no memory estimate for this run: {err}", file=out)
        return None
    budget = memory * (1 - headroom)
    notes = ""
    if has_gdp_layers(model):
        notes += f"; GDP layers: {gdp_path(target.precision, trainer.strategy.root_device.type)[1]}"
    if module.hparams.get("compile_model", False):
        notes += "; compile_model is not modelled: the eager step was traced"
    if target.cpu_offload:
        notes += f"; offloaded to host memory: {estimate.host / _GIB:.1f} GiB per rank"
    print(
        f"elr: estimated peak memory per rank {estimate.peak / _GIB:.1f} GiB of {memory / _GIB:.1f} GiB "
        f"(k = {setting.loops}, {setting.label}, micro-batch {setting.micro_batch} x {setting.seq_len}: params "
        f"{estimate.params / _GIB:.1f}, grads {estimate.grads / _GIB:.1f}, optimizer {estimate.optimizer / _GIB:.1f}, "
        f"activations {estimate.activations / _GIB:.1f} GiB; traced in {time.perf_counter() - start:.0f} s{notes})",
        file=out,
    )
    if estimate.peak > budget:
        print(
            f"elr: warning: the estimated peak {estimate.peak / _GIB:.1f} GiB exceeds {budget / _GIB:.1f} GiB "
            f"({1 - headroom:.0%} of this device); lower data.init_args.batch_size or set "
            "model.init_args.activation_checkpointing (elr estimate --config ... shows what fits)",
            file=out,
        )
    return estimate


__all__ = ["cuda_total_memory", "log_fit_estimate", "target_of_trainer"]
