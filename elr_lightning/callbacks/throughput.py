"""Tokens/s, achieved FLOP/s, MFU and peak memory per device, on every logging step."""

from __future__ import annotations

import resource
import sys
import time
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.throughput import Throughput, _plugin_to_compute_dtype, get_available_flops
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from elr_lightning.batches import batch_dims
from elr_lightning.callbacks.compute_accounting import step_flops

#: Bytes per unit of ``ru_maxrss``: KiB on Linux, bytes on macOS.
_RSS_UNIT = 1 if sys.platform == "darwin" else 1024


class TrainingThroughput(Callback):
    """Log ``throughput/*`` on each logging step; tokens/s and MFU also in the progress bar.

    Tags (rates over the optimizer steps since the previous logging step, validation time left out):

    * ``throughput/tokens_per_s``: training tokens per second over all devices;
    * ``throughput/device/tokens_per_s`` and ``throughput/device/flops_per_s``: per device;
    * ``throughput/device/mfu``: achieved over peak FLOP/s, only where the peak is known;
    * ``throughput/device/peak_memory_gib``: the accelerator's peak allocated memory since the
      previous logging step (``torch.accelerator`` statistics); on the CPU the process's peak resident
      memory so far.

    The FLOPs of a step are the model FLOPs of our own accounting
    (:func:`~elr_lightning.callbacks.compute_accounting.step_flops`: every shard at its own k, a
    mixture of experts at its active experts, eq. 4's adapters while conditioning is on), not a
    measurement: Lightning's ``ThroughputMonitor`` reads one fixed ``flops_per_batch`` and synchronises
    the device after every batch, while the FLOPs of a step here change with its loop schedule and the
    device is synchronised only on logging steps (which read the loss anyway). The windowed rates
    and MFU are Lightning's (:class:`lightning.fabric.utilities.throughput.Throughput`), and so is the
    table of device peaks (:func:`~lightning.fabric.utilities.throughput.get_available_flops`, by
    device and precision; ``None`` on the CPU, where MFU is not known and not logged).

    Args:
        peak_flops: Peak FLOP/s of one device for the run's precision, overriding Lightning's table
            (e.g. ``989e12`` for an H100 in bf16). ``None``: the table's value, if any.
        prog_bar: Show ``tokens_per_s`` (and ``mfu`` where known) in the progress bar.
    """

    def __init__(self, peak_flops: Optional[float] = None, prog_bar: bool = True) -> None:
        if peak_flops is not None and not peak_flops > 0:
            raise ValueError(f"TrainingThroughput.peak_flops={peak_flops} must be > 0 (FLOP/s), or null for the table")
        self.peak_flops = peak_flops
        self.prog_bar = prog_bar
        self.available_flops: Optional[float] = None
        self._throughput = Throughput(window_size=2)
        self._world_size = 1
        self._batches = 0
        self._tokens = 0
        self._flops = 0.0
        self._start = 0.0
        self._paused = 0.0
        self._validation_start: Optional[float] = None
        self._schedule: list[int] = []

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        device = trainer.strategy.root_device
        if self.peak_flops is not None:
            self.available_flops = self.peak_flops
        elif device.type != "cpu":
            self.available_flops = get_available_flops(device, _plugin_to_compute_dtype(trainer.precision_plugin))
        self._world_size = trainer.world_size
        self._throughput = Throughput(available_flops=self.available_flops, world_size=self._world_size, window_size=2)

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._throughput.reset()
        self._batches, self._tokens, self._flops, self._paused = 0, 0, 0.0, 0.0
        self._start = self._now(pl_module.device)
        self._reset_peak_memory(pl_module.device)

    @override
    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        self._schedule = pl_module.step_schedule()

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        flops, _ = step_flops(pl_module, batch, self._schedule)
        self._batches += 1
        rows, seq_len = batch_dims(batch)
        self._tokens += rows * seq_len
        self._flops += flops / self._world_size
        # Lightning's own ThroughputMonitor asks the logger connector the same question.
        if not trainer._logger_connector.should_update_logs:
            return
        device = pl_module.device
        self._throughput.update(
            time=self._now(device) - self._start - self._paused,
            batches=self._batches,
            samples=self._batches,
            lengths=self._tokens,
            flops=self._flops,
        )
        self._flops = 0.0
        metrics = self._throughput.compute()
        shown = {
            "tokens_per_s": metrics.get("items_per_sec", metrics.get("device/items_per_sec")),
            "device/tokens_per_s": metrics.get("device/items_per_sec"),
            "device/flops_per_s": metrics.get("device/flops_per_sec"),
            "device/mfu": metrics.get("device/mfu"),
            "device/peak_memory_gib": self._peak_memory(device) / 2**30,
        }
        for name, value in shown.items():
            if value is not None:
                prog_bar = self.prog_bar and name in ("tokens_per_s", "device/mfu")
                pl_module.log(f"throughput/{name}", float(value), prog_bar=prog_bar, rank_zero_only=True)
        self._reset_peak_memory(device)

    @override
    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if not trainer.sanity_checking:
            self._validation_start = self._now(pl_module.device)

    @override
    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._validation_start is not None:
            self._paused += self._now(pl_module.device) - self._validation_start
            self._validation_start = None

    @staticmethod
    def _now(device: torch.device) -> float:
        """Wall time after the device has finished its queued work (no synchronisation on the CPU)."""
        if device.type != "cpu":
            torch.accelerator.synchronize(device)
        return time.perf_counter()

    @staticmethod
    def _peak_memory(device: torch.device) -> float:
        """Bytes: the accelerator's peak allocated memory, or on the CPU the process's peak resident set."""
        if device.type == "cpu":
            return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _RSS_UNIT)
        return float(torch.accelerator.max_memory_allocated(device))

    @staticmethod
    def _reset_peak_memory(device: torch.device) -> None:
        if device.type != "cpu":
            torch.accelerator.reset_peak_memory_stats(device)
