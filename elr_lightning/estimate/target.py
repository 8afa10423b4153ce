"""The run of an ``elr fit`` config as the memory estimate sees it: strategy, ranks, precision, GDP path,
micro-batch and sequence length, and a builder of its module on the meta device."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Optional

import torch

from elr_lightning.errors import root_cause
from elr_lightning.estimate.hardware import device_count, positive_count
from elr_lightning.estimate.memory import STRATEGIES, Target, gdp_path, half_precision, lightning_precision
from elr_lightning.lightning_cli import build_module
from elr_lightning.module import ELRModule


def _strategy_kind(strategy: Any, world_size: int) -> tuple[str, dict[str, Any]]:
    """``(kind, init_args)`` of a ``trainer.strategy`` value (a name or ``{class_path, init_args}``)."""
    if strategy is None or strategy == "auto":
        return ("ddp" if world_size > 1 else "single"), {}
    if isinstance(strategy, str):
        if strategy.startswith("ddp"):
            return "ddp", {}
        if strategy == "single_device":
            return "single", {}
        raise ValueError(
            f"trainer.strategy={strategy!r}: the memory estimate covers DDP and the library's FSDP2 strategy; "
            "pass --strategy ddp or --strategy fsdp (elr_lightning.strategies.OneLoopOverrideFSDPStrategy)"
        )
    class_path = str(strategy.get("class_path", ""))
    init_args = dict(strategy.get("init_args") or {})
    module_name, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"trainer.strategy.class_path={class_path!r} cannot be imported: {err}") from None
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    from elr_lightning.strategies import OneLoopOverrideFSDPStrategy

    if issubclass(cls, OneLoopOverrideFSDPStrategy):
        return "fsdp", init_args
    if issubclass(cls, DDPStrategy):
        return "ddp", init_args
    if issubclass(cls, SingleDeviceStrategy):
        return "single", init_args
    raise ValueError(
        f"trainer.strategy.class_path={class_path!r}: the memory estimate covers DDP and "
        "elr_lightning.strategies.OneLoopOverrideFSDPStrategy; pass --strategy ddp or --strategy fsdp"
    )


def layout_of_config(config: dict[str, Any], devices: Optional[int] = None, num_nodes: Optional[int] = None) -> tuple[int, int]:
    """``(devices per node, nodes)``: the flags, else ``trainer.devices`` and ``trainer.num_nodes``.

    Raises:
        ValueError: A value that is not a count >= 1, naming it.
    """
    trainer = config.get("trainer") or {}
    devices = positive_count(devices, "--devices") if devices is not None else device_count(trainer.get("devices", "auto"))
    nodes = num_nodes if num_nodes is not None else trainer.get("num_nodes") or 1
    return devices, positive_count(nodes, "--num_nodes" if num_nodes is not None else "trainer.num_nodes")


def accelerator_type(config: dict[str, Any], accelerator: Optional[str] = None) -> str:
    """The device type ``accelerator`` (else ``trainer.accelerator``) gives on this machine: ``cuda`` or ``cpu``
    (``auto``: CUDA if present)."""
    name = str(accelerator or (config.get("trainer") or {}).get("accelerator") or "auto").lower()
    if name in ("gpu", "cuda"):
        return "cuda"
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def _gdp_kernels_asked(config: dict[str, Any]) -> str:
    """The ``kernels`` the config's GatedDeltaProduct mixers ask for (``auto`` unless they all ask one other)."""
    arch = ((config.get("model") or {}).get("init_args") or {}).get("arch") or {}
    asked = {
        str(((spec or {}).get("init_args") or {}).get("kernels", "auto"))
        for spec in (arch.get("mixers") or {}).values()
        if "GatedDeltaProduct" in str((spec or {}).get("class_path", ""))
    }
    return asked.pop() if len(asked) == 1 else "auto"


def gdp_choice(config: dict[str, Any], gdp_kernels: str = "auto", accelerator: Optional[str] = None) -> tuple[bool, str]:
    """``(fla's kernels?, the path in words)`` of the GDP layers of a config's run under ``--gdp_kernels``.

    ``auto`` applies the test the layers apply in ``elr fit`` (:func:`~elr_lightning.estimate.memory.gdp_path`)
    to the config's precision and the device its ``trainer.accelerator`` (or ``accelerator``) gives
    here, after the layers' own ``kernels``: ``torch`` is the chunked path, and ``fla`` on a CUDA
    device that is not this machine's (none here) is fla's kernels, installed there as the config
    asks (on this machine's own GPU the test decides: a layer asking for fla falls back where it
    cannot run). ``fla`` and ``torch`` force a path.
    """
    if gdp_kernels == "fla":
        return True, "fla's kernels (--gdp_kernels fla)"
    if gdp_kernels == "torch":
        return False, "the PyTorch chunked path (--gdp_kernels torch)"
    precision = lightning_precision((config.get("trainer") or {}).get("precision") or "32-true")
    device = accelerator_type(config, accelerator)
    asked = _gdp_kernels_asked(config)
    if asked == "torch":
        return False, "the PyTorch chunked path (the config's GDP layers ask for it: kernels: torch)"
    if asked == "fla" and device == "cuda" and half_precision(precision) and not torch.cuda.is_available():
        return True, (
            "fla's kernels (the config's GDP layers ask for them, kernels: fla, on a CUDA device that is not this "
            "machine's: fla is taken to be installed there)"
        )
    fla, why = gdp_path(precision, device)
    return fla, why if fla else f"{why}; --gdp_kernels fla estimates a CUDA run with fla"


