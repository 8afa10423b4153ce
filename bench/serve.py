"""Serving benchmark: continuous batching with mixed k in one step, against the cohort engine it replaced.

Two tables, one run, one process (the engines are driven directly, as the server's worker drives
them, so the numbers are the engine's and not the HTTP stack's):

1. **Continuous vs cohort.** A closed loop of ``--clients`` clients, each sending its next request
   as soon as its last one finished, over ``--requests`` requests with k cycling over 1 / 2 / 3,
   prompt lengths drawn from ``--prompt_len`` and completion lengths from ``--max_tokens``
   (seeded). Admission follows LitServe's rule for both engines: a request enters once fewer than
   ``--max_batch_size`` are active. The baseline is the cohort engine of the commit before
   continuous batching (``git show BASELINE:elr_lightning/serve/engine.py``, loaded as it was):
   requests of one k that arrive together form a cohort that keeps its rows until all end, one
   forward pass per cohort. Reported: completion tokens/s and p50/p99 request latency, and the
   ratios (target: >= 1.5x tokens/s).
2. **Mixed k vs single k.** A batch of ``--mixed_rows`` rows decoding ``--steps`` steps, all at
   k = 1, all at 2, all at 3, and mixed (k cycling 1 / 2 / 3 over the rows), each timed
   ``--repeats`` times interleaved in this process; a timing is the mean step time over the
   steps after a warm-up step, and each mix keeps its fastest timing. A least-squares line
   ``t = a + b * sum(k)`` through the three single-k points (sum(k) = rows * k) predicts the
   mixed step's time from its sum(k) (= rows * 2, the same row-loops as all k = 2); the ratio
   predicted / measured is the share of the sum(k) throughput the mixed step reaches (target
   >= 0.9). Each step is timed twice: wall clock, and the CPU time of the decoding thread
   (``time.thread_time``, the same work without the time the thread waited for a core, which
   dominates on a shared machine; with ``OMP_NUM_THREADS=1`` all of torch's work runs in that
   thread). The ratio is printed for both.

Without ``--ckpt_path`` it serves an untrained model of ``--d_model`` (speed does not depend on
the weights). Writes ``bench/results/serve.json``.

    python bench/serve.py [--ckpt_path X] [--d_model 256] [--clients 12] [--requests 96] [--kv_cache last_loop]
        [--tables both|closed_loop|mixed] [--decoder_baseline COMMIT]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from elr_lightning.conditioning import LoopConditioner
from elr_lightning.config import ModelConfig
from elr_lightning.inference.decode import Decoder
from elr_lightning.model import LoopedLM
from elr_lightning.serve.engine import CompletionRequest, DecodeEngine
from elr_lightning.inference.generate import load_model
from elr_lightning.tokenizers import ByteTokenizer

#: The last commit with the cohort engine.
BASELINE = "fe91c56"
#: Imports of the old engine that moved since (the names are the same objects).
MOVED = {
    "from elr_lightning.inference.generate import PolicyLike, left_pad, resolve_policy, sample_next":
        "from elr_lightning.inference.cache import PolicyLike, resolve_policy\n"
        "from elr_lightning.inference.prompts import left_pad\nfrom elr_lightning.inference.generate import sample_next",
    "from elr_lightning.fold import FoldedLM\n": "from elr_lightning.inference.fold import FoldedLM\n",
}


def module_at(root: Path, commit: str, path: str, name: str, moved: dict[str, str]) -> ModuleType:
    """The module at ``path`` as it was at ``commit`` (``git show``), imported as ``name`` after the ``moved`` edits."""
    source = subprocess.run(
        ["git", "show", f"{commit}:{path}"], cwd=root, capture_output=True, text=True, check=True
    ).stdout
    for old, new in moved.items():
        source = source.replace(old, new)
    with tempfile.NamedTemporaryFile("w", suffix=f"_{name}.py", delete=False) as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(name, f.name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    os.unlink(f.name)
    return module


def cohort_engine_class(root: Path) -> type:
    """The baseline's ``DecodeEngine``, loaded from git as it was at :data:`BASELINE`."""
    return module_at(root, BASELINE, "elr_lightning/serve/engine.py", "cohort_engine", MOVED).DecodeEngine


def workload(args: argparse.Namespace, loops: list[int]) -> list[tuple[tuple[int, ...], int, int]]:
    """``(prompt_ids, k, max_tokens)`` per request, seeded; prompts cut from this file's own text."""
    rng = random.Random(args.seed)
    text = Path(__file__).read_bytes()
    lo_p, hi_p = args.prompt_len
    lo_t, hi_t = args.max_tokens
    out = []
    for i in range(args.requests):
        n = rng.randint(lo_p, hi_p)
        start = rng.randint(0, len(text) - n)
        out.append((tuple(text[start : start + n]), loops[i % len(loops)], rng.randint(lo_t, hi_t)))
    return out


