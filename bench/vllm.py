"""vLLM against ``elr serve`` on one checkpoint: completion tokens/s and p50/p99 latency at 1, 8 and 32 clients.

Both servers run the same ELR checkpoint (``elr serve`` the ``.ckpt``, ``vllm serve`` its ``elr
export`` folder through the plugin) under the same cache policy, at the same time on one machine; the
measurements are interleaved (each round runs every concurrency level on one server, then the other,
the order alternating between rounds), so a change in the machine's load touches both. A level is a
closed loop: ``C`` clients, each sending its next request as soon as its last one is answered, over
``--requests`` requests of greedy completions with k cycling over ``--loops`` (the k is sent as
``loops`` to ``elr serve`` and as ``vllm_xargs.loops`` to vLLM). Reported per server and level, the
best round: completion tokens/s (completion tokens / wall time of the level), p50 and p99 request
latency; and vLLM's tokens/s over ``elr serve``'s.

Without ``--ckpt_path`` it trains nothing: an untrained model of ``--d_model`` (head size 64, the size
vLLM's CPU attention takes) is saved and exported (speed does not depend on the weights).

    python bench/vllm.py [--ckpt_path X] [--d_model 256] [--requests 64] [--max_tokens 32] [--rounds 2]
        [--levels 1 8 32] [--kv_cache per_loop] [--device cpu|cuda] [--out bench/results/vllm.json]
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
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ("def main(", "import os\nimport sys\n", "class Config:\n    ", "for i in range(", "# Parse the file\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_checkpoint(out: Path, d_model: int) -> Path:
    """An untrained 1 + 2 x k + 1 layer model of width ``d_model``, heads of 64, saved as a Lightning checkpoint."""
    import torch

    from elr_lightning.conditioning import LoopConditioner
    from elr_lightning.config import ModelConfig
    from elr_lightning.hf.export import save_module_checkpoint
    from elr_lightning.module import ELRModule

    torch.manual_seed(0)
    arch = ModelConfig(vocab_size=256, d_model=d_model, n_heads=d_model // 64, n_in=1, n_rec=2, n_out=1,
                       max_loops=3, max_seq_len=512)  # fmt: skip
    path = out / "bench.ckpt"
    save_module_checkpoint(ELRModule(arch=arch, conditioner=LoopConditioner(d_cond=32, rank=4)), path)
    return path


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"bench/vllm.py: a server exited at start; its log:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"bench/vllm.py: {url} not healthy after {timeout:.0f} s")
        time.sleep(1)


def start(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log, "wb") as err:
        return subprocess.Popen(cmd, env=env, start_new_session=True, stdout=err, stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as r:
        return json.loads(r.read())


def level(url: str, name: str, clients: int, requests: int, max_tokens: int, loops: list[int]) -> dict[str, float]:
    """A closed loop of ``clients`` over ``requests`` requests; tokens/s and latency percentiles."""

    def one(i: int) -> tuple[float, int]:
        k = loops[i % len(loops)]
        body = {"model": "bench", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0}
        body.update({"vllm_xargs": {"loops": k}} if name == "vllm" else {"loops": k})
        t = time.perf_counter()
        answer = post(f"{url}/v1/completions", body)
        return time.perf_counter() - t, answer["usage"]["completion_tokens"]

    start_time = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        done = list(pool.map(one, range(requests)))
    wall = time.perf_counter() - start_time
    latencies = sorted(t for t, _ in done)
    return {
        "tokens_per_s": sum(n for _, n in done) / wall,
        "p50_s": statistics.median(latencies),
        "p99_s": latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))],
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt_path", default=None, help="An ELR checkpoint; default: an untrained one of --d_model.")
    parser.add_argument("--d_model", type=int, default=256)
    parser.add_argument("--requests", type=int, default=64, help="Requests per level and server.")
    parser.add_argument("--max_tokens", type=int, default=32)
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32], help="Concurrent clients.")
    parser.add_argument("--loops", type=int, nargs="+", default=[1, 2, 3], help="k of the requests, cycled.")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kv_cache", choices=["per_loop", "last_loop"], default="per_loop")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "vllm.json"))
    args = parser.parse_args()

    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    work = Path(tempfile.mkdtemp(prefix="elr-bench-vllm-"))
    ckpt = Path(args.ckpt_path) if args.ckpt_path else tiny_checkpoint(work, args.d_model)
    export = work / "export"
    subprocess.run([sys.executable, "-m", "elr_lightning.cli", "export", "--ckpt_path", str(ckpt), "--out", str(export)],
                   env=env, check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    most = max(args.levels)
    ports = {"elr": free_port(), "vllm": free_port()}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    elr_cmd = [sys.executable, "-m", "elr_lightning.cli", "serve", "--ckpt_path", str(ckpt), "--port", str(ports["elr"]),
               "--kv_cache", args.kv_cache, "--max_batch_size", str(most), "--max_loops", str(max(args.loops)),
               "--accelerator", args.device]  # fmt: skip
    # `vllm serve`'s module (vllm-cpu 0.32.0's `vllm` command fails: it asks the version of a distribution `vllm`)
    vllm_cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(export), "--port", str(ports["vllm"]),
                "--served-model-name", "bench", "--dtype", "float32", "--max-num-seqs", str(most),
                "--hf-overrides", json.dumps({"elr_kv_cache": args.kv_cache, "elr_max_serve_loops": max(args.loops)})]
    if args.device == "cpu":
        vllm_cmd.append("--enforce-eager")  # fmt: skip
    procs = {"elr": start(elr_cmd, work / "elr.log", env), "vllm": start(vllm_cmd, work / "vllm.log", env)}
    results: dict[str, dict[str, list]] = {name: {str(c): [] for c in args.levels} for name in procs}
    try:
        for name in procs:
            wait_healthy(urls[name], procs[name], work / f"{name}.log")
            level(urls[name], name, 2, 4, 4, args.loops)  # warm-up
        for r in range(args.rounds):
            order = ["elr", "vllm"] if r % 2 == 0 else ["vllm", "elr"]
            for clients in args.levels:
                for name in order:
                    got = level(urls[name], name, clients, args.requests, args.max_tokens, args.loops)
                    results[name][str(clients)].append(got)
                    print(f"round {r} {name:4s} clients {clients:2d}: {got['tokens_per_s']:8.1f} tok/s "
                          f"p50 {got['p50_s']:.3f} s p99 {got['p99_s']:.3f} s", flush=True)  # fmt: skip
    finally:
        for proc in procs.values():
            stop(proc)
    best = {name: {c: max(runs, key=lambda x: x["tokens_per_s"]) for c, runs in per.items()} for name, per in results.items()}
    table = []
    for c in map(str, args.levels):
        ratio = best["vllm"][c]["tokens_per_s"] / best["elr"][c]["tokens_per_s"]
        table.append({"clients": int(c), "elr_serve": best["elr"][c], "vllm": best["vllm"][c], "vllm_over_elr_tokens_per_s": ratio})
        print(f"clients {c:>2}: elr serve {best['elr'][c]['tokens_per_s']:8.1f} tok/s, vLLM "
              f"{best['vllm'][c]['tokens_per_s']:8.1f} tok/s: x{ratio:.2f}")  # fmt: skip
    report = {
        "args": vars(args), "machine": platform.machine(), "python": platform.python_version(),
        "cpu_count": os.cpu_count(), "table": table, "rounds": results,
    }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
