"""``elr estimate`` against measurement: the estimated per-rank peak of one training step (fake tensors,
nothing allocated) against the same step's peak on real tensors, for the quickstart configs at k = 1
and K under each backward setting, on the CPU, at the configs' own micro-batch and sequence length.

Each case is measured in a fresh process two ways:

* ``rss``, independent of torch's trackers: the process's peak resident set over the step (``VmHWM``,
  reset through ``/proc/self/clear_refs`` right before it) less what the process held before the step
  besides its tensors (the resident set then, less the bytes of the parameters, buffers and AdamW
  state). The worker runs with ``MALLOC_MMAP_THRESHOLD_=65536``, so freed tensors leave the resident
  set (``--allocator default`` leaves glibc's default, which keeps freed blocks below its adaptive
  mmap threshold in the heap: what ``elr estimate``'s default headroom covers), and after a warm-up
  step on two tokens, so lazily made library state is not counted;
* ``tracker``: torch's ``MemTracker`` on the real step (what ``tests/test_estimate.py`` checks at a
  small size).

The ratio printed is estimate / measured of the whole peak; ``step`` is the same for the part above
the resting memory (parameters, buffers, optimizer state), the part a step adds.

    OMP_NUM_THREADS=1 python bench/estimate.py                       # writes bench/results/estimate.json
    python bench/estimate.py --configs config/quickstart.yaml --micro_batch 32 --seq_len 256
    python bench/estimate.py --allocator default --out bench/results/estimate_default_allocator.json

Target (issue 33): every estimate within 15% of the measured peak.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {"none": ("none", None), "loop": ("loop", None), "layer": ("layer", None), "bp1": ("none", 1)}


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _resting_bytes(module, optimizer) -> int:  # noqa: ANN001 - torch objects, imported in the worker
    import torch

    storages = {}
    tensors = [*module.parameters(), *module.buffers()]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def worker(config_path: str, loops: int, mode: str, micro_batch: int, seq_len: int) -> dict:
    """One case on real tensors in this process: ``{rss_peak, rss_step, tracker_peak, resting}`` in bytes."""
    import torch

    from elr_lightning.lightning_cli import merged_config
    from elr_lightning.estimate.memory import Setting, Target, primed_optimizer, step_batch, traced_step, training_step
    from elr_lightning.estimate.target import target_of_config
    from elr_lightning.module import ELRModule

    torch.set_flush_denormal(True)
    torch.manual_seed(0)
    config = merged_config(config_path)
    single = target_of_config(config, 1, "single", "torch")
    target = Target("single", 1, single.precision, single.gradient_clip_val)
    module = ELRModule(**config["model"]["init_args"])
    module.train()
    optimizer = primed_optimizer(module, target.gradient_clip_val)
    checkpointing, backprop = MODES[mode]
    setting = Setting(loops, checkpointing, backprop, micro_batch, seq_len)
    warm = Setting(loops, checkpointing, backprop, module.virtual_ranks, 2)
    training_step(module, optimizer, target, warm, step_batch(module, warm))
    batch = step_batch(module, setting)
    resting = _resting_bytes(module, optimizer)
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak resident set, to the current one
    training_step(module, optimizer, target, setting, batch)
    hwm = _status("VmHWM")
    tracked = traced_step(module, optimizer, target, setting)
    return {"rss_peak": resting + hwm - before, "rss_step": hwm - before, "tracker_peak": tracked.peak, "resting": resting}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--configs", nargs="+",
        default=["config/quickstart.yaml", "config/quickstart_hybrid.yaml", "config/quickstart_moe.yaml"],
    )
    parser.add_argument("--modes", nargs="+", default=["none", "loop", "layer"], choices=list(MODES))
    parser.add_argument("--micro_batch", type=int, default=None, help="default: the config's data.batch_size")
    parser.add_argument("--seq_len", type=int, default=None, help="default: the config's data.seq_len")
    parser.add_argument("--out", default="bench/results/estimate.json")
    parser.add_argument(
        "--allocator", choices=["tuned", "default"], default="tuned",
        help="tuned: MALLOC_MMAP_THRESHOLD_=65536 in the workers; default: glibc's own thresholds",
    )
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        path, loops, mode, batch, length = args.worker
        print(json.dumps(worker(path, int(loops), mode, int(batch), int(length))))
        return

    sys.path.insert(0, ROOT)
    from elr_lightning.lightning_cli import build_module, merged_config
    from elr_lightning.estimate.memory import Setting, Target, estimate_steps
    from elr_lightning.estimate.target import geometry_of_config, target_of_config

    load_before = os.getloadavg()
    rows = []
    print(f"{'config':<28}{'k':>3}  {'mode':<7}{'estimate MiB':>14}{'rss MiB':>10}{'est/rss':>9}{'step est/rss':>14}"
          f"{'tracker MiB':>13}{'est/tracker':>13}{'est s':>7}")
    for path in args.configs:
        config = merged_config(path)
        batch, length = geometry_of_config(config, args.micro_batch, args.seq_len)
        single = target_of_config(config, 1, "single", "torch")
        target = Target("single", 1, single.precision, single.gradient_clip_val)
        k_max = config["model"]["init_args"]["arch"]["max_loops"]
        cases = [(k, mode) for k in (1, k_max) for mode in args.modes]
        settings = [Setting(k, *MODES[mode], batch, length) for k, mode in cases]
        start = time.process_time()
        estimates = estimate_steps(lambda: build_module(config), target, settings)
        seconds = (time.process_time() - start) / len(settings)
        for (k, mode), estimate in zip(cases, estimates):
            env = {**os.environ, "PYTHONPATH": ROOT}
            env.pop("MALLOC_MMAP_THRESHOLD_", None)
            if args.allocator == "tuned":
                env["MALLOC_MMAP_THRESHOLD_"] = "65536"
            cmd = [sys.executable, __file__, "--worker", path, str(k), mode, str(batch), str(length)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=ROOT).stdout
            measured = json.loads(out.strip().splitlines()[-1])
            row = {
                "config": path, "loops": k, "mode": mode, "micro_batch": batch, "seq_len": length,
                "estimate": estimate.as_dict(), **measured,
                "estimate_over_rss": estimate.peak / measured["rss_peak"],
                "step_estimate_over_rss": (estimate.peak - measured["resting"]) / measured["rss_step"],
                "estimate_over_tracker": estimate.peak / measured["tracker_peak"],
                "estimate_cpu_s": seconds,
            }
            rows.append(row)
            print(f"{os.path.basename(path):<28}{k:>3}  {mode:<7}{estimate.peak / 2**20:>14.1f}"
                  f"{measured['rss_peak'] / 2**20:>10.1f}{row['estimate_over_rss']:>9.3f}"
                  f"{row['step_estimate_over_rss']:>14.3f}{measured['tracker_peak'] / 2**20:>13.1f}"
                  f"{row['estimate_over_tracker']:>13.3f}{seconds:>7.1f}", flush=True)
    worst = max(abs(row["estimate_over_rss"] - 1) for row in rows)
    print(f"largest |estimate / rss - 1|: {worst:.3f} (target <= 0.15)")
    load_after = os.getloadavg()
    print(f"load average (1, 5, 15 min): before {load_before}, after {load_after}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"config": vars(args), "rows": rows, "worst_relative_error": worst,
                   "load_average": [load_before, load_after]}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
