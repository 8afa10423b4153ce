"""What a step may use, and the verdict lines of ``elr estimate``: whether the configured step fits, what fits
at each k, and when nothing fits, the smallest change that does (more nodes, ``cpu_offload``, lighter
checkpointing, a smaller micro-batch)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

_GIB = 2**30

#: Nodes tried when the verdict looks for the smallest node count that fits at every k.
MAX_NODES = 4096


@dataclasses.dataclass(frozen=True)
class Budget:
    """What a step may use: bytes per rank of the device, and of host memory per node for offloaded state.

    Attributes:
        device: Bytes of one device a rank's step may use (its memory less the headroom).
        host: Bytes of one node's RAM its ranks' offloaded state may use (less
            :data:`~elr_lightning.estimate.memory.CPU_HEADROOM`), ``None``: not checked.
        ranks_per_node: Ranks sharing one node's RAM.
        shared: The host is the device (a CPU run): a row's host bytes count against :attr:`device`.
    """

    device: int
    host: Optional[int] = None
    ranks_per_node: int = 1
    shared: bool = False

    def need(self, row: dict[str, Any]) -> int:
        """Device bytes of a row (a :class:`~elr_lightning.estimate.memory.StepMemory` as a dict): its peak, plus its
        host bytes where the host is the device (an upper bound: the two peaks may come at different moments)."""
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


def _gib(n: float) -> str:
    return f"{n / _GIB:.1f} GiB"


def at_world_size(row: dict[str, Any], world_size: int, new_world_size: int) -> dict[str, Any]:
    """A row of an FSDP2 run on ``world_size`` ranks as it would be on ``new_world_size``: the bytes that FSDP2
    shards (``row["sharded"]``: parameter and gradient shards, AdamW's state) scale as 1 / ranks, the rest (gathered
    units, activations) stays. The host column (offloaded shards) scales alike."""
    sharded = row.get("sharded", 0)
    scaled = math.ceil(sharded * world_size / new_world_size)
    host = row.get("host", 0)
    return {
        **row,
        "peak": row["peak"] - sharded + scaled,
        "sharded": scaled,
        "host": math.ceil(host * world_size / new_world_size) if host else 0,
    }


def smallest_nodes(
    rows: list[dict[str, Any]], budget: Budget, strategy: str, devices: int, nodes: int
) -> Optional[int]:
    """The smallest node count (``devices`` per node) at which every row of ``rows`` fits, or ``None``.

    Only FSDP2 spreads a rank's state over more ranks (:func:`at_world_size`); under DDP or on one
    device more nodes change nothing, so the answer is ``nodes`` if the rows fit and ``None`` if not.
    """
    if all(budget.fits(row) for row in rows):
        return nodes
    if strategy != "fsdp":
        return None
    world = devices * nodes
    for n in range(nodes + 1, MAX_NODES + 1):
        if all(budget.fits(at_world_size(row, world, devices * n)) for row in rows):
            return n
        floor = [at_world_size(row, world, devices * MAX_NODES) for row in rows]
        if not all(budget.fits(row) for row in floor):
            return None  # what does not shard is over the budget on its own
    return None


def changes_that_fit(report: dict[str, Any], budget: Budget) -> list[str]:
    """What to change so that the configured mode fits at every k, smallest first: ``--trainer.num_nodes`` (FSDP2),
    ``cpu_offload``, lighter checkpointing, a smaller micro-batch; each as a flag of ``elr fit``."""
    target = report["target"]
    conf = report["configured"]
    mine = [row for row in report["rows"] if row["mode"] == conf["mode"] and row["micro_batch"] == conf["micro_batch"]]
    mine = mine or [conf]
    changes = []
    nodes = smallest_nodes(mine, budget, target["strategy"], target["devices"], target["num_nodes"])
    if nodes is not None and nodes != target["num_nodes"]:
        changes.append(f"--trainer.num_nodes {nodes} ({nodes * target['devices']} ranks shard the state)")
    if target["strategy"] == "fsdp" and not target["cpu_offload"]:
        offloaded = max(row["peak"] - row.get("sharded", 0) for row in mine)
        if offloaded <= budget.device:
            changes.append(
                f"--trainer.strategy.init_args.cpu_offload true (about {_gib(offloaded)} left on the device; "
                "check the host with elr estimate --cpu_offload)"
            )
    if target["strategy"] != "fsdp":
        changes.append(
            "--trainer.strategy.class_path elr_lightning.strategies.OneLoopOverrideFSDPStrategy "
            f"(DDP keeps the whole state on every rank; elr estimate --strategy fsdp says what it takes)"
        )
    for mode in ("loop", "layer", "bp1"):
        rows = [row for row in report["rows"] if row["mode"] == mode and row["micro_batch"] == conf["micro_batch"]]
        if mode != conf["mode"] and rows and all(budget.fits(row) for row in rows):
            flag = "--model.init_args.backprop_loops 1" if mode == "bp1" else f"--model.init_args.activation_checkpointing {mode}"
            changes.append(f"{flag} ({_gib(max(budget.need(row) for row in rows))} at most)")
            break
    smaller = [e["micro_batch"] for e in report.get("per_k", []) if e.get("mode") == conf["mode"] and e.get("micro_batch")]
    if len(smaller) == len(report.get("per_k", [])) and smaller and min(smaller) < conf["micro_batch"]:
        changes.append(f"--data.init_args.batch_size {min(smaller)} (raise trainer.accumulate_grad_batches to keep the tokens per step)")
    return changes


def verdict(report: dict[str, Any], budget: Budget, searched: bool = True) -> str:
    """One line: whether the configured step fits the budget; if not, what to change (:func:`changes_that_fit`)."""
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
    over = "" if budget.host_fits(conf) else " and its offloaded state exceeds the host's budget"
    changes = changes_that_fit(report, budget)
    instead = f"; to fit at every k: {' or '.join(changes)}" if changes else "; nothing tried here fits"
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


__all__ = ["Budget", "at_world_size", "changes_that_fit", "per_k_verdict", "smallest_nodes", "verdict"]
