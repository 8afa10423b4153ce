"""Serving benchmark: ``elr serve`` under a fixed concurrent load, per loop count and mixed.

Starts the real server (a subprocess on a free loopback port) over a checkpoint, then sends the
same bounded traffic in each scenario: ``--clients`` threads, each posting non-streamed
completions back to back until ``--requests`` are done (or ``--time_budget`` seconds pass).
Scenarios: all requests at k = 1, at k = 2, ..., and mixed traffic (k cycling over 1..K). Per
scenario it reports completion tokens/s and p50/p95 request latency, per k; ratios are against
k = 1 measured in the same run, beside D_eff(1) / D_eff(k) (eq. 1), the slowdown the recurrent
depth alone predicts. The mixed scenario's tokens/s is compared with the single-k runs' rate for
the same request mix (the harmonic mean: each request costs what it costs alone at its k).

KV memory: the same batch of requests is run through the serving engine in-process under the
last-loop and per-loop policies; the peak attention KV bytes held at each k are reported with
their ratio to k = 1 (the paper: per-loop grows as D_eff(k), last-loop stays at 1x).

Without ``--ckpt_path`` it serves an untrained quickstart-sized model (speed does not depend on the
weights), written to a temporary checkpoint.

    python bench/serve.py [--ckpt_path X] [--clients 4] [--requests 24] [--max_tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch

from elr_lightning.conditioning import LoopConditioner
from elr_lightning.config import ModelConfig
from elr_lightning.generation import load_model
from elr_lightning.module import ELRModule
from elr_lightning.serve.engine import CompletionRequest, DecodeEngine
from elr_lightning.tokenizers import ByteTokenizer

QUICKSTART = ModelConfig(
    vocab_size=256, d_model=128, n_heads=4, n_in=1, n_rec=2, n_out=1, max_seq_len=256, max_loops=3
)
PROMPTS = ["def main(argv):\n", "import os\nimport sys\n", "class Parser(object):\n", "    return self._"]


def write_untrained(path: Path) -> None:
    """An untrained quickstart-sized checkpoint, written the way Lightning writes one."""
    import lightning

    torch.manual_seed(0)
    module = ELRModule(arch=QUICKSTART, conditioner=LoopConditioner(d_cond=32, rank=4))
    checkpoint = {
        "state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams),
        "pytorch-lightning_version": lightning.__version__, "epoch": 0, "global_step": 0,
    }
    module.on_save_checkpoint(checkpoint)
    torch.save(checkpoint, path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(ckpt: str, port: int, max_batch_size: int, kv_cache: str) -> subprocess.Popen:
    server = subprocess.Popen(
        [sys.executable, "-m", "elr_lightning.cli", "serve", "--ckpt_path", ckpt, "--port", str(port),
         "--max_batch_size", str(max_batch_size), "--kv_cache", kv_cache, "--accelerator", "cpu"],
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"elr serve exited with {server.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return server
        except OSError:
            time.sleep(0.5)
    stop_server(server)
    raise RuntimeError("elr serve did not become healthy in 120 s")


def stop_server(server: subprocess.Popen) -> None:
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=10)


def run_traffic(port: int, loops_cycle: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """Send ``args.requests`` completions from ``args.clients`` threads; per-request ``(k, latency, tokens)``."""
    lock, done, records = threading.Lock(), [0], []
    deadline = time.monotonic() + args.time_budget

    def client(cid: int) -> None:
        while time.monotonic() < deadline:
            with lock:
                n = done[0]
                if n >= args.requests:
                    return
                done[0] += 1
            k = loops_cycle[n % len(loops_cycle)]
            body = {"prompt": PROMPTS[n % len(PROMPTS)], "max_tokens": args.max_tokens, "loops": k,
                    "temperature": 0.8, "seed": n}
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            start = time.perf_counter()
            with urllib.request.urlopen(request, timeout=args.time_budget + 60) as r:
                answer = json.loads(r.read())
            with lock:
                records.append((k, time.perf_counter() - start, answer["usage"]["completion_tokens"]))

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    per_k = {}
    for k in sorted(set(loops_cycle)):
        lat = sorted(r[1] for r in records if r[0] == k)
        if not lat:
            continue
        per_k[k] = {
            "requests": len(lat),
            "p50_s": statistics.median(lat),
            "p95_s": lat[min(len(lat) - 1, round(0.95 * (len(lat) - 1)))],
            "tokens": sum(r[2] for r in records if r[0] == k),
        }
    tokens = sum(r[2] for r in records)
    return {"wall_s": wall, "requests": len(records), "tokens": tokens, "tokens_per_s": tokens / wall, "per_k": per_k}


def cache_memory(ckpt: str, loops: list[int], batch: int, max_tokens: int) -> dict[str, dict[int, int]]:
    """Peak attention KV bytes the engine holds for ``batch`` requests at each k, per policy."""
    model, _ = load_model(ckpt)
    tok = ByteTokenizer()
    out: dict[str, dict[int, int]] = {}
    for policy in ("last_loop", "per_loop"):
        out[policy] = {}
        for k in loops:
            engine = DecodeEngine(model, tok, policy)
            for i in range(batch):
                engine.submit(str(i), CompletionRequest(tuple(tok.encode(PROMPTS[i % len(PROMPTS)])), k, max_tokens, 0.0))
            peak = 0
            while engine.active:
                engine.step()
                peak = max(peak, engine.kv_cache_bytes())
            out[policy][k] = peak
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--ckpt_path", default=None, help="Checkpoint to serve; default an untrained quickstart model.")
    parser.add_argument("--clients", type=int, default=4, help="Concurrent client threads.")
    parser.add_argument("--requests", type=int, default=24, help="Requests per scenario.")
    parser.add_argument("--max_tokens", type=int, default=32, help="Completion tokens per request.")
    parser.add_argument("--max_batch_size", type=int, default=8, help="Server --max_batch_size.")
    parser.add_argument("--kv_cache", default="last_loop", help="Server --kv_cache.")
    parser.add_argument("--time_budget", type=float, default=120.0, help="Seconds per scenario at most.")
    parser.add_argument("--out", default="bench/results/serve.json", help="JSON output path.")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.ckpt_path
        if ckpt is None:
            ckpt = str(Path(tmp) / "untrained.ckpt")
            write_untrained(Path(ckpt))
        model, _ = load_model(ckpt)
        config = model.config
        loops = list(range(1, config.max_loops + 1))
        port = free_port()
        server = start_server(ckpt, port, args.max_batch_size, args.kv_cache)
        try:
            run_traffic(port, [1], argparse.Namespace(**{**vars(args), "requests": args.clients}))  # warm-up
            scenarios = {f"k{k}": run_traffic(port, [k], args) for k in loops}
            scenarios["mixed"] = run_traffic(port, loops, args)
        finally:
            stop_server(server)
        memory = cache_memory(ckpt, loops, args.clients, args.max_tokens)

    base = scenarios["k1"]["tokens_per_s"]
    mixed_expected = len(loops) / sum(1 / scenarios[f"k{k}"]["tokens_per_s"] for k in loops)
    print(f"{args.clients} clients, {args.requests} requests per scenario, {args.max_tokens} tokens each, "
          f"--kv_cache {args.kv_cache}, --max_batch_size {args.max_batch_size}")
    print(f"{'scenario':8s} {'tok/s':>8s} {'vs k=1':>7s} {'D(1)/D(k)':>9s} {'p50 s':>7s} {'p95 s':>7s}")
    for k in loops:
        s = scenarios[f"k{k}"]
        pk = s["per_k"][k]
        print(f"k={k:<6d} {s['tokens_per_s']:8.1f} {s['tokens_per_s'] / base:7.3f} "
              f"{config.effective_depth(1) / config.effective_depth(k):9.3f} {pk['p50_s']:7.3f} {pk['p95_s']:7.3f}")
    m = scenarios["mixed"]
    print(f"mixed    {m['tokens_per_s']:8.1f} {m['tokens_per_s'] / base:7.3f}   (single-k rate for this mix: "
          f"{mixed_expected:.1f} tok/s; mixed / that = {m['tokens_per_s'] / mixed_expected:.3f})")
    for k, pk in m["per_k"].items():
        single = scenarios[f"k{k}"]["per_k"][k]
        print(f"  k={k} in mixed traffic: p50 {pk['p50_s']:.3f} s, p95 {pk['p95_s']:.3f} s "
              f"(p50 {pk['p50_s'] / single['p50_s']:.2f}x its single-k p50)")
    print(f"KV cache peak bytes for {args.clients} requests (ratio to k = 1):")
    for policy, by_k in memory.items():
        print(f"  {policy:9s}: " + ", ".join(f"k={k} {b} B ({b / by_k[1]:.2f}x)" for k, b in by_k.items()))

    report = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "threads": os.environ.get("OMP_NUM_THREADS")},
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "config": {"d_model": config.d_model, "n_in": config.n_in, "n_rec": config.n_rec, "n_out": config.n_out,
                   "max_loops": config.max_loops},
        "scenarios": scenarios,
        "ratios": {
            "tokens_per_s_vs_k1": {k: scenarios[f"k{k}"]["tokens_per_s"] / base for k in loops},
            "d_eff_1_over_k": {k: config.effective_depth(1) / config.effective_depth(k) for k in loops},
            "mixed_over_single_k_mix": m["tokens_per_s"] / mixed_expected,
        },
        "kv_cache_peak_bytes": memory,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
