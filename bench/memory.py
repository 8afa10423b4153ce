"""Peak training memory and step time per loop count k under each backward setting.

Settings: ``none`` (every activation kept), ``loop`` and ``layer`` (activation checkpointing, see
``ELRModule(activation_checkpointing=...)``) and ``bp1`` (``backprop_loops=1``: truncated
backpropagation through the last loop). Every (setting, k) runs in a fresh process, so one case's
allocations cannot hide another's peak:

* on CUDA the allocator's own ``max_memory_allocated`` over one training step (forward and
  backward), minus what was allocated before it (weights and their gradients);
* on the CPU the process's peak resident set over the first full-size training step (Linux's
  ``VmHWM``, reset just before the step through ``/proc/self/clear_refs``; where that cannot be
  reset, ``ru_maxrss``, the peak since the process started) minus the resident set just before it, with the gradients allocated and a two-token warm-up step
  done; the workers run with ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors leave the
  resident set (the timing processes run with the allocator's defaults). Noisier than CUDA's
  figure; run with ``--memory_repeats`` > 1 and read the range.

Step times (forward and backward; the optimizer costs the same under every setting) come from
separate timing processes, one per k, that build the model once and alternate the settings step by
step (the order rotating each round), so the settings share every drift of a noisy machine. Each
round gives one ratio per setting against ``none`` at the same k; the ratio printed is the median
over the rounds of ``--time_repeats`` processes (run interleaved over k), with its range, by wall
clock and by the process's CPU time (which on a shared machine counts only this process's work;
it is the step's cost with one thread, ``OMP_NUM_THREADS=1``). Memory
ratios are against ``k = 1`` of the same setting.

    python bench/memory.py                                  # CPU defaults, k = 1, 2, 4, 8
    python bench/memory.py --device cuda --precision bf16 --d_model 1024 --batch 8 --seq_len 1024

Targets (issue: memory flat in k): ``loop`` peak at k = 8 at most 1.5x its k = 1 peak, at a step
time at most 1.4x that of ``none``; ``bp1`` step time at k = 4 at most 0.6x that of ``none``.

``--conditioning_table`` measures what eq. 4's conditioning costs in training memory instead, under
the first of ``--settings`` (``none`` by default): for every k, the same model with and without a
``LoopConditioner``,

* counted, in this process on the CPU: the bytes a forward pass leaves alive for the backward pass (every
  storage an op made during the forward that is still alive after it, parameters excluded; a
  dispatch mode sees them whatever saved-tensor hooks keep them) and, of these, the elements of
  storages shaped like a mixer weight (or its transpose): per-loop weight copies;
* measured, in fresh processes: the peak resident set of one step as above, conditioned over
  unconditioned (median over ``--memory_repeats``).

    python bench/memory.py --conditioning_table --loops 1 2 4 8 --memory_repeats 3

Target (issue 33): conditioned over unconditioned at most 1.05 at k = K under ``none``. To compare with
another build, run this file with that build's package first on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext

SETTINGS = {
    "none": {"activation_checkpointing": "none", "backprop_loops": None},
    "loop": {"activation_checkpointing": "loop", "backprop_loops": None},
    "layer": {"activation_checkpointing": "layer", "backprop_loops": None},
    "bp1": {"activation_checkpointing": "none", "backprop_loops": 1},
}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> bool:
    """Reset the process's peak resident set (``VmHWM``) to its current one; False where Linux does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes(reset: bool) -> int:
    """The peak resident set since :func:`_reset_peak_rss` (``reset``), else since the process started."""
    if reset:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _model(args: argparse.Namespace, conditioning: bool):
    """The bench's model: ``LoopedLM`` of the command line's size, with a default ``LoopConditioner`` or none."""
    from elr_lightning.conditioning import LoopConditioner
    from elr_lightning.config import ModelConfig
    from elr_lightning.model import LoopedLM

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from overhead import arch_fields  # the same --arch models as bench/overhead.py

    n_in, n_rec, n_out = args.layers
    cfg = ModelConfig(
        vocab_size=args.vocab, d_model=args.d_model, n_heads=args.n_heads, n_in=n_in, n_rec=n_rec, n_out=n_out,
        max_seq_len=args.seq_len, max_loops=max(args.loops), **arch_fields(args.arch, args.d_model, args.n_heads),
    )
    return LoopedLM(cfg, conditioner=LoopConditioner() if conditioning else None)


