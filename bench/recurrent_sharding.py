"""Step time of the ways to train ranks at different loop counts, with 2 processes (issue 40).

Options (the baseline first; every ratio is against it, measured in the same run):

* ``fsdp core``: FSDP2 with the whole recurrent block one unit (``recurrent_units: core``), every
  shard its own k (``depth_layout: ranks``): one gather and one reduce-scatter of the block per
  micro-batch, whatever k; the block is gathered whole.
* ``fsdp layer, padded (b)``: each recurrent layer its own unit; a rank past its k makes idle
  passes (zero rows) to the deepest rank's k: a gather per layer and loop, and a reduce-scatter
  per layer and loop in the backward pass.
* ``fsdp layer, one k per micro-batch (a)``: the same units, ``depth_layout: micro_batches``: the
  ranks run one k per micro-batch and never pad.
* ``ddp`` and ``ddp, one k per micro-batch (a)``: DDP, for scale.

Each step has two micro-batches (``accumulate_grad_batches: 2``) on each of 2 ranks. The loop
schedule is the shipped sampler's (one-loop overrides, K = 4, f = 0.15) with one seed, and the
sampler's draw for the step's two shards is the same list under both layouts: under ``ranks``
rank j runs entry j in both micro-batches, under ``micro_batches`` both ranks run entry j in
micro-batch j. So every option does the same layer applications per step; the options differ in
which rank does them when, and in their collectives.

The options take turns in rounds, each round training every option for ``--steps`` steps in the
same two processes, so drift on a shared machine hits them alike. Figures per option: the mean
step period on rank 0 (wall clock: a waiting rank waits), the CPU time per step of each rank, the
logged ``train/rank_utilisation``, and the ratios of the step period and of the ranks' summed CPU
time to the baseline's.

    python bench/recurrent_sharding.py              # prints a table, writes bench/results/recurrent_sharding.json
    python bench/recurrent_sharding.py --accelerator cuda --world 2    # bench/gpu.sh --sharding
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader

from elr_lightning.config import ModelConfig
from elr_lightning.module import ELRModule
from elr_lightning.sampling import OneLoopOverride
from elr_lightning.strategies import OneLoopOverrideDDPStrategy, OneLoopOverrideFSDPStrategy
from samplers import RandomTokens, launch  # bench/ is the script's folder, first on the path

#: name: (strategy, recurrent_units, depth_layout); the baseline first.
OPTIONS = {
    "fsdp core": ("fsdp", "core", "ranks"),
    "fsdp layer, padded (b)": ("fsdp", "layer", "ranks"),
    "fsdp layer, one k per micro-batch (a)": ("fsdp", "layer", "micro_batches"),
    "ddp": ("ddp", None, "ranks"),
    "ddp, one k per micro-batch (a)": ("ddp", None, "micro_batches"),
}
BASELINE = "fsdp core"
ACCUMULATE = 2


class StepClock(Callback):
    """Per optimizer step: its wall-clock period and this process' CPU time, and the logged utilisation.

    A step ends with its last micro-batch; step 0's period starts at ``on_train_start``.
    """

    def __init__(self) -> None:
        self.periods: list[float] = []
        self.cpu: list[float] = []
        self.utilisation: list[float] = []
        self._wall = self._cpu = 0.0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if (batch_idx + 1) % ACCUMULATE:
            return
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        wall, cpu = time.perf_counter(), time.process_time()
        self.periods.append(wall - self._wall)
        self.cpu.append(cpu - self._cpu)
        self.utilisation.append(float(trainer.callback_metrics["train/rank_utilisation"]))
        self._wall, self._cpu = wall, cpu


def train_option(name: str, args: argparse.Namespace, world: int) -> dict[str, Any]:
    """Train ``OPTIONS[name]`` for ``warmup + steps`` steps on this rank; its clock's figures past the warm-up."""
    strategy_name, units, layout = OPTIONS[name]
    n_in, n_rec, n_out = args.layers
    arch = ModelConfig(
        vocab_size=256, d_model=args.d_model, n_heads=4, n_in=n_in, n_rec=n_rec, n_out=n_out,
        max_seq_len=args.seq_len, max_loops=4,
    )
    seed_everything(0, verbose=False)
    module = ELRModule(
        arch=arch, sampler=OneLoopOverride(4, 0.15), loop_seed=0, warmup_steps=0, depth_layout=layout,
    )
    timeout = timedelta(seconds=120)
    if strategy_name == "fsdp":
        strategy: Any = OneLoopOverrideFSDPStrategy(timeout=timeout, recurrent_units=units, check_schedule_every_n_steps=0)
    else:
        strategy = OneLoopOverrideDDPStrategy(timeout=timeout, check_schedule_every_n_steps=0)
    steps = args.warmup + args.steps
    clock = StepClock()
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=world,
        strategy=strategy,
        max_steps=steps,
        accumulate_grad_batches=ACCUMULATE,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[clock],
    )
    data = RandomTokens(world * args.batch * ACCUMULATE * steps, args.seq_len, arch.vocab_size)
    trainer.fit(module, DataLoader(data, batch_size=args.batch))
    return {key: getattr(clock, key)[args.warmup :] for key in ("periods", "cpu", "utilisation")}


