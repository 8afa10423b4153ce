"""Generation benchmark: prefill and decode tokens/s and KV-cache bytes per loop count and cache policy.

Every figure comes from this one run, on the CPU, with untrained weights (speed does not depend on
them). For each k in 1..4 and each policy (per-loop, last-loop) one streamed generation gives the
prefill rate (prompt tokens over the time to the first token) and the decode rate (the remaining
tokens over the rest); the non-recurrent baseline (``LoopedLM.baseline``, the same layers) runs
the same way at k = 1. Variants are measured round-robin, after a warm-up, and the median of the
repeats is reported. Also the ELR model without conditioning at every k, and at k = 1 a batch of 16.

**Per-call constants.** ``generate`` builds each k's eq. 4 constants anew in every call (nothing is
kept across calls, so no change of the weights can leave them stale). The ``per_call`` table times,
in process CPU time (steady under other load, unlike wall clock), the build alone and whole
``generate`` calls (the prompt, then the new tokens, per-loop cache) against the same calls given a
runner built once beforehand (``serving_model(model, k)`` passed as the model: what the earlier
cross-call cache served on a hit), interleaved, median of ``--repeats``. ``--only per_call`` runs
that table alone.

The conditioned model decodes as ``generate`` serves it by default: each loop's eq. 4 constants
computed once per k, the weights shared (``elr_lightning.inference.fold``; on the CPU the RMSNorm's
per-token scalar is taken after the FiLM-and-adapter map, which dispatches fewer ops than
``rms_norm`` there). Beside it, per k and with the
per-loop cache: the same model with the conditioner run per token (``fold=False``, the model as
trained) and with the constants folded into copies of the weights (``fold_conditioning``, done once
before timing: the recurrent weights held k times). The target: served / unconditioned >= 0.95 at
every k, and served / baseline >= 0.95 at k = 1.

One torch thread by default: decoding one sequence is bound by per-op latency. On our 2-core
machines a second thread gained about 1.2x when the machine was quiet, and decoding ran 10x and
more slower with two threads than with one while other processes shared the cores.

    python bench/generate.py [--out bench/results/generate.json] [--threads 1] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from elr_lightning.inference.cache import KVCache
from elr_lightning.conditioning import LoopConditioner
from elr_lightning.config import ModelConfig
from elr_lightning.inference.fold import FoldedLM, fold_conditioning, serving_model
from elr_lightning.inference.cache import CACHE_POLICIES, kv_cache_bytes, layer_caches
from elr_lightning.inference.generate import generate, stream_generate
from elr_lightning.model import LoopedLM

CONFIG = ModelConfig(
    vocab_size=256, d_model=256, n_heads=8, n_in=2, n_rec=4, n_out=2, max_seq_len=512, max_loops=4
)
LOOPS = (1, 2, 3, 4)


def timed_stream(
    model: LoopedLM | FoldedLM, prompt: torch.Tensor, loops: int, policy: str, new_tokens: int, fold: bool | None
) -> tuple[float, float, KVCache]:
    """One greedy streamed generation: ``(prefill seconds, decode seconds, cache)``.

    Prefill ends when the first token arrives; decode covers the ``new_tokens - 1`` cached steps.
    """
    cache = CACHE_POLICIES[policy](max_len=prompt.shape[1] + new_tokens - 1)
    start = time.perf_counter()
    stream = stream_generate(
        model, prompt, loops=loops, kv_cache=cache, max_new_tokens=new_tokens, greedy=True, fold=fold
    )
    next(stream)
    first = time.perf_counter()
    for _ in stream:
        pass
    return first - start, time.perf_counter() - first, cache


def measure(
    variants: dict[str, Callable[[], tuple[float, float, KVCache]]], repeats: int
) -> dict[str, dict[str, Any]]:
    """Run every variant once to warm up, then ``repeats`` times round-robin; keep the medians."""
    for run in variants.values():
        run()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    caches: dict[str, KVCache] = {}
    for _ in range(repeats):
        for name, run in variants.items():
            prefill, decode, caches[name] = run()
            times[name].append((prefill, decode))
    return {
        name: {
            "prefill_s": statistics.median(p for p, _ in samples),
            "decode_s": statistics.median(d for _, d in samples),
            "cache": caches[name],
        }
        for name, samples in times.items()
    }


def per_call_cost(model: LoopedLM, prompt: torch.Tensor, new_tokens: int, repeats: int) -> dict[str, dict[str, float]]:
    """Per k: process CPU ms of building the constants, of a ``generate`` call, and of one given a prebuilt runner."""

    def cpu_ms(fn: Callable[[], Any]) -> float:
        start = time.process_time()
        fn()
        return 1000 * (time.process_time() - start)

    table = {}
    for k in LOOPS:
        runner = serving_model(model, k)
        calls = {
            "build_ms": lambda: serving_model(model, k),
            "call_ms": lambda: generate(model, prompt, loops=k, max_new_tokens=new_tokens, greedy=True),
            "prebuilt_call_ms": lambda: generate(runner, prompt, loops=k, max_new_tokens=new_tokens, greedy=True),
        }
        for fn in calls.values():
            fn()
        samples: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(repeats):
            for name, fn in calls.items():
                samples[name].append(cpu_ms(fn))
        row = {name: statistics.median(values) for name, values in samples.items()}
        row["call_over_prebuilt"] = row["call_ms"] / row["prebuilt_call_ms"]
        table[f"k{k}"] = row
    return table


def print_per_call(table: dict[str, dict[str, float]], prompt_len: int, new_tokens: int) -> None:
    """Print :func:`per_call_cost`'s table."""
    print(f"per-call constants (generate's default) against a runner built once; process CPU ms, prompt "
          f"{prompt_len}, {new_tokens} new tokens, per-loop cache")
    print(f"{'k':>2} {'build':>7} {'call':>8} {'prebuilt':>8} {'ratio':>6}")
    for k in LOOPS:
        row = table[f"k{k}"]
        print(f"{k:>2} {row['build_ms']:>7.2f} {row['call_ms']:>8.1f} {row['prebuilt_call_ms']:>8.1f} "
              f"{row['call_over_prebuilt']:>6.3f}")


