"""``elr estimate``: per-rank peak training memory of a config for every k and backward setting, the
largest micro-batch that fits a device, and a verdict.

``elr estimate --config config/4b.yaml --devices 8 --device_memory 80GB`` prints the table. The numbers
come from :mod:`elr_lightning.estimate.memory` (one training step traced on fake tensors), on the fast path
for k past 4 extrapolated from the traced k = 3 and 4 (:mod:`elr_lightning.estimate.steps`); this module
builds the rows from the config's run (:mod:`elr_lightning.estimate.target`) and formats them, and
:mod:`elr_lightning.estimate.budget` says what fits. :mod:`elr_lightning.estimate.fit` reads the run from a
live trainer instead, for ``elr fit``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional, TextIO, Union

from elr_lightning.core import CHECKPOINTING
from elr_lightning.estimate.budget import Budget, per_k_verdict, verdict
from elr_lightning.estimate.cache import TraceCache
from elr_lightning.estimate.hardware import detected_device_memory, detected_host_memory, parse_memory, positive_count
from elr_lightning.estimate.memory import (
    CPU_HEADROOM,
    Setting,
    StepMemory,
    Target,
    default_headroom,
    fake_training,
)
from elr_lightning.estimate.search import fitting_at, largest_micro_batch, table_row
from elr_lightning.estimate.steps import Steps, extrapolates
from elr_lightning.estimate.workers import traced_in_workers
from elr_lightning.estimate.target import (
    accelerator_type,
    gdp_choice,
    geometry_of_config,
    has_gdp,
    has_moe,
    layout_of_config,
    meta_builder,
    target_of_config,
)
from elr_lightning.lightning_cli import merged_config

#: Rows of the table: a name and its ``(activation_checkpointing, backprop_loops)``; ``None`` keeps the config's.
MODES: dict[str, tuple[str, Optional[int]]] = {"none": ("none", None), "loop": ("loop", None), "layer": ("layer", None), "bp1": ("none", 1)}

_GIB = 2**30


def _progress(stream: Optional[TextIO]) -> Callable[[str], None]:
    return (lambda line: print(f"elr estimate: {line}", file=stream, flush=True)) if stream is not None else (lambda line: None)


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
    exact: bool = False,
    workers: int = 1,
    cache_dir: Optional[Union[str, Path]] = None,
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
        device_memory: Memory of one device (``"80GB"``, bytes); default: :func:`~elr_lightning.estimate.hardware.detected_device_memory`
            of the config's ``trainer.accelerator``.
        headroom: Fraction of ``device_memory`` held back for what the trace does not see; default:
            :func:`~elr_lightning.estimate.memory.default_headroom` of the device (25% of CPU RAM, 10% of an
            accelerator's memory).
        micro_batch: Sequences per rank per step (default: ``data.init_args.batch_size``).
        seq_len: Tokens per sequence (default: ``data.init_args.seq_len``).
        loops: Loop counts of the rows (default: 1..K).
        modes: Backward settings of the rows, names of :data:`MODES`, lightest recomputation first
            (the per-k verdict takes the first that fits).
        search: Search the largest micro-batch that fits (a few more traced steps).
        conditioning: Eq. 4 conditioning on (as after the delayed switch) or off.
        gdp_kernels: ``auto``, ``fla`` or ``torch`` (:func:`~elr_lightning.estimate.target.target_of_config`).
        activation_checkpointing: The run's setting instead of ``model.init_args.activation_checkpointing``:
            the verdict and the micro-batch search are about the run's setting at k = K.
        backprop_loops: The run's setting instead of ``model.init_args.backprop_loops``.
        progress: Where to print a line per traced step with the expected time left (``None``: nowhere).
        accelerator: ``cpu``, ``gpu`` or ``auto`` instead of ``trainer.accelerator``: the device the
            run trains on, which sets the default headroom and the GDP path.
        cpu_offload: FSDP2's CPU offload instead of the strategy's ``init_args.cpu_offload``.
        host_memory: RAM of one node (``"2TB"``) that its ranks' offloaded state must fit, less 25%;
            default: :func:`~elr_lightning.estimate.hardware.detected_host_memory`.
        exact: Trace every step (the full trace) instead of the fast path
            (:mod:`elr_lightning.estimate.steps`).
        workers: Processes tracing the table's steps at once (:mod:`elr_lightning.estimate.workers`); 1:
            this process alone.
        cache_dir: Where traced steps are kept for later runs (:mod:`elr_lightning.estimate.cache`); a step
            found there is not traced again. ``None``: no cache.

    Raises:
        ValueError: A bad flag or config value, naming it and the fix.
        EstimateInterrupted: Ctrl-C while tracing, holding the report of the rows known by then.
    """
    paths = [paths] if isinstance(paths, str) else list(paths)
    for name in modes:
        if name not in MODES:
            raise ValueError(f"--modes {name!r} is not a mode; use some of {', '.join(MODES)}")
    if headroom is not None and not 0 <= headroom < 1:
        raise ValueError(f"--headroom {headroom} must be in [0, 1): the fraction of device memory held back")
    config = merged_config(paths)
    run = _Run.of(
        config, " + ".join(paths), devices, num_nodes, strategy, device_memory, headroom, micro_batch, seq_len,
        activation_checkpointing, backprop_loops, gdp_kernels, accelerator, cpu_offload, host_memory,
    )  # fmt: skip
    k_max = int(run.arch.get("max_loops", 4))
    loops = list(range(1, k_max + 1)) if loops is None else [positive_count(k, "--loops") for k in loops]
    settings = []
    for k in loops:
        for name in modes:
            checkpointing, backprop = MODES[name]
            settings.append(Setting(k, checkpointing, backprop if name == "bp1" else run.own[1], run.batch, run.length))
    configured = Setting(k_max, run.own[0], run.own[1], run.batch, run.length)  # the run's worst step: every shard at K
    report = run.header(config, conditioning, gdp_kernels, accelerator)
    say = _progress(progress)
    moe = has_moe(run.arch)
    cache = None if cache_dir is None else TraceCache(Path(cache_dir), config["model"], conditioning, run.target, not exact)
    steps = Steps(
        lambda setting: trace(setting), exact, _trace_cost(run.arch, run.target), say,
        lambda setting: extrapolates(run.target, setting, moe), cache,
    )  # fmt: skip
    # the micro-batch search's first probe past the configured step (twice its micro-batch, at K) is known in
    # advance, and so are the sizes after the configured one and after that probe, which the search traces when it
    # settles on either (a config made to fit settles on the configured size or on its double): the workers trace
    # them beside the rows
    probes = [dataclasses.replace(configured, micro_batch=b) for b in (2 * run.batch, run.batch + 1, 2 * run.batch + 1)]
    steps.plan([*settings, configured], tuple(probes) if search else ())
    steps.load_cached()
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        traced: dict[str, Callable[[Setting], dict[str, StepMemory]]] = {}

        def trace(setting: Setting) -> dict[str, StepMemory]:
            remote = pool.trace(setting)
            if remote is not None:
                return remote
            if "trace" not in traced:  # the fake model is built the first time a step is not known already
                builder = meta_builder(config, run.path, conditioning)
                traced["trace"] = stack.enter_context(
                    fake_training(builder, run.target, phases=True, prior_grads=not exact, replay=not exact)
                )
            return traced["trace"](setting)

        try:
            pool = stack.enter_context(
                traced_in_workers(steps, workers, config, run.path, conditioning, run.target, prior_grads=not exact)
            )
            steps.ahead = pool.submit
            pool.collect()
            for setting in settings:
                rows.append(table_row(setting, steps(setting)))
            report["configured"] = table_row(configured, steps(configured))
            report["largest_micro_batch"] = (
                largest_micro_batch(steps, configured, run.budget, run.virtual_ranks) if search else None
            )
            report["per_k"] = [
                fitting_at(k, [row for row, s in zip(rows, settings) if s.loops == k], settings, run.budget, steps,
                            search, run.virtual_ranks) for k in loops
            ]  # fmt: skip
        except KeyboardInterrupt:
            known = [s for s in settings if all(t in steps.phases for t in steps.to_trace(s))]
            report["rows"] = rows if len(rows) >= len(known) else [table_row(s, steps(s)) for s in known]
            raise EstimateInterrupted(report) from None
    report["rows"] = rows
    report["cached"] = sorted(f"k={s.loops} {s.label} micro-batch {s.micro_batch}" for s in steps.cached)
    report["cache"] = None if cache is None else {"directory": str(cache.directory), "write_error": cache.write_error}
    report["extrapolated"] = sorted(f"k={s.loops} {s.label} micro-batch {s.micro_batch}" for s in steps.extrapolated)
    report["verdict"] = verdict(report, run.budget, search)
    report["per_k_verdict"] = per_k_verdict(report, run.budget)
    return report


