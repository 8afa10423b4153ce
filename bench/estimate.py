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

``--speed`` (issue 47) times ``elr estimate`` itself on the shipped GPU configs, each with the hardware its
header names (the ``elr estimate`` line in its comments): the fast path and ``--exact`` (every step traced),
each in a fresh process, their wall and CPU time, and the largest difference between their tables (every row,
the configured step and the per-k choices), in GiB and relative to the exact figure; and the fast path run
again on the cache its first run filled (``rerun_wall_s``):

    nice python bench/estimate.py --speed                     # writes bench/results/estimate_speed.json
    python bench/estimate.py --speed --speed_configs config/gpt_0.5b.yaml --no_exact

Target: the fast table within 1% (or 0.1 GiB) of the exact one, in under 60 s alone on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
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


SPEED_CONFIGS = ("config/gpt_0.5b.yaml", "config/4b.yaml", "config/30b_a3b.yaml")


def header_estimate_flags(path: str) -> list[str]:
    """The flags of the ``elr estimate --config <path> ...`` line in a config's header comments (its hardware)."""
    with open(os.path.join(ROOT, path)) as f:
        for line in f:
            if not line.startswith("#"):
                break
            words = line.lstrip("#").split()
            if words[:2] == ["elr", "estimate"]:
                flags = words[2:]
                at = flags.index("--config")
                return flags[:at] + flags[at + 2 :]
    raise ValueError(f"{path}: no `elr estimate --config {path} ...` line in its header")


def _timed_estimate(path: str, flags: list[str]) -> dict:
    """``elr estimate --json`` of ``path`` in a fresh process: its report, wall and CPU seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "elr_lightning.cli", "estimate", "--config", path, *flags, "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"report": json.loads(done.stdout), "wall_s": wall, "cpu_s": cpu}


def table_difference(fast: dict, exact: dict) -> dict:
    """The largest difference of the peaks (and host memory) of the same rows of two reports: GiB and relative."""
    def entries(report: dict) -> dict:
        rows = {("row", r["loops"], r["mode"], r["micro_batch"]): r for r in report["rows"]}
        rows[("configured",)] = report["configured"]
        rows.update({("per_k", e["loops"]): e for e in report["per_k"]})
        return rows

    a, b = entries(fast), entries(exact)
    worst = {"gib": 0.0, "relative": 0.0, "where": None}
    for key in a.keys() & b.keys():
        for column in ("peak", "host"):
            diff = abs(a[key].get(column, 0) - b[key].get(column, 0))
            relative = diff / max(b[key].get(column, 0), 1)
            if diff / 2**30 > worst["gib"] or relative > worst["relative"]:
                worst = {"gib": max(worst["gib"], diff / 2**30), "relative": max(worst["relative"], relative),
                         "where": " ".join(map(str, key)) + f" {column}"}
    same_choices = [(e["loops"], e["mode"], e["micro_batch"]) for e in fast["per_k"]] == [
        (e["loops"], e["mode"], e["micro_batch"]) for e in exact["per_k"]
    ]
    return {**worst, "same_per_k_choices": same_choices, "same_largest_micro_batch":
            fast.get("largest_micro_batch") == exact.get("largest_micro_batch")}


def speed(configs: list[str], exact: bool, out: str) -> None:
    """Fast path against ``--exact`` on each config with its header's hardware; JSON to ``out``."""
    results = []
    for path in configs:
        flags = header_estimate_flags(path)
        with tempfile.TemporaryDirectory() as cache:  # a first run (an empty cache), then the same command again
            fast = _timed_estimate(path, [*flags, "--cache_dir", cache])
            again = _timed_estimate(path, [*flags, "--cache_dir", cache])
        entry = {"config": path, "flags": flags, "fast_wall_s": fast["wall_s"], "fast_cpu_s": fast["cpu_s"],
                 "rerun_wall_s": again["wall_s"], "rerun_cpu_s": again["cpu_s"],
                 "rerun_same": again["report"]["rows"] == fast["report"]["rows"],
                 "fast_verdict": fast["report"]["verdict"], "fast": fast["report"]}  # fmt: skip
        print(f"{path}: fast {fast['wall_s']:.0f} s wall, {fast['cpu_s']:.0f} s CPU; run again (cached) "
              f"{again['wall_s']:.0f} s wall; {fast['report']['verdict']}", flush=True)
        if exact:
            full = _timed_estimate(path, [*flags, "--exact", "--no_cache"])
            entry.update(exact_wall_s=full["wall_s"], exact_cpu_s=full["cpu_s"], exact=full["report"],
                         difference=table_difference(fast["report"], full["report"]))
            print(f"{path}: exact {full['wall_s']:.0f} s wall, {full['cpu_s']:.0f} s CPU; largest difference "
                  f"{entry['difference']['gib']:.3f} GiB, {entry['difference']['relative']:.2%} "
                  f"({entry['difference']['where']})", flush=True)
        results.append(entry)
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump({"load_average": os.getloadavg(), "cpu_count": os.cpu_count(), "results": results}, f, indent=2)
    print(f"wrote {out}")


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
    parser.add_argument("--speed", action="store_true", help="time elr estimate, fast path against --exact")
    parser.add_argument("--speed_configs", nargs="+", default=list(SPEED_CONFIGS))
    parser.add_argument("--no_exact", action="store_true", help="with --speed: the fast path only")
    args = parser.parse_args()
    if args.speed:
        out = args.out if args.out != "bench/results/estimate.json" else "bench/results/estimate_speed.json"
        speed(args.speed_configs, not args.no_exact, out)
        return
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
