"""Step time of the loop-sampling schemes under 2-process DDP on the CPU (gloo).

Independent-rank sampling lets every rank draw its own k, so each step waits for the deepest rank;
one-loop overrides (eq. 3) and synchronized sampling give all non-overridden ranks one shared k.
The paper (§6) reports 1.36x step time for independent-rank sampling at scale, and overrides at the
synchronized step time. With W ranks the independent step costs about E[max of W draws] loops
against E[k] = (K + 1)/2, so two ranks show a smaller gap than a large cluster.

The three samplers take turns step by step in one training run (:class:`Interleaved`), so drift
on a shared machine hits them alike, and synchronized and override steps draw the same shared k.
Each figure is the mean step period on rank 0 (the gradient all-reduce makes it the slowest
rank's); the mean, not the median, since steps of different depth differ by design.

    python bench/samplers.py                 # prints a table, writes bench/results/samplers.json
    python bench/samplers.py --steps 100 --d_model 256
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader, Dataset

from elr_lightning.config import ModelConfig
from elr_lightning.module import ELRModule
from elr_lightning.sampling import IndependentRank, LoopSampler, OneLoopOverride, Synchronized
from elr_lightning.strategies import OneLoopOverrideDDPStrategy

WORLD = 2
BASELINE = "synchronized"
PAPER_INDEPENDENT_RATIO = 1.36


def samplers(max_loops: int, override_fraction: float) -> dict[str, LoopSampler]:
    """The compared schemes; the baseline first."""
    return {
        BASELINE: Synchronized(max_loops),
        "one-loop override": OneLoopOverride(max_loops, override_fraction),
        "independent-rank": IndependentRank(max_loops),
    }


class Interleaved(LoopSampler):
    """Step t runs scheme ``t % n`` at its own step ``t // n``, so every scheme sees its own schedule.

    Args:
        schemes: The samplers, in turn.
    """

    def __init__(self, schemes: list[LoopSampler]) -> None:
        self.schemes = schemes
        self.max_loops = max(s.max_loops for s in schemes)

    def schedule(self, seed: int, step: int, num_shards: int) -> list[int]:
        return self.schemes[step % len(self.schemes)].schedule(seed, step // len(self.schemes), num_shards)


class RandomTokens(Dataset):
    """Fixed random windows of ``seq_len + 1`` tokens."""

    def __init__(self, count: int, seq_len: int, vocab_size: int) -> None:
        self.tokens = torch.randint(0, vocab_size, (count, seq_len + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.tokens[index]


class StepClock(Callback):
    """Per step: its period (end of the previous step to its own end) and its deepest k.

    Step 0's period starts at ``on_train_start``, so it includes no setup.
    """

    def __init__(self) -> None:
        self.periods: list[float] = []
        self.max_loops: list[int] = []
        self._last = 0.0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last = time.perf_counter()

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.max_loops.append(max(pl_module.step_schedule()))

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        self.periods.append(now - self._last)
        self._last = now


def run_rank(args: argparse.Namespace) -> None:
    """One rank: train with the schemes interleaved; rank 0 writes each scheme's step periods."""
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    n_in, n_rec, n_out = args.layers
    arch = ModelConfig(
        vocab_size=256, d_model=args.d_model, n_heads=4, n_in=n_in, n_rec=n_rec, n_out=n_out,
        max_seq_len=args.seq_len, max_loops=args.max_loops,
    )
    schemes = samplers(args.max_loops, args.override_fraction)
    names = list(schemes)
    max_steps = len(names) * (args.warmup + args.steps)
    data = RandomTokens(WORLD * args.batch * max_steps, args.seq_len, arch.vocab_size)
    seed_everything(0, verbose=False)
    module = ELRModule(arch=arch, sampler=Interleaved(list(schemes.values())), loop_seed=0, warmup_steps=0)
    clock = StepClock()
    trainer = Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=OneLoopOverrideDDPStrategy(timeout=timedelta(seconds=60), check_schedule_every_n_steps=0),
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[clock],
    )
    trainer.fit(module, DataLoader(data, batch_size=args.batch))
    periods: dict[str, list[float]] = {name: [] for name in names}
    deepest: dict[str, list[int]] = {name: [] for name in names}
    for step, (period, k) in enumerate(zip(clock.periods, clock.max_loops)):
        if step >= len(names) * args.warmup:
            periods[names[step % len(names)]].append(period)
            deepest[names[step % len(names)]].append(k)
    if int(os.environ["LOCAL_RANK"]) == 0:
        depth = [arch.effective_depth(k) for k in range(args.max_loops + 1)]
        with open(args.worker, "w") as f:
            json.dump({"periods": periods, "deepest": deepest, "effective_depth": depth}, f)