class EstimateInterrupted(KeyboardInterrupt):
    """Ctrl-C during ``elr estimate``: :attr:`report` holds the configuration and the rows traced by then."""

    def __init__(self, report: dict[str, Any]) -> None:
        super().__init__("interrupted")
        self.report = report


@dataclasses.dataclass(frozen=True)
class _Run:
    """The run a report is about: the config's settings after the flags, and the budget."""

    path: str
    args: dict[str, Any]
    arch: dict[str, Any]
    target: Target
    devices: int
    nodes: int
    batch: int
    length: int
    own: tuple[str, Optional[int]]
    virtual_ranks: int
    device_type: str
    memory: int
    source: str
    headroom: float
    headroom_source: str
    host: Optional[int]
    host_source: str
    budget: Budget

    @classmethod
    def of(
        cls,
        config: dict[str, Any],
        path: str,
        devices: Optional[int],
        num_nodes: Optional[int],
        strategy: Optional[str],
        device_memory: Optional[Union[str, int]],
        headroom: Optional[float],
        micro_batch: Optional[int],
        seq_len: Optional[int],
        activation_checkpointing: Optional[str],
        backprop_loops: Optional[int],
        gdp_kernels: str,
        accelerator: Optional[str],
        cpu_offload: Optional[bool],
        host_memory: Optional[Union[str, int]],
    ) -> "_Run":
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
        own = (
            activation_checkpointing or args.get("activation_checkpointing") or "none",
            backprop_loops if backprop_loops is not None else args.get("backprop_loops"),
        )
        if own[0] not in CHECKPOINTING:
            raise ValueError(f"--activation_checkpointing {own[0]!r} must be one of {', '.join(CHECKPOINTING)}")
        if own[1] is not None:
            positive_count(own[1], "--backprop_loops")
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
        return cls(
            path, args, args.get("arch") or {}, target, devices, nodes, batch, length, own, virtual_ranks, device_type,
            memory, source, headroom, headroom_source, host, host_source, budget,
        )  # fmt: skip

    def header(self, config: dict[str, Any], conditioning: bool, gdp_kernels: str, accelerator: Optional[str]) -> dict[str, Any]:
        """The report's fields that need no trace."""
        return {
            "config": self.path,
            "target": {**dataclasses.asdict(self.target), "devices": self.devices, "num_nodes": self.nodes},
            "micro_batch": self.batch,
            "seq_len": self.length,
            "virtual_ranks": self.virtual_ranks,
            "conditioning": conditioning,
            "device_type": self.device_type,
            "device_memory": self.memory,
            "device_memory_source": self.source,
            "headroom": self.headroom,
            "headroom_source": self.headroom_source,
            "host_memory": self.host,
            "host_memory_source": self.host_source,
            "gdp_path": gdp_choice(config, gdp_kernels, accelerator)[1] if has_gdp(self.arch) else None,
            "not_modelled": ["compile_model: the eager step was traced"] if self.args.get("compile_model") else [],
            "budget": self.budget.device,
            "host_budget": self.budget.host,
        }