def closed_loop(engine: Any, jobs: list, clients: int, max_batch: int) -> dict[str, Any]:
    """Drive ``engine`` as the server's loop does, ``clients`` requests outstanding; tokens/s and latencies."""
    waiting = list(range(len(jobs)))[::-1]
    outstanding: list[int] = []
    started: dict[str, float] = {}
    latency: dict[int, float] = {}
    tokens = 0
    begin = time.perf_counter()
    while waiting or outstanding:
        while waiting and len(outstanding) < clients:
            outstanding.append(waiting.pop())
        for i in list(outstanding):
            uid = str(i)
            if uid not in started and engine.active < max_batch:
                prompt, k, max_tokens = jobs[i]
                started[uid] = time.perf_counter()
                engine.submit(uid, CompletionRequest(prompt, k, max_tokens, 0.0))
        for event in engine.step():
            if event.finish_reason is not None:
                i = int(event.uid)
                latency[i] = time.perf_counter() - started[event.uid]
                tokens += event.completion_tokens
                outstanding.remove(i)
    wall = time.perf_counter() - begin
    lat = sorted(latency.values())
    return {
        "wall_s": wall,
        "completion_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "p50_s": statistics.median(lat),
        "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
    }


def step_time(
    model: LoopedLM, depths: list[int], steps: int, kv_cache: str, decoder_class: type = Decoder
) -> tuple[float, float]:
    """Mean seconds of one decode step of a full batch of rows at ``depths``: wall clock and thread CPU time."""
    rows = len(depths)
    decoder = decoder_class(model, rows, 8 + steps + 1, kv_cache)
    for slot, k in enumerate(depths):
        decoder.prefill(slot, torch.arange(1, 9), k)
    tokens = torch.full((rows,), 7)
    decoder.step(list(range(rows)), tokens, depths)  # warm-up
    begin, cpu = time.perf_counter(), time.thread_time()
    for _ in range(steps - 1):
        decoder.step(list(range(rows)), tokens, depths)
    return (time.perf_counter() - begin) / (steps - 1), (time.thread_time() - cpu) / (steps - 1)


def sum_k_ratio(single: dict[int, float], mixed: float, rows: int, mixed_sum: int) -> tuple[float, float, float]:
    """``(intercept, slope, predicted)`` of the line through the single-k times at sum(k) = rows * k, at ``mixed_sum``."""
    slope, intercept = statistics.linear_regression([rows * k for k in single], list(single.values()))
    return intercept, slope, intercept + slope * mixed_sum