def target_of_config(
    config: dict[str, Any],
    world_size: int,
    strategy: Optional[str] = None,
    gdp_kernels: str = "auto",
    cpu_offload: Optional[bool] = None,
    accelerator: Optional[str] = None,
) -> Target:
    """The :class:`~elr_lightning.estimate.memory.Target` of a merged ``elr fit`` config on ``world_size`` ranks.

    Args:
        config: The merged config.
        world_size: Devices x nodes.
        strategy: ``single``, ``ddp`` or ``fsdp`` instead of the config's ``trainer.strategy``.
        gdp_kernels: What the GDP layers run: ``fla`` (fla's kernels, as on a CUDA device with
            fla installed), ``torch`` (the PyTorch chunked path), or ``auto``: what ``elr fit`` would
            run here (:func:`gdp_choice`).
        cpu_offload: FSDP2's CPU offload instead of the strategy's ``init_args.cpu_offload``.
        accelerator: ``cpu``, ``gpu``, ``auto`` instead of ``trainer.accelerator`` (:func:`accelerator_type`).

    Raises:
        ValueError: A bad flag or a config value the estimate does not cover, naming it.
    """
    trainer = config.get("trainer") or {}
    if strategy is not None and strategy not in STRATEGIES:
        raise ValueError(f"--strategy {strategy!r} must be one of {', '.join(STRATEGIES)}")
    kind, init_args = _strategy_kind(trainer.get("strategy"), world_size)
    if strategy is not None and strategy != kind:
        kind, init_args = strategy, {}
    if gdp_kernels not in ("auto", "fla", "torch"):
        raise ValueError(f"--gdp_kernels {gdp_kernels!r} must be auto, fla or torch")
    clip = trainer.get("gradient_clip_val")
    if trainer.get("gradient_clip_algorithm") == "value":
        clip = None  # clipping by value is in place: no memory
    precision = lightning_precision(trainer.get("precision") or "32-true")
    accumulate = trainer.get("accumulate_grad_batches") or 1
    offload = bool(init_args.get("cpu_offload", False)) if kind == "fsdp" else False
    if cpu_offload is not None:
        if cpu_offload and kind != "fsdp":
            raise ValueError(
                f"--cpu_offload is FSDP2's and this run is {kind}; pass --strategy fsdp too "
                "(elr_lightning.strategies.OneLoopOverrideFSDPStrategy)"
            )
        offload = cpu_offload
    return Target(
        strategy=kind,
        world_size=world_size,
        precision=precision,
        gradient_clip_val=float(clip) if clip else None,
        gradient_as_bucket_view=bool(init_args.get("gradient_as_bucket_view", False)),
        reshard_after_forward=bool(init_args.get("reshard_after_forward", True)),
        fla_kernels=gdp_choice(config, gdp_kernels, accelerator)[0],
        recurrent_units=str(init_args.get("recurrent_units", "layer")) if kind == "fsdp" else "layer",
        accumulate_grad_batches=positive_count(accumulate, "trainer.accumulate_grad_batches"),
        cpu_offload=offload,
        accelerator=accelerator_type(config, accelerator),
    )


def geometry_of_config(config: dict[str, Any], micro_batch: Optional[int], seq_len: Optional[int]) -> tuple[int, int]:
    """``(micro_batch, seq_len)``: the flags, else ``data.init_args.batch_size`` and ``seq_len``.

    Raises:
        ValueError: Neither gives a value, or one is not an integer >= 1.
    """
    data = (config.get("data") or {}).get("init_args") or {}
    values = []
    for flag, value, key in (("--micro_batch", micro_batch, "batch_size"), ("--seq_len", seq_len, "seq_len")):
        if value is None:
            if data.get(key) is None:
                raise ValueError(f"the config has no data.init_args.{key}; pass {flag}")
            value = data[key]
            flag = f"data.init_args.{key}"
        values.append(positive_count(value, flag))
    return values[0], values[1]


def meta_builder(config: dict[str, Any], path: str, conditioning: bool = True) -> Callable[[], ELRModule]:
    """A function that builds the config's module on the meta device, conditioning on or off.

    Raises (when called):
        ValueError: The model cannot be built, naming the config and the cause.
    """

    def build() -> ELRModule:
        try:
            module = build_module(config)
        except Exception as err:  # noqa: BLE001 - any failure means the config's model cannot be built
            cause = " ".join(str(root_cause(err)).split())
            raise ValueError(f"--config {path}: the model cannot be built: {cause}") from None
        if module.model.conditioner is not None and not conditioning:
            module.model.conditioner.set_active(False)
        return module

    return build



def has_gdp(arch: dict[str, Any]) -> bool:
    """Whether a config's ``arch`` names a Gated DeltaProduct mixer."""
    return any("GatedDeltaProduct" in str((spec or {}).get("class_path", "")) for spec in (arch.get("mixers") or {}).values())


def has_moe(arch: dict[str, Any]) -> bool:
    """Whether a config's ``arch`` names a mixture-of-experts mixer (whose step the fast path does not extrapolate in k)."""
    return any(str((spec or {}).get("class_path", "")).rsplit(".", 1)[-1] == "MoE" for spec in (arch.get("mixers") or {}).values())



__all__ = [
    "accelerator_type",
    "gdp_choice",
    "geometry_of_config",
    "has_gdp",
    "has_moe",
    "layout_of_config",
    "meta_builder",
    "target_of_config",
]