def launch(args: argparse.Namespace, raw_path: str, world: int = WORLD, script: str = __file__) -> None:
    """Start ``world`` ranks of ``script`` (this one by default) with this command line plus ``--worker raw_path``
    on this machine and wait for them (killed after ``args.timeout`` seconds)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, os.path.abspath(script), *sys.argv[1:], "--worker", raw_path]
    procs = []
    for rank in range(world):
        env = dict(
            os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), NODE_RANK="0",
            LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
        )
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL if rank else None))
    try:
        codes = [proc.wait(timeout=args.timeout) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")


def summarise(raw: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Mean step period per sampler, its ratio to the baseline, and what depth alone predicts.

    The depth ratio is the mean D_eff (eq. 1) of each step's deepest shard over the baseline's.
    The predicted ratio prices each step at the baseline's mean step time for that deepest k, so it
    includes fixed costs (head, optimizer, all-reduce); it assumes a waiting rank does not speed up
    the working one, which holds on separate GPUs but not on CPU cores that share a socket.
    """
    depth = raw["effective_depth"]
    base_periods, base_deepest = raw["periods"][BASELINE], raw["deepest"][BASELINE]
    base_time = statistics.mean(base_periods)
    base_depth = statistics.mean(depth[k] for k in base_deepest)
    by_k = {
        k: statistics.mean(t for t, d in zip(base_periods, base_deepest) if d == k) for k in sorted(set(base_deepest))
    }
    rows = {}
    for name, periods in raw["periods"].items():
        mean = statistics.mean(periods)
        deepest = raw["deepest"][name]
        predicted = statistics.mean(by_k[k] for k in deepest) / base_time if set(deepest) <= set(by_k) else None
        rows[name] = {
            "mean_step_s": mean,
            "median_step_s": statistics.median(periods),
            "ratio_vs_synchronized": mean / base_time,
            "predicted_ratio_from_synchronized_step_times": predicted,
            "mean_deepest_k": statistics.mean(deepest),
            "depth_ratio_vs_synchronized": statistics.mean(depth[k] for k in deepest) / base_depth,
            "steps_timed": len(periods),
        }
    return {
        "world_size": WORLD,
        "synchronized_step_s_by_k": {str(k): t for k, t in by_k.items()},
        "config": {k: v for k, v in vars(args).items() if k not in ("worker", "out")},
        "baseline": BASELINE,
        "paper_independent_rank_ratio": PAPER_INDEPENDENT_RATIO,
        "samplers": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d_model", type=int, default=128)
    parser.add_argument("--layers", type=int, nargs=3, default=[1, 2, 1], metavar=("N_IN", "N_REC", "N_OUT"))
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--max_loops", type=int, default=4)
    parser.add_argument("--override_fraction", type=float, default=0.15)
    parser.add_argument("--steps", type=int, default=60, help="timed steps per sampler")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per sampler, first")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before the ranks are killed")
    parser.add_argument("--out", default="bench/results/samplers.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_rank(args)
        return
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    raw_path = args.out + ".raw"
    launch(args, raw_path)
    with open(raw_path) as f:
        raw = json.load(f)
    os.remove(raw_path)
    summary = summarise(raw, args)
    print(f"\n{WORLD}-process DDP (gloo, CPU), K={args.max_loops}, f={args.override_fraction}, d={args.d_model}, "
          f"layers={args.layers}, batch {args.batch}x{args.seq_len} per rank; baseline: {BASELINE}")
    print(f"{'sampler':<20}{'step (ms)':>11}{'ratio':>8}{'predicted':>11}{'deepest k':>11}{'depth ratio':>13}")
    for name, row in summary["samplers"].items():
        predicted = row["predicted_ratio_from_synchronized_step_times"]
        print(f"{name:<20}{1000 * row['mean_step_s']:>11.1f}{row['ratio_vs_synchronized']:>8.2f}"
              f"{'n/a' if predicted is None else f'{predicted:.2f}':>11}"
              f"{row['mean_deepest_k']:>11.2f}{row['depth_ratio_vs_synchronized']:>13.2f}")
    by_k = ", ".join(f"k={k}: {1000 * t:.0f}" for k, t in summary["synchronized_step_s_by_k"].items())
    print(f"synchronized step (ms) by k: {by_k}")
    print(f"paper (§6, at scale): independent-rank {PAPER_INDEPENDENT_RATIO}x synchronized")
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