def continuous_table(model: LoopedLM, jobs: list, loops: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """Table 1: the closed loop through the cohort engine and the continuous one."""
    tok = ByteTokenizer()
    cohort_cls = cohort_engine_class(Path(__file__).resolve().parents[1])
    closed_loop(DecodeEngine(model, tok, args.kv_cache, max_batch_size=args.max_batch_size), jobs[:4], 4, 4)
    runs = {
        "cohort": closed_loop(cohort_cls(model, tok, args.kv_cache), jobs, args.clients, args.max_batch_size),
        "continuous": closed_loop(
            DecodeEngine(model, tok, args.kv_cache, max_batch_size=args.max_batch_size), jobs, args.clients,
            args.max_batch_size,
        ),
    }
    cont, coh = runs["continuous"], runs["cohort"]
    throughput_ratio = cont["tokens_per_s"] / coh["tokens_per_s"]
    print(f"closed loop: {args.requests} requests, k cycling {loops}, prompts {args.prompt_len[0]}-{args.prompt_len[1]} "
          f"tokens, completions {args.max_tokens[0]}-{args.max_tokens[1]}, {args.clients} clients, "
          f"max_batch_size {args.max_batch_size}, kv_cache {args.kv_cache}, d_model {model.config.d_model}")
    print(f"{'engine':11s} {'tok/s':>8s} {'p50 s':>7s} {'p99 s':>7s}")
    for name, r in runs.items():
        print(f"{name:11s} {r['tokens_per_s']:8.1f} {r['p50_s']:7.3f} {r['p99_s']:7.3f}")
    print(f"continuous / cohort: tokens/s {throughput_ratio:.2f}x (target >= 1.5x), "
          f"p50 {cont['p50_s'] / coh['p50_s']:.2f}x, p99 {cont['p99_s'] / coh['p99_s']:.2f}x")
    return {
        "baseline": BASELINE,
        "closed_loop": runs,
        "continuous_over_cohort": {"tokens_per_s": throughput_ratio, "p50": cont["p50_s"] / coh["p50_s"],
                                   "p99": cont["p99_s"] / coh["p99_s"]},
    }  # fmt: skip


def mixed_table(model: LoopedLM, loops: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """Table 2: one step of mixed k against steps of single k, wall clock and thread CPU time.

    With ``--decoder_baseline COMMIT`` the same table is timed, interleaved, for that commit's
    ``Decoder`` too (loaded from git), and its ratios are printed beside the current ones.
    """
    rows = args.mixed_rows - args.mixed_rows % len(loops) or len(loops)
    mixed_depths = [loops[i % len(loops)] for i in range(rows)]
    mixes = {**{k: [k] * rows for k in loops}, "mixed": mixed_depths}
    decoders = {"current": Decoder}
    if args.decoder_baseline:
        root = Path(__file__).resolve().parents[1]
        decoders[args.decoder_baseline] = module_at(
            root, args.decoder_baseline, "elr_lightning/inference/decode.py", "baseline_decode", {}
        ).Decoder
    times: dict = {(d, name): [] for d in decoders for name in mixes}
    for repeat in range(args.repeats):
        # The decoders take turns going first in a round, so that neither gains from its place.
        for d, decoder_class in list(decoders.items())[:: -1 if repeat % 2 else 1]:
            for name, depths in mixes.items():
                times[(d, name)].append(step_time(model, depths, args.steps, args.kv_cache, decoder_class))
    out: dict[str, Any] = {"mixed_depths": mixed_depths}
    print(f"\none step of {rows} rows, k cycling {loops} in the mixed one, kv_cache {args.kv_cache}, "
          f"d_model {model.config.d_model}")
    for d in decoders:
        tag = "" if d == "current" else f"_{d}"
        for clock, j in (("wall", 0), ("cpu", 1)):
            single = {k: min(t[j] for t in times[(d, k)]) for k in loops}
            mixed = min(t[j] for t in times[(d, "mixed")])
            intercept, slope, predicted = sum_k_ratio(single, mixed, rows, sum(mixed_depths))
            print(f"{d[:8]:8s} {clock:4s}: " + ", ".join(f"k={k} {t * 1e3:.2f} ms" for k, t in single.items())
                  + f", mixed {mixed * 1e3:.2f} ms; sum(k) line {intercept * 1e3:.2f} ms + {slope * 1e3:.3f} ms per "
                  f"row-loop, predicted mixed {predicted * 1e3:.2f} ms: mixed reaches {predicted / mixed:.2f} of the "
                  "sum(k) throughput (target >= 0.9)")
            out[f"step_s_{clock}{tag}"] = {"single": single, "mixed": mixed, "predicted_mixed": predicted,
                                           "line": [intercept, slope]}  # fmt: skip
            out[f"mixed_over_sum_k_prediction_{clock}{tag}"] = predicted / mixed
    if args.decoder_baseline:
        speedup = {clock: min(t[j] for t in times[(args.decoder_baseline, "mixed")])
                   / min(t[j] for t in times[("current", "mixed")]) for clock, j in (("wall", 0), ("cpu", 1))}
        print(f"mixed step, {args.decoder_baseline} time / current time: cpu {speedup['cpu']:.3f}, "
              f"wall {speedup['wall']:.3f}")
        out["mixed_speedup_over_baseline"] = speedup
    return out


def untrained(d_model: int) -> LoopedLM:
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=256, d_model=d_model, n_heads=4, n_in=1, n_rec=2, n_out=1, max_seq_len=256, max_loops=3
    )
    return LoopedLM(config, conditioner=LoopConditioner(d_cond=32, rank=4)).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--ckpt_path", default=None, help="Checkpoint; default an untrained model of --d_model.")
    parser.add_argument("--d_model", type=int, default=256, help="Width of the untrained model.")
    parser.add_argument("--clients", type=int, default=12, help="Requests outstanding at once (closed loop).")
    parser.add_argument("--requests", type=int, default=96, help="Requests in the closed-loop run.")
    parser.add_argument("--max_batch_size", type=int, default=8, help="Slots / most requests active at once.")
    parser.add_argument("--prompt_len", type=int, nargs=2, default=(4, 64), help="Prompt lengths, min max.")
    parser.add_argument("--max_tokens", type=int, nargs=2, default=(8, 96), help="Completion lengths, min max.")
    parser.add_argument("--steps", type=int, default=8, help="Decode steps per mixed/single-k timing.")
    parser.add_argument("--mixed_rows", type=int, default=96, help="Rows of the mixed/single-k timing.")
    parser.add_argument("--repeats", type=int, default=3, help="Timings per depth mix (the fastest kept).")
    parser.add_argument("--kv_cache", default="last_loop", choices=["last_loop", "per_loop"])
    parser.add_argument("--decoder_baseline", default=None, help="Also time the mixed table with this commit's Decoder.")
    parser.add_argument("--tables", default="both", choices=["both", "closed_loop", "mixed"], help="Tables to run.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results/serve.json", help="JSON output path.")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.set_flush_denormal(True)
    model = untrained(args.d_model) if args.ckpt_path is None else load_model(args.ckpt_path)[0]
    loops = list(range(1, min(3, model.config.max_loops) + 1))
    jobs = workload(args, loops)

    report: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "threads": torch.get_num_threads()},
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
    }  # fmt: skip
    if args.tables in ("both", "closed_loop"):
        report.update(continuous_table(model, jobs, loops, args))
    if args.tables in ("both", "mixed"):
        report.update(mixed_table(model, loops, args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