def kept_for_backward(model, forward) -> tuple[object, dict]:
    """``forward()``'s result and what it leaves alive for the backward pass: ``{"bytes", "weight_copy_elements"}``.

    Every storage an op makes while ``forward`` runs is recorded (a ``TorchDispatchMode`` sees it
    whether autograd keeps the tensor or a saved-tensor hook keeps it for autograd); after the
    forward, those still alive are what the graph holds (and the result). Storages of the model's
    parameters and buffers do not count. ``weight_copy_elements`` counts the elements of those
    shaped like one of the model's 2-D weights outside eq. 4's heads (or its transpose).
    """
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    made: list = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    made.append((StorageWeakRef(storage), storage.nbytes(), tuple(t.shape), t.element_size()))
            return out

    own = {StorageWeakRef(t.untyped_storage()).cdata for t in [*model.parameters(), *model.buffers()]}
    shapes = {tuple(p.shape) for name, p in model.named_parameters() if p.ndim == 2 and "_mod." not in name}
    shapes |= {shape[::-1] for shape in shapes}
    with Record():
        out = forward()
    alive: dict[int, tuple[int, tuple[int, ...], int]] = {}
    for ref, nbytes, shape, size in made:  # a storage's weak reference keeps its address from being reused
        if not ref.expired() and ref.cdata not in own:
            alive.setdefault(ref.cdata, (nbytes, shape, size))
    return out, {
        "bytes": sum(nbytes for nbytes, _, _ in alive.values()),
        "weight_copy_elements": sum(nbytes // size for nbytes, shape, size in alive.values() if shape in shapes),
    }


def conditioning_table(args: argparse.Namespace, run) -> None:
    """Eq. 4's training memory: conditioned against unconditioned at each k (see the module docstring)."""
    import torch
    import torch.nn.functional as F

    setting = args.settings[0]
    torch.manual_seed(0)
    batch = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1))
    counted: dict[tuple[bool, int], dict] = {}
    for conditioning in (False, True):
        model = _model(args, conditioning)
        model.set_backprop(**SETTINGS[setting])
        for k in args.loops:
            def forward():
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
                    logits = model(batch[:, :-1], k)
                return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())

            counted[(conditioning, k)] = kept_for_backward(model, forward)[1]
    peaks: dict[tuple[bool, int], list[int]] = {key: [] for key in counted}
    for _ in range(args.memory_repeats):  # interleaved, so drift hits every case alike
        for k in args.loops:
            for conditioning in (False, True):
                flag = "--conditioning" if conditioning else "--no-conditioning"
                peaks[(conditioning, k)].append(run("--setting", setting, "--k", str(k), flag)["peak_bytes"])
    rows = []
    print(f"eq. 4 in training, setting {setting}: unconditioned (plain) against conditioned (eq. 4)")
    print(f"{'k':>3}{'kept MiB plain':>16}{'eq. 4':>9}{'ratio':>8}{'weight copies plain':>21}{'eq. 4':>11}"
          f"{'peak MiB plain':>16}{'eq. 4':>9}{'ratio (min-max)':>20}")
    for k in args.loops:
        plain, cond = counted[(False, k)], counted[(True, k)]
        ratios = [c / p for p, c in zip(peaks[(False, k)], peaks[(True, k)])]
        peak_plain, peak_cond = (statistics.median(peaks[(flag, k)]) for flag in (False, True))
        row = {
            "loops": k, "kept_bytes": [plain["bytes"], cond["bytes"]], "kept_ratio": cond["bytes"] / plain["bytes"],
            "weight_copy_elements": [plain["weight_copy_elements"], cond["weight_copy_elements"]],
            "peak_bytes": [peaks[(False, k)], peaks[(True, k)]], "peak_ratio": statistics.median(ratios),
            "peak_ratio_range": [min(ratios), max(ratios)],
        }
        rows.append(row)
        peak_ratio = f"{row['peak_ratio']:.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
        print(f"{k:>3}{plain['bytes'] / 2**20:>16.1f}{cond['bytes'] / 2**20:>9.1f}{row['kept_ratio']:>8.3f}"
              f"{plain['weight_copy_elements']:>21,}{cond['weight_copy_elements']:>11,}"
              f"{peak_plain / 2**20:>16.1f}{peak_cond / 2**20:>9.1f}"
              f"{peak_ratio:>20}")
    print("target: conditioned / unconditioned peak <= 1.05 at k = K")
    out = args.out.replace(".json", "_conditioning.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump({"config": vars(args), "setting": setting, "rows": rows, "load_average": os.getloadavg()}, f, indent=2)
    print(f"wrote {out}")


def worker(args: argparse.Namespace) -> dict:
    """One (setting, k) in this process: ``{"peak_bytes"}``; with ``--time``, every setting at k: ``{"step_s", "cpu_s"}``.

    The timing worker runs ``--warmup`` rounds, then ``--steps`` rounds of one step per setting in
    rotated order, switching the one model between settings with ``set_backprop``.
    """
    import torch
    import torch.nn.functional as F

    torch.set_flush_denormal(True)
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = _model(args, args.conditioning).to(device)
    cfg = model.config
    model.set_backprop(**SETTINGS[args.setting or "none"])
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    batch = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16" else nullcontext()

    def step() -> tuple[float, float]:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start, start_cpu = time.perf_counter(), time.process_time()
        with autocast:
            logits = model(batch[:, :-1], args.k)
        F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten()).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, time.process_time() - start_cpu

    if args.time:
        settings = args.settings
        times: dict[str, list[float]] = {setting: [] for setting in settings}
        cpu_times: dict[str, list[float]] = {setting: [] for setting in settings}
        for r in range(args.warmup + args.steps):
            for setting in settings[r % len(settings):] + settings[: r % len(settings)]:
                model.set_backprop(**SETTINGS[setting])
                wall, cpu = step()
                if r >= args.warmup:
                    times[setting].append(wall)
                    cpu_times[setting].append(cpu)
        return {"step_s": times, "cpu_s": cpu_times}
    with autocast:  # warm-up on two tokens: lazy library state is allocated outside the measured step
        F.cross_entropy(model(batch[:1, :2], args.k).flatten(0, 1).float(), batch[:1, 1:3].flatten()).backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        reset = _reset_peak_rss()
        before = _rss_bytes()
        step()
        peak = _peak_rss_bytes(reset) - before
    return {"peak_bytes": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--d_model", type=int, default=128)
    parser.add_argument("--n_heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--layers", type=int, nargs=3, default=[2, 4, 2], metavar=("N_IN", "N_REC", "N_OUT"))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--loops", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--conditioning", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--steps", type=int, default=4, help="timed rounds (one step per setting) per timing process")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds before them")
    parser.add_argument("--time_repeats", type=int, default=2, help="timing processes per k, interleaved over k")
    parser.add_argument("--memory_repeats", type=int, default=1, help="fresh processes per (setting, k) for the peak")
    parser.add_argument("--arch", choices=["attention", "hybrid", "moe"], default="attention",
                        help="the mixers, as bench/overhead.py --arch (hybrid: GDP layers; moe: top-2 of 8 experts)")
    parser.add_argument("--conditioning_table", action="store_true",
                        help="eq. 4's cost: conditioned against unconditioned at each k (see above), nothing else")
    parser.add_argument("--out", default="bench/results/memory.json")
    parser.add_argument("--setting", help=argparse.SUPPRESS)
    parser.add_argument("--k", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--time", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.k is not None:
        print(json.dumps(worker(args)))
        return

    passthrough, skip = [], False
    for arg in sys.argv[1:]:  # the workers take every option but --out
        if not skip and not arg.startswith("--out"):
            passthrough.append(arg)
        skip = arg == "--out"
    def run(*extra: str) -> dict:
        cmd = [sys.executable, __file__, *passthrough, *extra]
        env = os.environ if "--time" in extra else {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
        return json.loads(out.strip().splitlines()[-1])

    if args.conditioning_table:
        conditioning_table(args, run)
        return
    load_before = os.getloadavg()
    cases = {
        (setting, k): {"peak_bytes": [], "step_s": [], "vs_none": [], "cpu_vs_none": []}
        for setting in args.settings for k in args.loops
    }
    for _ in range(args.memory_repeats):  # interleaved, so drift hits every case alike
        for k in args.loops:
            for setting in args.settings:
                cases[(setting, k)]["peak_bytes"].append(run("--setting", setting, "--k", str(k))["peak_bytes"])
    for _ in range(args.time_repeats):
        for k in args.loops:
            timed = run("--time", "--k", str(k))
            times, cpu_times = timed["step_s"], timed["cpu_s"]
            for setting in args.settings:
                cases[(setting, k)]["step_s"].extend(times[setting])
                if "none" in times:
                    cases[(setting, k)]["vs_none"].extend(t / n for t, n in zip(times[setting], times["none"]))
                    cases[(setting, k)]["cpu_vs_none"].extend(
                        t / n for t, n in zip(cpu_times[setting], cpu_times["none"])
                    )
    load_after = os.getloadavg()
    rows = []
    print(f"{'setting':<8}{'k':>3}{'peak MiB (min-max)':>22}{'vs k=1':>9}{'ms/step':>10}{'vs none (min-max)':>22}"
          f"{'cpu vs none (min-max)':>24}")
    for setting in args.settings:
        for k in args.loops:
            case = cases[(setting, k)]
            peak = statistics.median(case["peak_bytes"])
            first = statistics.median(cases[(setting, args.loops[0])]["peak_bytes"])
            t = statistics.median(case["step_s"])
            vs_none, cpu_vs_none = (
                {"median": statistics.median(r), "min": min(r), "max": max(r)}
                for r in (case["vs_none"] or [float("nan")], case["cpu_vs_none"] or [float("nan")])
            )
            lo, hi = min(case["peak_bytes"]) / 2**20, max(case["peak_bytes"]) / 2**20
            rows.append({
                "setting": setting, "loops": k, "peak_bytes": case["peak_bytes"], "peak_vs_k1": peak / first,
                "step_s": case["step_s"], "median_step_s": t, "time_vs_none": vs_none,
                "cpu_time_vs_none": cpu_vs_none, "time_vs_none_per_round": case["vs_none"],
                "cpu_time_vs_none_per_round": case["cpu_vs_none"],
            })
            ratio = f"{vs_none['median']:.2f} ({vs_none['min']:.2f}-{vs_none['max']:.2f})"
            cpu_ratio = f"{cpu_vs_none['median']:.2f} ({cpu_vs_none['min']:.2f}-{cpu_vs_none['max']:.2f})"
            print(f"{setting:<8}{k:>3}{f'{peak / 2**20:.1f} ({lo:.1f}-{hi:.1f})':>22}{peak / first:>9.2f}"
                  f"{1e3 * t:>10.1f}{ratio:>22}{cpu_ratio:>24}")
    by = {(r["setting"], r["loops"]): r for r in rows}
    summary = {}
    if ("loop", 8) in by and ("loop", 1) in by:
        summary["loop_peak_k8_over_k1"] = by[("loop", 8)]["peak_vs_k1"]
        summary["loop_time_k8_over_none"] = by[("loop", 8)]["time_vs_none"]["median"]
        summary["loop_cpu_time_k8_over_none"] = by[("loop", 8)]["cpu_time_vs_none"]["median"]
    if ("bp1", 4) in by and ("none", 4) in by:
        summary["bp1_time_k4_over_none"] = by[("bp1", 4)]["time_vs_none"]["median"]
        summary["bp1_cpu_time_k4_over_none"] = by[("bp1", 4)]["cpu_time_vs_none"]["median"]
    for name, value in summary.items():
        print(f"{name}: {value:.3f}")
    print(f"load average (1, 5, 15 min): before {load_before}, after {load_after}")
    print("targets: loop_peak_k8_over_k1 <= 1.5, loop_time_k8_over_none <= 1.4, bp1_time_k4_over_none <= 0.6")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {"config": vars(args), "rows": rows, "summary": summary, "load_average": [load_before, load_after]},
            f, indent=2,
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
