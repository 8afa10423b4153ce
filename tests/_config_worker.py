"""One rank of a shipped config's dry run: ``python tests/_config_worker.py SPEC.json``.

The test launches one process per rank with ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``,
``NODE_RANK`` and ``LOCAL_RANK`` set, so Lightning joins them. Each rank runs ``elr fit --config
<yaml>`` for every reduced config of the spec, with Lightning choosing its evaluation context as on
NCCL (:func:`_dist_worker.evaluation_as_on_nccl`), and writes ``<out>/<name>.rank<r>.json``: the
error's traceback (or ``null``) beside what :class:`DryRunRecord` saw.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import traceback
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

import _dist_worker
from elr_lightning.cli import run


class DryRunRecord(Callback):
    """Writes ``{"steps", "losses", "evaluations"}`` to ``path`` when training ends: the optimizer steps
    reached, the training loss of each micro-batch, and ``[sanity check, inference mode]`` of every
    validation batch. The dry run's YAML adds it to the config's callbacks."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.losses: list[float] = []
        self.evaluations: list[list[bool]] = []

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self.evaluations.append([trainer.sanity_checking, torch.is_inference_mode_enabled()])

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        record = {"steps": trainer.global_step, "losses": self.losses, "evaluations": self.evaluations}
        with open(f"{self.path}.rank{trainer.global_rank}.json", "w") as f:
            json.dump(record, f)


def fit(config: str) -> Any:
    """``elr fit --config config``, evaluation chosen as on NCCL; the traceback of its error, or ``None``."""
    try:
        with _dist_worker.evaluation_as_on_nccl():
            run(["fit", "--config", config])
    except Exception:  # noqa: BLE001 - reported to the test, which fails on it
        return traceback.format_exc()[-6000:]
    return None


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    faulthandler.dump_traceback_later(spec["watchdog_s"], exit=True)
    torch.set_num_threads(1)
    rank = int(os.environ["LOCAL_RANK"])
    for case in spec["cases"]:
        error = fit(case["config"])
        with open(os.path.join(spec["out"], f"{case['name']}.error{rank}.json"), "w") as f:
            json.dump({"error": error}, f)
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main(sys.argv[1])
