"""``elr estimate``: per-rank peak training memory of a config for every k and backward setting, the
largest micro-batch that fits a device, and a verdict.

``elr estimate --config config/4b.yaml --devices 8 --strategy fsdp --device_memory 80GB`` prints the
table. The numbers come from :mod:`elr_lightning.estimate` (one training step traced on fake
tensors); this module reads the run's settings from the config, builds the rows and formats them.
:mod:`elr_lightning.estimate_fit` reads them from a live trainer instead, for ``elr fit``.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional, TextIO, Union

import torch

from elr_lightning.arguments import CommandParser, add_loops, add_switch, command_parser
from elr_lightning.core import CHECKPOINTING
from elr_lightning.cost import build_module, merged_config
from elr_lightning.errors import root_cause
from elr_lightning.estimate import (
    CPU_HEADROOM,
    STRATEGIES,
    Setting,
    StepMemory,
    Target,
    default_headroom,
    fake_training,
    gdp_path,
    half_precision,
    largest_fitting,
    lightning_precision,
)
from elr_lightning.module import ELRModule


#: Rows of the table: a name and its ``(activation_checkpointing, backprop_loops)``; ``None`` keeps the config's.
MODES: dict[str, tuple[str, Optional[int]]] = {"none": ("none", None), "loop": ("loop", None), "layer": ("layer", None), "bp1": ("none", 1)}

#: ``--device_memory`` of a GPU config estimated on a machine without a GPU: an "80 GB" accelerator.
DEFAULT_DEVICE_MEMORY = 80 * 10**9

_GIB = 2**30
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(text: Union[str, int], flag: str = "--device_memory") -> int:
    """Bytes of a size such as ``80GB`` (10^9 bytes), ``79.6GiB`` (2^30), ``512MiB`` or ``1e9B``.

    Raises:
        ValueError: Naming ``flag``, the value and the accepted form.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]?i?b)\s*", str(text), flags=re.IGNORECASE)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"{flag} {text!r} is not a memory size; give a number and a unit, e.g. 80GB or 79.6GiB")
    return int(float(match.group(1)) * _UNITS[unit])


def detected_device_memory(accelerator: Any) -> tuple[int, str]:
    """Memory of one device of a run on ``trainer.accelerator``, and where the figure comes from.

    The CPU (``cpu``, or ``auto`` on a machine without a GPU) has this machine's RAM; a GPU run has
    the memory of this machine's first GPU, or :data:`DEFAULT_DEVICE_MEMORY` when it has none.
    """
    name = str(accelerator or "auto").lower()
    gpu = torch.cuda.is_available()
    if name == "cpu" or (name == "auto" and not gpu):
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), f"this machine's RAM (trainer.accelerator {name})"
        except (AttributeError, ValueError, OSError):  # no sysconf (Windows)
            return DEFAULT_DEVICE_MEMORY, "assumed: this machine's RAM is unknown; pass --device_memory"
    if gpu:
        return torch.cuda.get_device_properties(0).total_memory, f"GPU 0 of this machine ({torch.cuda.get_device_name(0)})"
    return DEFAULT_DEVICE_MEMORY, f"assumed: trainer.accelerator {name} and no GPU here; pass --device_memory"


def detected_host_memory(device_type: str) -> tuple[Optional[int], str]:
    """RAM of one node of a run on ``device_type`` devices, for its offloaded state, and where the figure comes from.

    A GPU run estimated on a machine with a GPU is taken to run here: this machine's RAM. Elsewhere
    the node is not known and the host memory is not checked (``None``). A CPU run's host is its
    device.
    """
    if device_type == "cpu":
        return None, "the device: a CPU run's offloaded state is in the same RAM"
    if torch.cuda.is_available():
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's RAM"
        except (AttributeError, ValueError, OSError):
            pass
    return None, "not checked: pass --host_memory (RAM per node)"