def _trace_cost(arch: dict[str, Any], target: Target) -> Callable[[Setting], float]:
    """The relative time of tracing a setting: layer calls of its passes (for the expected time left)."""
    n_in, n_rec, n_out = (int(arch.get(name) or 0) for name in ("n_in", "n_rec", "n_out"))
    passes = 2 if target.accumulate_grad_batches > 1 else 1

    def cost(setting: Setting) -> float:
        recompute = 1.5 if setting.checkpointing != "none" else 1.0
        return passes * recompute * (2 + n_in + n_out + setting.loops * n_rec)

    return cost


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
    for row in report.get("rows", []):
        lines.append(
            f"{row['loops']:>4}  {row['mode']:<10}{row['micro_batch']:>4}{row['params'] / _GIB:>9.2f}"
            f"{row['grads'] / _GIB:>9.2f}{row['optimizer'] / _GIB:>11.2f}{row['activations'] / _GIB:>13.2f}"
            f"{row['peak'] / _GIB:>9.2f}" + (f"{row['host'] / _GIB:>9.2f}" if offloaded else "")
        )
    if report.get("extrapolated"):
        lines.append(f"extrapolated in k from the traced k = 3 and 4 (--exact traces them): {', '.join(report['extrapolated'])}")
    cache = report.get("cache")
    if cache and report.get("cached"):
        lines.append(f"{len(report['cached'])} step(s) read from the cache {cache['directory']} (--no_cache traces them)")
    if cache and cache.get("write_error"):
        lines.append(f"the cache could not be written ({cache['write_error']}); set --cache_dir to a writable folder")
    if "verdict" in report:
        lines.append(f"verdict: {report['verdict']}")
        lines.append(f"per k: {report['per_k_verdict']}")
    else:
        lines.append("interrupted: the rows above are those traced so far")
    return "\n".join(lines)


__all__ = ["MODES", "EstimateInterrupted", "format_memory_report", "memory_report"]
