"""The memory estimate ``elr fit`` logs once at the start of a run on a GPU (:meth:`ELRCLI.before_fit
<elr_lightning.lightning_cli.ELRCLI.before_fit>`), and its refusal to start a step that does not fit.

The run's own step is traced (:mod:`elr_lightning.estimate.memory`): the trainer's strategy, ranks,
precision and clipping, the module's backward setting, the data module's micro-batch, every local
shard at k = K. When it exceeds the device less the headroom, ``elr fit`` stops before training with one
line naming the smallest change that fits (:func:`smallest_change`: lighter checkpointing, a smaller
micro-batch, more nodes or CPU offload under FSDP2), unless ``--skip_memory_check`` is given. On any device
whose memory :func:`cuda_total_memory` does not know (the CPU) nothing is traced, so CPU runs start as fast
as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, TextIO

import torch

from elr_lightning.module import ELRModule

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from elr_lightning.estimate.memory import Setting, StepMemory, Target

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


class MemoryCheckFailed(ValueError):
    """The configured step does not fit the device: the message names the smallest change that does."""


#: ``activation_checkpointing`` from the most memory to the least.
_LIGHTER = ("none", "loop", "layer")


def smallest_change(
    trace: Callable[["Setting"], "StepMemory"],
    setting: "Setting",
    target: "Target",
    budget: float,
    minimum_batch: int = 1,
    num_nodes: int = 1,
) -> Optional[str]:
    """The smallest change of the run that fits ``budget`` bytes per rank at ``setting``, as ``elr fit`` flags, or
    ``None``: lighter activation checkpointing, else a smaller micro-batch (with more gradient accumulation to
    keep the tokens per step), else under FSDP2 more nodes (the sharded state shrinks as 1 / ranks) or CPU offload.

    Args:
        trace: The peak of a setting (traced on the run's fake model).
        setting: The configured step (every shard at K).
        target: The run's strategy and ranks.
        budget: Bytes a rank's step may use.
        minimum_batch: The smallest micro-batch (``virtual_ranks``).
        num_nodes: Nodes of the run (``target.world_size`` is nodes x devices).
    """
    from elr_lightning.estimate.budget import at_world_size
    from elr_lightning.estimate.search import largest_fitting

    start = _LIGHTER.index(setting.checkpointing) if setting.checkpointing in _LIGHTER else len(_LIGHTER)
    for mode in _LIGHTER[start + 1 :]:
        peak = trace(dataclasses.replace(setting, checkpointing=mode)).peak
        if peak <= budget:
            return f"--model.init_args.activation_checkpointing {mode} ({peak / _GIB:.1f} GiB)"
    if setting.micro_batch > minimum_batch:
        found = largest_fitting(
            lambda b: trace(dataclasses.replace(setting, micro_batch=b)).peak, int(budget), setting.micro_batch - 1,
            minimum_batch, setting.micro_batch - 1,
        )  # fmt: skip
        if found is not None:
            more = math.ceil(setting.micro_batch / found)
            return (
                f"--data.init_args.batch_size {found} with --trainer.accumulate_grad_batches {more} times the "
                "configured one (the same tokens per step)"
            )
    if target.strategy == "fsdp":
        memory = trace(setting).as_dict()
        per_node = target.world_size // max(num_nodes, 1)
        for nodes in range(num_nodes + 1, 4 * num_nodes + 65):
            if at_world_size(memory, target.world_size, per_node * nodes)["peak"] <= budget:
                return f"--trainer.num_nodes {nodes} (the sharded state spread over {per_node * nodes} ranks)"
        if not target.cpu_offload and memory["peak"] - memory.get("sharded", 0) <= budget:
            return "--trainer.strategy.init_args.cpu_offload true (the shards and AdamW's state in host memory)"
    return None


def log_fit_estimate(
    trainer: "pl.Trainer",
    module: ELRModule,
    datamodule: Any,
    total_memory: Optional[Callable[[torch.device], Optional[int]]] = None,
    headroom: Optional[float] = None,
    stream: Optional[TextIO] = None,
    check: bool = True,
    cache_dir: Optional[Path] = None,
) -> Optional["StepMemory"]:
    """At the start of ``elr fit`` on a GPU: estimate the run's worst step once, and refuse a step that does not fit.

    Only where ``total_memory`` (default :func:`cuda_total_memory`) knows the root device's memory, so
    on a CPU nothing is traced. The step is the run's own: its strategy, ranks, precision and clipping,
    every local shard at k = K under the module's ``activation_checkpointing``, at the data module's
    ``batch_size`` x ``seq_len``, with its gradient accumulation. Global rank 0 prints one line (with the
    GDP layers' path where the model has some, and a note under ``compile_model``, which is not modelled).
    When the peak exceeds the memory less ``headroom`` (default:
    :func:`~elr_lightning.estimate.memory.default_headroom` of the device), every rank stops: rank 0 with
    :class:`MemoryCheckFailed`, naming :func:`smallest_change`, the others silently with status 1; with
    ``check`` off (``--skip_memory_check``) rank 0 warns in one line and training goes on. Under FSDP2's
    ``cpu_offload`` the line adds the host memory per rank. A run the estimate cannot cover logs why in one
    line and trains on.

    With ``cache_dir`` (:mod:`elr_lightning.estimate.cache`) the step is read from there where an earlier
    start of the same run (module, hyperparameters, trainer, data geometry and code) traced it, and kept
    there otherwise, so a restarted run checks its memory without tracing again.

    Returns:
        The estimate, or ``None`` where none was made.

    Raises:
        MemoryCheckFailed: On rank 0, the step does not fit and ``check`` is on.
    """
    memory = (total_memory or cuda_total_memory)(trainer.strategy.root_device)
    if memory is None:
        return None
    out = sys.stderr if stream is None else stream
    zero = trainer.is_global_zero
    model = module.model
    try:
        # torch's memory tools: imported on a GPU only
        from elr_lightning.estimate.cache import TraceCache
        from elr_lightning.estimate.memory import (
            Setting, default_headroom, fake_training, gdp_path, has_gdp_layers, step_peak,
        )  # fmt: skip

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

        budget = memory * (1 - headroom)
        start = time.perf_counter()
        model_section = {"class_path": f"{type(module).__module__}.{type(module).__qualname__}", "init_args": hparams}
        cache = None if cache_dir is None else TraceCache(cache_dir, model_section, True, target, True)
        with contextlib.ExitStack() as stack:
            built: dict[str, Callable[[Setting], dict[str, StepMemory]]] = {}

            def trace(s: Setting) -> StepMemory:
                phases = cache.get(s) if cache is not None else None
                if phases is None:
                    if "trace" not in built:  # the fake model is built once, where the cache does not hold a step
                        built["trace"] = stack.enter_context(fake_training(build, target, phases=True, prior_grads=True, replay=True))
                    phases = built["trace"](s)
                    if cache is not None:
                        cache.put(s, phases)
                return step_peak(phases)

            estimate = trace(setting)
            seconds = time.perf_counter() - start
            change = None
            if estimate.peak > budget and check:
                change = smallest_change(trace, setting, target, budget, module.virtual_ranks, trainer.num_nodes)
    except Exception as err:  # noqa: BLE001 - the estimate is advice: training goes on without it
        if zero:
            print(f"elr: no memory estimate for this run: {err}", file=out)
        return None
    notes = ""
    if has_gdp_layers(model):
        notes += f"; GDP layers: {gdp_path(target.precision, trainer.strategy.root_device.type)[1]}"
    if module.hparams.get("compile_model", False):
        notes += "; compile_model is not modelled: the eager step was traced"
    if target.cpu_offload:
        notes += f"; offloaded to host memory: {estimate.host / _GIB:.1f} GiB per rank"
    what = f"k = {setting.loops}, {setting.label}, micro-batch {setting.micro_batch} x {setting.seq_len}"
    if zero:
        print(
            f"elr: estimated peak memory per rank {estimate.peak / _GIB:.1f} GiB of {memory / _GIB:.1f} GiB "
            f"({what}: params {estimate.params / _GIB:.1f}, grads {estimate.grads / _GIB:.1f}, optimizer "
            f"{estimate.optimizer / _GIB:.1f}, activations {estimate.activations / _GIB:.1f} GiB; "
            f"{'traced in' if built else 'read from the cache in'} {seconds:.0f} s{notes})",
            file=out,
        )
    if estimate.peak <= budget:
        return estimate
    over = (
        f"the estimated peak {estimate.peak / _GIB:.1f} GiB per rank ({what}) exceeds {budget / _GIB:.1f} GiB "
        f"({1 - headroom:.0%} of this device)"
    )
    if not check:
        if zero:
            print(f"elr: warning: {over}; training anyway (--skip_memory_check)", file=out)
        return estimate
    if not zero:
        sys.exit(1)  # rank 0 says why
    fix = f"{change} fits" if change else "nothing tried fits (elr estimate --config ... shows the table)"
    raise MemoryCheckFailed(f"{over}; {fix}; --skip_memory_check trains anyway")


__all__ = ["MemoryCheckFailed", "cuda_total_memory", "log_fit_estimate", "smallest_change", "target_of_trainer"]