def _count(value: Any, flag: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{flag} {value!r} must be an integer >= 1")
    return value


def device_count(devices: Any) -> int:
    """Devices per node of a ``trainer.devices`` value: a count, ``"auto"``/``-1`` (this machine's GPUs, else 1),
    ``"0,1"`` or a list of ids."""
    if isinstance(devices, (list, tuple)):
        return max(1, len(devices))
    text = str(devices).strip()
    if text in ("auto", "-1", "None"):
        return max(1, torch.cuda.device_count())
    if "," in text:
        return len([part for part in text.split(",") if part.strip()])
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise ValueError(f"trainer.devices={devices!r}: give --devices N (devices per node)")


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
    devices = _count(devices, "--devices") if devices is not None else device_count(trainer.get("devices", "auto"))
    nodes = num_nodes if num_nodes is not None else trainer.get("num_nodes") or 1
    return devices, _count(nodes, "--num_nodes" if num_nodes is not None else "trainer.num_nodes")


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

    ``auto`` applies the test the layers apply in ``elr fit`` (:func:`~elr_lightning.estimate.gdp_path`)
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
    """The :class:`~elr_lightning.estimate.Target` of a merged ``elr fit`` config on ``world_size`` ranks.

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
        accumulate_grad_batches=_count(accumulate, "trainer.accumulate_grad_batches"),
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
        values.append(_count(value, flag))
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


def _row(setting: Setting, memory: StepMemory) -> dict[str, Any]:
    return {
        "loops": setting.loops,
        "mode": setting.label,
        "activation_checkpointing": setting.checkpointing,
        "backprop_loops": setting.backprop_loops,
        "micro_batch": setting.micro_batch,
        "seq_len": setting.seq_len,
        **memory.as_dict(),
    }


def _progress(stream: Optional[TextIO]) -> Callable[[str], None]:
    return (lambda line: print(f"elr estimate: {line}", file=stream, flush=True)) if stream is not None else (lambda line: None)


@dataclasses.dataclass(frozen=True)
class Budget:
    """What a step may use: bytes per rank of the device, and of host memory per node for offloaded state.

    Attributes:
        device: Bytes of one device a rank's step may use (its memory less the headroom).
        host: Bytes of one node's RAM its ranks' offloaded state may use (less :data:`~elr_lightning.estimate.CPU_HEADROOM`),
            ``None``: not checked.
        ranks_per_node: Ranks sharing one node's RAM.
        shared: The host is the device (a CPU run): a row's host bytes count against :attr:`device`.
    """

    device: int
    host: Optional[int] = None
    ranks_per_node: int = 1
    shared: bool = False

    def need(self, row: dict[str, Any]) -> int:
        """Device bytes of a row (a :class:`~elr_lightning.estimate.StepMemory` as a dict): its peak, plus its host
        bytes where the host is the device (an upper bound: the two peaks may come at different moments)."""
        return row["peak"] + (row.get("host", 0) if self.shared else 0)

    def host_fits(self, row: dict[str, Any]) -> bool:
        """Whether the node's ranks' offloaded state fits its RAM (``True`` where not checked)."""
        return self.shared or self.host is None or row.get("host", 0) * self.ranks_per_node <= self.host

    def fits(self, row: dict[str, Any]) -> bool:
        """Whether a row fits the device and the host."""
        return self.need(row) <= self.device and self.host_fits(row)

    def score(self, row: dict[str, Any]) -> int:
        """:meth:`need`, or more than :attr:`device` where the host does not fit (for the micro-batch search)."""
        return self.need(row) if self.host_fits(row) else self.device + 1 + self.need(row)


def memory_report(
    paths: Union[str, Sequence[str]],
    devices: Optional[int] = None,
    num_nodes: Optional[int] = None,
    strategy: Optional[str] = None,
    device_memory: Optional[Union[str, int]] = None,
    headroom: Optional[float] = None,
    micro_batch: Optional[int] = None,
    seq_len: Optional[int] = None,
    loops: Optional[Sequence[int]] = None,
    modes: Sequence[str] = ("none", "loop", "layer"),
    search: bool = True,
    conditioning: bool = True,
    gdp_kernels: str = "auto",
    activation_checkpointing: Optional[str] = None,
    backprop_loops: Optional[int] = None,
    progress: Optional[TextIO] = None,
    accelerator: Optional[str] = None,
    cpu_offload: Optional[bool] = None,
    host_memory: Optional[Union[str, int]] = None,
) -> dict[str, Any]:
    """The estimate table of one or more merged config files, with the micro-batch search and the verdicts.

    Besides the configured step (every shard at k = K under the run's own checkpointing) the report
    names, for every k of the rows, the first of ``modes`` whose step fits at the configured
    micro-batch, else (with ``search``) the largest micro-batch that fits under the mode with the
    smallest footprint at that k (``per_k``).

    Args:
        paths: ``elr fit`` YAML files, merged as ``elr fit`` merges them.
        devices: Devices per node (default: ``trainer.devices``).
        num_nodes: Nodes (default: ``trainer.num_nodes``).
        strategy: ``single``, ``ddp`` or ``fsdp`` instead of the config's ``trainer.strategy``.
        device_memory: Memory of one device (``"80GB"``, bytes); default: :func:`detected_device_memory`
            of the config's ``trainer.accelerator``.
        headroom: Fraction of ``device_memory`` held back for what the trace does not see; default:
            :func:`~elr_lightning.estimate.default_headroom` of the device (25% of CPU RAM, 10% of an
            accelerator's memory).
        micro_batch: Sequences per rank per step (default: ``data.init_args.batch_size``).
        seq_len: Tokens per sequence (default: ``data.init_args.seq_len``).
        loops: Loop counts of the rows (default: 1..K).
        modes: Backward settings of the rows, names of :data:`MODES`, lightest recomputation first
            (the per-k verdict takes the first that fits).
        search: Search the largest micro-batch that fits (a few more traced steps).
        conditioning: Eq. 4 conditioning on (as after the delayed switch) or off.
        gdp_kernels: ``auto``, ``fla`` or ``torch`` (:func:`target_of_config`).
        activation_checkpointing: The run's setting instead of ``model.init_args.activation_checkpointing``:
            the verdict and the micro-batch search are about the run's setting at k = K.
        backprop_loops: The run's setting instead of ``model.init_args.backprop_loops``.
        progress: Where to print a line per traced step (``None``: nowhere).
        accelerator: ``cpu``, ``gpu`` or ``auto`` instead of ``trainer.accelerator``: the device the
            run trains on, which sets the default headroom and the GDP path.
        cpu_offload: FSDP2's CPU offload instead of the strategy's ``init_args.cpu_offload``.
        host_memory: RAM of one node (``"2TB"``) that its ranks' offloaded state must fit, less 25%;
            default: :func:`detected_host_memory`.

    Raises:
        ValueError: A bad flag or config value, naming it and the fix.
    """
    paths = [paths] if isinstance(paths, str) else list(paths)
    path = " + ".join(paths)
    for name in modes:
        if name not in MODES:
            raise ValueError(f"--modes {name!r} is not a mode; use some of {', '.join(MODES)}")
    if headroom is not None and not 0 <= headroom < 1:
        raise ValueError(f"--headroom {headroom} must be in [0, 1): the fraction of device memory held back")
    config = merged_config(paths)
    device_type = accelerator_type(config, accelerator)
    if device_memory is not None:
        memory, source = parse_memory(device_memory), "--device_memory"
    else:
        memory, source = detected_device_memory(accelerator or (config.get("trainer") or {}).get("accelerator"))
    if headroom is None:
        headroom, headroom_source = default_headroom(device_type)
    else:
        headroom_source = "--headroom"
    devices, nodes = layout_of_config(config, devices, num_nodes)
    target = target_of_config(config, devices * nodes, strategy, gdp_kernels, cpu_offload, accelerator)
    batch, length = geometry_of_config(config, micro_batch, seq_len)
    args = config["model"].get("init_args") or {}
    arch = args.get("arch") or {}
    k_max = int(arch.get("max_loops", 4))
    loops = list(range(1, k_max + 1)) if loops is None else [_count(k, "--loops") for k in loops]
    own = (
        activation_checkpointing or args.get("activation_checkpointing") or "none",
        backprop_loops if backprop_loops is not None else args.get("backprop_loops"),
    )
    if own[0] not in CHECKPOINTING:
        raise ValueError(f"--activation_checkpointing {own[0]!r} must be one of {', '.join(CHECKPOINTING)}")
    if own[1] is not None:
        _count(own[1], "--backprop_loops")
    virtual_ranks = int(args.get("virtual_ranks") or 1)
    if batch < virtual_ranks:
        raise ValueError(
            f"micro-batch {batch} is smaller than model.init_args.virtual_ranks={virtual_ranks}; every shard needs "
            "a sequence: raise --micro_batch"
        )
    if host_memory is not None:
        host, host_source = parse_memory(host_memory, "--host_memory"), "--host_memory"
    else:
        host, host_source = detected_host_memory(device_type)
    budget = Budget(
        device=int(memory * (1 - headroom)),
        host=int(host * (1 - CPU_HEADROOM)) if host is not None and target.cpu_offload else None,
        ranks_per_node=devices,
        shared=target.cpu_offload and device_type == "cpu",
    )
    say = _progress(progress)

    settings = []
    for k in loops:
        for name in modes:
            checkpointing, backprop = MODES[name]
            settings.append(Setting(k, checkpointing, backprop if name == "bp1" else own[1], batch, length))
    configured = Setting(k_max, own[0], own[1], batch, length)  # the run's worst step: every shard at K
    results: dict[Setting, StepMemory] = {}
    with fake_training(meta_builder(config, path, conditioning), target) as trace:

        def traced(setting: Setting) -> dict[str, Any]:
            if setting not in results:
                start = time.perf_counter()
                results[setting] = trace(setting)
                host_part = f", host {results[setting].host / _GIB:.2f} GiB" if target.cpu_offload else ""
                say(
                    f"k={setting.loops} {setting.label} micro-batch {setting.micro_batch}: "
                    f"{results[setting].peak / _GIB:.2f} GiB{host_part} ({time.perf_counter() - start:.0f} s)"
                )
            return _row(setting, results[setting])

        rows = [traced(s) for s in settings]
        traced(configured)
        largest = None
        if search:
            largest = largest_fitting(
                lambda b: budget.score(traced(dataclasses.replace(configured, micro_batch=b))), budget.device, batch,
                virtual_ranks,
            )
        per_k = [_fitting_at(k, [row for row, s in zip(rows, settings) if s.loops == k], settings, budget, traced,
                             search, virtual_ranks) for k in loops]  # fmt: skip
    report: dict[str, Any] = {
        "config": path,
        "target": {**dataclasses.asdict(target), "devices": devices, "num_nodes": nodes},
        "micro_batch": batch,
        "seq_len": length,
        "virtual_ranks": virtual_ranks,
        "conditioning": conditioning,
        "device_type": device_type,
        "device_memory": memory,
        "device_memory_source": source,
        "headroom": headroom,
        "headroom_source": headroom_source,
        "host_memory": host,
        "host_memory_source": host_source,
        "gdp_path": gdp_choice(config, gdp_kernels, accelerator)[1] if _has_gdp(arch) else None,
        "not_modelled": ["compile_model: the eager step was traced"] if args.get("compile_model") else [],
        "budget": budget.device,
        "host_budget": budget.host,
        "rows": rows,
        "configured": _row(configured, results[configured]),
        "largest_micro_batch": largest,
        "per_k": per_k,
    }
    report["verdict"] = verdict(report, budget, search)
    report["per_k_verdict"] = per_k_verdict(report, budget)
    return report


def _fitting_at(
    k: int,
    rows: list[dict[str, Any]],
    settings: list[Setting],
    budget: Budget,
    traced: Callable[[Setting], dict[str, Any]],
    search: bool,
    minimum: int,
) -> dict[str, Any]:
    """The first of ``rows`` (one k, in the order of the modes) that fits, else the largest micro-batch that fits
    under the row with the smallest footprint; ``micro_batch`` ``None`` where nothing fits."""
    for row in rows:
        if budget.fits(row):
            return row
    lightest = min(rows, key=budget.score)
    if search:
        setting = next(s for s in settings if s.loops == k and s.label == lightest["mode"])
        found = largest_fitting(
            lambda b: budget.score(traced(dataclasses.replace(setting, micro_batch=b))), budget.device,
            setting.micro_batch, minimum,
        )  # fmt: skip
        if found is not None:
            return traced(dataclasses.replace(setting, micro_batch=found))
    return {**lightest, "micro_batch": None}


def _has_gdp(arch: dict[str, Any]) -> bool:
    """Whether a config's ``arch`` names a Gated DeltaProduct mixer."""
    return any("GatedDeltaProduct" in str((spec or {}).get("class_path", "")) for spec in (arch.get("mixers") or {}).values())


def verdict(report: dict[str, Any], budget: Budget, searched: bool = True) -> str:
    """One line: whether the configured step fits the budget, what fits instead, and the largest micro-batch."""
    conf = report["configured"]
    what = f"k = {conf['loops']}, {conf['mode']}, micro-batch {conf['micro_batch']} x {conf['seq_len']} tokens"
    largest = report.get("largest_micro_batch")
    tail = ""
    if searched:
        tail = f"; micro-batches up to {largest} fit" if largest is not None else "; no micro-batch fits"
    if budget.fits(conf):
        return (
            f"fits: the configured step ({what}) peaks at {budget.need(conf) / _GIB:.1f} GiB per rank of a "
            f"{budget.device / _GIB:.1f} GiB budget{tail}"
        )
    alternatives = [
        f"{row['mode']} ({budget.need(row) / _GIB:.1f} GiB)"
        for row in report["rows"]
        if row["loops"] == conf["loops"] and row["micro_batch"] == conf["micro_batch"] and budget.fits(row)
    ]
    instead = f"; at k = {conf['loops']} {' or '.join(alternatives)} fit{'s' if len(alternatives) == 1 else ''}" if alternatives else ""
    over = "" if budget.host_fits(conf) else " and its offloaded state exceeds the host's budget"
    return (
        f"does not fit: the configured step ({what}) peaks at {budget.need(conf) / _GIB:.1f} GiB per rank, over the "
        f"{budget.device / _GIB:.1f} GiB budget{over}{instead}{tail}"
    )


def per_k_verdict(report: dict[str, Any], budget: Budget) -> str:
    """One line: for every k of the rows, the mode and micro-batch that fit (``report["per_k"]``), and the host
    memory an offloaded run needs per node."""
    entries = report["per_k"]
    missing = [str(e["loops"]) for e in entries if e["micro_batch"] is None]
    parts = [
        f"k = {e['loops']} {e['mode']} at micro-batch {e['micro_batch']} ({budget.need(e) / _GIB:.1f} GiB)"
        for e in entries
        if e["micro_batch"] is not None
    ]
    if not missing:
        head = "every k fits: " if len(entries) > 1 else "fits: "
    else:
        head = f"k = {', '.join(missing)} fit{'s' if len(missing) == 1 else ''} no mode and micro-batch"
        head += "; " if parts else ""
    line = head + ", ".join(parts)
    target = report["target"]
    if target["cpu_offload"] and not budget.shared:
        host = max(e["host"] for e in entries)
        need = host * budget.ranks_per_node
        if budget.host is None:
            check = report["host_memory_source"]
        else:
            check = f"{'within' if need <= budget.host else 'over'} {budget.host / _GIB:.0f} GiB, 75% of {report['host_memory_source']}"
        line += (
            f"; offloaded state in host memory: {budget.ranks_per_node} ranks x {host / _GIB:.1f} GiB = "
            f"{need / _GIB:.0f} GiB per node ({check})"
        )
    elif missing and target["strategy"] == "fsdp" and report["device_type"] != "cpu":
        line += "; --cpu_offload estimates FSDP2's CPU offload (state in host memory)"
    return line


def format_memory_report(report: dict[str, Any]) -> str:
    """The report as a table in GiB."""
    target = report["target"]
    strategy = {"single": "one device", "ddp": "DDP", "fsdp": "FSDP2"}[target["strategy"]]
    if target["strategy"] == "fsdp":
        strategy += f" (recurrent block sharded by {target['recurrent_units']})"
    offloaded = target["cpu_offload"]
    accumulate = target["accumulate_grad_batches"]
    lines = [
        f"config: {report['config']}",
        f"run: {strategy} over {target['world_size']} {report['device_type']} rank(s) ({target['num_nodes']} node(s) x "
        f"{target['devices']}), {target['precision']}, "
        f"micro-batch {report['micro_batch']} x {report['seq_len']} tokens per rank in {report['virtual_ranks']} "
        f"shard(s)" + (f", {accumulate} micro-batches per step (gradients kept across them)" if accumulate > 1 else "")
        + f", eq. 4 conditioning {'on' if report['conditioning'] else 'off'}",
        *([f"GDP layers: {report['gdp_path']}"] if report.get("gdp_path") else []),
        *(
            [
                "cpu_offload: parameter and gradient shards and AdamW's state in host memory (the host column; "
                + ("pinned, in power-of-two blocks" if report["device_type"] != "cpu" else "on the CPU the host is the device")
                + "), the optimizer step on the CPU; the device holds the gathered units and the activations"
            ]
            if offloaded
            else []
        ),
        *(f"not modelled: {item}" for item in report.get("not_modelled", [])),
        f"device memory {report['device_memory'] / 1e9:.1f} GB ({report['device_memory'] / _GIB:.1f} GiB, "
        f"{report['device_memory_source']}) less {report['headroom']:.0%} headroom ({report['headroom_source']}): "
        f"budget {report['budget'] / _GIB:.1f} GiB per rank",
        "per-rank peak of one training step (every local shard at k), GiB; what is alive at the peak:",
        f"{'k':>4}  {'mode':<10}{'mb':>4}{'params':>9}{'grads':>9}{'optimizer':>11}{'activations':>13}{'peak':>9}"
        + (f"{'host':>9}" if offloaded else ""),
    ]
    for row in report["rows"]:
        lines.append(
            f"{row['loops']:>4}  {row['mode']:<10}{row['micro_batch']:>4}{row['params'] / _GIB:>9.2f}"
            f"{row['grads'] / _GIB:>9.2f}{row['optimizer'] / _GIB:>11.2f}{row['activations'] / _GIB:>13.2f}"
            f"{row['peak'] / _GIB:>9.2f}" + (f"{row['host'] / _GIB:>9.2f}" if offloaded else "")
        )
    lines.append(f"verdict: {report['verdict']}")
    lines.append(f"per k: {report['per_k_verdict']}")
    return "\n".join(lines)


def estimate_parser() -> CommandParser:
    """The parser of ``elr estimate``."""
    parser = command_parser(
        "estimate",
        "Per-rank peak memory of one training step of a config, for every k and backward setting, traced on fake "
        "tensors (nothing is allocated).",
    )
    parser.add_argument("--config", type=str, action="append", required=True, help="An `elr fit` YAML file; repeat to merge.")
    parser.add_argument("--devices", type=Optional[int], default=None, help="Devices per node (default: trainer.devices).")
    parser.add_argument("--num_nodes", type=Optional[int], default=None, help="Nodes (default: trainer.num_nodes).")
    parser.add_argument(
        "--strategy", type=Optional[str], default=None, help="single, ddp or fsdp instead of the config's trainer.strategy."
    )
    parser.add_argument(
        "--device_memory", type=Optional[str], default=None,
        help="Memory per device, e.g. 80GB or 79.6GiB; default: this machine's RAM for a CPU config, its first GPU's "
        "memory for a GPU one (80GB assumed without a GPU).",
    )  # fmt: skip
    parser.add_argument(
        "--headroom", type=Optional[float], default=None,
        help="Fraction of device memory held back; default 0.25 of CPU RAM (what glibc keeps), 0.10 of a GPU's "
        "(context, NCCL, caching allocator).",
    )  # fmt: skip
    parser.add_argument("--accelerator", type=Optional[str], default=None, help="cpu, gpu or auto: the run's device.")
    add_switch(parser, "--cpu_offload", None, "FSDP2's CPU offload instead of the strategy's init_args.cpu_offload.")
    parser.add_argument(
        "--host_memory", type=Optional[str], default=None,
        help="RAM per node for offloaded state, e.g. 2TB; default: this machine's where it has the GPU, else not checked.",
    )  # fmt: skip
    parser.add_argument("--micro_batch", type=Optional[int], default=None, help="Sequences per rank (default: data.batch_size).")
    parser.add_argument("--seq_len", type=Optional[int], default=None, help="Tokens per sequence (default: data.seq_len).")
    add_loops(parser, "Loop counts of the rows; default 1..K")
    parser.add_argument("--modes", type=str, default="none,loop,layer", help=f"Rows' backward settings, some of {','.join(MODES)}.")
    parser.legacy_lists.add("--modes")
    add_switch(parser, "--search", True, "Search the largest micro-batch that fits.", was_bool=True)
    add_switch(parser, "--conditioning", True, "Eq. 4 conditioning on (after the switch) or off.", was_bool=True)
    parser.add_argument(
        "--gdp_kernels", type=str, default="auto",
        help="GDP layers: fla (its kernels, as on a GPU), torch (chunked path), auto (fla in half precision).",
    )  # fmt: skip
    parser.add_argument(
        "--activation_checkpointing", type=Optional[str], default=None,
        help="The run's none, loop or layer instead of the config's (the verdict and search are about it).",
    )  # fmt: skip
    parser.add_argument("--backprop_loops", type=Optional[int], default=None, help="The run's instead of the config's.")
    add_switch(parser, "--json", False, "Print JSON instead of a table.", was_bool=True)
    return parser


def main(argv: list[str]) -> None:
    """``elr estimate --config FILE [--devices N] [--num_nodes M] [--device_memory 80GB] [--micro_batch B] [--json]``."""
    args = estimate_parser().parse_args(argv)
    report = memory_report(
        args.config,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=args.strategy,
        device_memory=args.device_memory,
        headroom=args.headroom,
        micro_batch=args.micro_batch,
        seq_len=args.seq_len,
        loops=None if args.loops is None else list(args.loops.counts),
        modes=[mode.strip() for mode in args.modes.split(",") if mode.strip()],
        search=args.search,
        conditioning=args.conditioning,
        gdp_kernels=args.gdp_kernels,
        activation_checkpointing=args.activation_checkpointing,
        backprop_loops=args.backprop_loops,
        progress=sys.stderr,
        accelerator=args.accelerator,
        cpu_offload=args.cpu_offload,
        host_memory=args.host_memory,
    )
    print(json.dumps(report, indent=2) if args.json else format_memory_report(report))


__all__ = [
    "MODES",
    "Budget",
    "detected_device_memory",
    "detected_host_memory",
    "estimate_parser",
    "format_memory_report",
    "layout_of_config",
    "main",
    "memory_report",
    "parse_memory",
    "per_k_verdict",
    "target_of_config",
    "verdict",
]