def run_rank(args: argparse.Namespace) -> None:
    """One rank: every option, ``--rounds`` times in turn; writes its figures to ``<worker>.rank<r>``."""
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    world = int(os.environ["WORLD_SIZE"])
    figures: dict[str, dict[str, list[float]]] = {name: {"periods": [], "cpu": [], "utilisation": []} for name in OPTIONS}
    for _ in range(args.rounds):
        for name in OPTIONS:
            for key, values in train_option(name, args, world).items():
                figures[name][key] += values
    with open(f"{args.worker}.rank{os.environ['LOCAL_RANK']}", "w") as f:
        json.dump(figures, f)


def summarise(ranks: list[dict[str, dict[str, list[float]]]]) -> dict[str, Any]:
    """Per option: mean step period (rank 0), CPU time per step of each rank and summed, utilisation, ratios."""
    rows = {}
    for name in OPTIONS:
        period = statistics.mean(ranks[0][name]["periods"])
        cpu = [statistics.mean(rank[name]["cpu"]) for rank in ranks]
        rows[name] = {
            "mean_step_s": period,
            "median_step_s": statistics.median(ranks[0][name]["periods"]),
            "cpu_s_per_step_by_rank": cpu,
            "cpu_s_per_step_all_ranks": sum(cpu),
            "mean_rank_utilisation": statistics.mean(ranks[0][name]["utilisation"]),
            "steps_timed": len(ranks[0][name]["periods"]),
        }
    base = rows[BASELINE]
    for row in rows.values():
        row["step_ratio_vs_baseline"] = row["mean_step_s"] / base["mean_step_s"]
        row["cpu_ratio_vs_baseline"] = row["cpu_s_per_step_all_ranks"] / base["cpu_s_per_step_all_ranks"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--world", type=int, default=2, help="processes (on CUDA: one per device)")
    parser.add_argument("--d_model", type=int, default=128)
    parser.add_argument("--layers", type=int, nargs=3, default=[1, 2, 1], metavar=("N_IN", "N_REC", "N_OUT"))
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank and micro-batch")
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=12, help="timed optimizer steps per option and round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per option and round, first")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before the ranks are killed")
    parser.add_argument("--out", default="bench/results/recurrent_sharding.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_rank(args)
        return
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    raw_path = args.out + ".raw"
    load_before = os.getloadavg()
    launch(args, raw_path, args.world, __file__)
    ranks = []
    for rank in range(args.world):
        with open(f"{raw_path}.rank{rank}") as f:
            ranks.append(json.load(f))
        os.remove(f"{raw_path}.rank{rank}")
    rows = summarise(ranks)
    load_after = os.getloadavg()
    print(
        f"\n{args.world}-process {args.accelerator}, d={args.d_model}, layers={args.layers}, "
        f"{ACCUMULATE} micro-batches of {args.batch}x{args.seq_len} per rank and step, K=4, f=0.15; "
        f"baseline: {BASELINE}"
    )
    print(f"{'option':<40}{'step (ms)':>11}{'ratio':>8}{'CPU ms/step':>13}{'CPU ratio':>11}{'utilisation':>13}")
    for name, row in rows.items():
        print(
            f"{name:<40}{1000 * row['mean_step_s']:>11.1f}{row['step_ratio_vs_baseline']:>8.2f}"
            f"{1000 * row['cpu_s_per_step_all_ranks']:>13.1f}{row['cpu_ratio_vs_baseline']:>11.2f}"
            f"{row['mean_rank_utilisation']:>13.3f}"
        )
    print(f"load average (1, 5, 15 min): before {load_before}, after {load_after}")
    config = {k: v for k, v in vars(args).items() if k not in ("worker", "out")}
    with open(args.out, "w") as f:
        json.dump({"config": config, "baseline": BASELINE, "options": rows, "load_average": [load_before, load_after]}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