def main() -> None:
    """Run the benchmark, print the tables and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", default="bench/results/generate.json", help="JSON output path.")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (see the module docstring).")
    parser.add_argument("--repeats", type=int, default=5, help="Timed repeats per variant (median reported).")
    parser.add_argument("--prompt_len", type=int, default=128, help="Prompt tokens.")
    parser.add_argument("--new_tokens", type=int, default=64, help="Generated tokens per run.")
    parser.add_argument("--only", choices=["all", "per_call"], default="all", help="Run one table only.")
    args = parser.parse_args()

    torch.set_flush_denormal(True)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    elr = LoopedLM(CONFIG, conditioner=LoopConditioner()).eval()
    plain = LoopedLM(CONFIG).eval()
    baseline = LoopedLM.baseline(CONFIG).eval()
    prompt = torch.randint(0, CONFIG.vocab_size, (1, args.prompt_len))
    batch_prompt = torch.randint(0, CONFIG.vocab_size, (16, args.prompt_len))
    n = args.new_tokens
    if args.only == "per_call":
        table = per_call_cost(elr, prompt, n, args.repeats)
        print_per_call(table, args.prompt_len, n)
        write(args.out, {"config": vars(CONFIG), "settings": vars(args), "per_call": table})
        return

    def run(
        model: LoopedLM | FoldedLM, loops: int, policy: str, ids: torch.Tensor = prompt, fold: bool | None = None
    ) -> Callable[[], tuple[float, float, KVCache]]:
        return lambda: timed_stream(model, ids, loops, policy, n, fold)

    variants = {f"elr/k{k}/{p}": run(elr, k, p) for k in LOOPS for p in CACHE_POLICIES}
    variants.update({f"elr_unfolded/k{k}/per_loop": run(elr, k, "per_loop", fold=False) for k in LOOPS})
    variants.update({f"elr_folded/k{k}/per_loop": run(fold_conditioning(elr, k), k, "per_loop") for k in LOOPS})
    variants["baseline/k1"] = run(baseline, 1, "per_loop")
    variants.update({f"elr_no_cond/k{k}": run(plain, k, "per_loop") for k in LOOPS})
    variants["elr/k1/batch16"] = run(elr, 1, "per_loop", batch_prompt)
    variants["elr_no_cond/k1/batch16"] = run(plain, 1, "per_loop", batch_prompt)
    variants["baseline/k1/batch16"] = run(baseline, 1, "per_loop", batch_prompt)

    load_before = os.getloadavg()
    start = time.perf_counter()
    results = measure(variants, args.repeats)
    per_call = per_call_cost(elr, prompt, n, args.repeats)
    wall = time.perf_counter() - start
    load_after = os.getloadavg()

    rows: dict[str, dict[str, Any]] = {}
    for name, r in results.items():
        cache: KVCache = r["cache"]
        batch = 16 if name.endswith("batch16") else 1
        rows[name] = {
            "prefill_tok_s": batch * args.prompt_len / r["prefill_s"],
            "decode_tok_s": batch * (n - 1) / r["decode_s"],
            "decode_ms_per_step": 1000 * r["decode_s"] / (n - 1),
            "kv_bytes_used": cache.nbytes(),
            "kv_bytes_allocated": cache.nbytes(used=False),
        }
    base_decode = rows["baseline/k1"]["decode_tok_s"]
    k1_bytes = rows["elr/k1/per_loop"]["kv_bytes_used"]

    print(
        f"model: d={CONFIG.d_model} heads={CONFIG.n_heads} n_in={CONFIG.n_in} n_rec={CONFIG.n_rec} "
        f"n_out={CONFIG.n_out} vocab={CONFIG.vocab_size}; LoopConditioner on; batch 1; prompt {args.prompt_len}, "
        f"{n} new tokens; {args.threads} threads; median of {args.repeats}"
    )
    header = f"{'k':>2} {'policy':>9} {'D_eff':>5} {'caches':>6} {'prefill tok/s':>13} {'decode tok/s':>12} "
    header += f"{'vs base':>7} {'KV used':>9} {'KV alloc':>9} {'KV/k1':>6}"
    print(header)
    print("-" * len(header))
    for k in LOOPS:
        for policy in CACHE_POLICIES:
            row = rows[f"elr/k{k}/{policy}"]
            assert row["kv_bytes_used"] == kv_cache_bytes(CONFIG, k, policy, args.prompt_len + n - 1)
            print(
                f"{k:>2} {policy:>9} {CONFIG.effective_depth(k):>5} {layer_caches(CONFIG, k, policy):>6} "
                f"{row['prefill_tok_s']:>13.0f} {row['decode_tok_s']:>12.1f} "
                f"{row['decode_tok_s'] / base_decode:>7.3f} {row['kv_bytes_used'] / 2**20:>7.2f}Mi "
                f"{row['kv_bytes_allocated'] / 2**20:>7.2f}Mi {row['kv_bytes_used'] / k1_bytes:>6.2f}"
            )
    base = rows["baseline/k1"]
    print(f"{1:>2} {'baseline':>9} {CONFIG.effective_depth(1):>5} {layer_caches(CONFIG, 1, 'per_loop'):>6} "
          f"{base['prefill_tok_s']:>13.0f} {base_decode:>12.1f} {1.0:>7.3f}")  # fmt: skip
    print()
    print("conditioned, per-loop cache, decode tok/s and ratio to the unconditioned model at the same k")
    print("(served: generate's default, constants per k, weights shared; unfolded: the conditioner per token;")
    print(" folded: fold_conditioning, the recurrent weights copied per loop). Target: served >= 0.95 at every k.")
    print(f"{'k':>2} {'no cond':>8} {'served':>8} {'ratio':>6} {'unfolded':>8} {'ratio':>6} {'folded':>8} {'ratio':>6}")
    for k in LOOPS:
        plain_rate = rows[f"elr_no_cond/k{k}"]["decode_tok_s"]
        line = f"{k:>2} {plain_rate:>8.1f}"
        for name in (f"elr/k{k}/per_loop", f"elr_unfolded/k{k}/per_loop", f"elr_folded/k{k}/per_loop"):
            line += f" {rows[name]['decode_tok_s']:>8.1f} {rows[name]['decode_tok_s'] / plain_rate:>6.3f}"
        print(line)

    ratios = {
        "elr_k1_over_baseline_decode": rows["elr/k1/per_loop"]["decode_tok_s"] / base_decode,
        "elr_no_cond_k1_over_baseline_decode": rows["elr_no_cond/k1"]["decode_tok_s"] / base_decode,
        "elr_folded_k1_over_baseline_decode": rows["elr_folded/k1/per_loop"]["decode_tok_s"] / base_decode,
        "elr_unfolded_k1_over_baseline_decode": rows["elr_unfolded/k1/per_loop"]["decode_tok_s"] / base_decode,
        "elr_k1_over_baseline_decode_batch16": rows["elr/k1/batch16"]["decode_tok_s"]
        / rows["baseline/k1/batch16"]["decode_tok_s"],
        "elr_no_cond_k1_over_baseline_decode_batch16": rows["elr_no_cond/k1/batch16"]["decode_tok_s"]
        / rows["baseline/k1/batch16"]["decode_tok_s"],
        "elr_k1_over_baseline_prefill": rows["elr/k1/per_loop"]["prefill_tok_s"] / base["prefill_tok_s"],
        **{
            f"elr{form}_k{k}_over_no_cond_decode": rows[f"elr{form}/k{k}/per_loop"]["decode_tok_s"]
            / rows[f"elr_no_cond/k{k}"]["decode_tok_s"]
            for form in ("", "_unfolded", "_folded")
            for k in LOOPS
        },
        "last_loop_k4_kv_over_k1": rows["elr/k4/last_loop"]["kv_bytes_used"] / k1_bytes,
        "per_loop_k4_kv_over_k1": rows["elr/k4/per_loop"]["kv_bytes_used"] / k1_bytes,
    }
    print()
    print_per_call(per_call, args.prompt_len, n)
    print()
    print("ratios (k = 1 over the baseline; target >= 0.95 for the served conditioned model):")
    for name, value in ratios.items():
        print(f"  {name:45s} {value:.3f}")
    for name in ("elr/k1/batch16", "elr_no_cond/k1/batch16", "baseline/k1/batch16", "elr_no_cond/k1"):
        print(f"  {name:45s} decode {rows[name]['decode_tok_s']:.1f} tok/s")
    print(f"measured in {wall:.1f} s; load average (1/5/15 min) before {load_before}, after {load_after}")

    report = {
        "config": vars(CONFIG),
        "settings": {
            "threads": args.threads,
            "repeats": args.repeats,
            "prompt_len": args.prompt_len,
            "new_tokens": n,
            "torch": torch.__version__,
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "wall_s": wall,
            "load_average_before": load_before,
            "load_average_after": load_after,
        },
        "results": rows,
        "per_call": per_call,
        "ratios": ratios,
    }
    write(args.out, report)


def write(path: str, report: dict[str, Any]) -> None:
    """Write ``report`` as JSON to ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
