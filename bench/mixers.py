"""Token-mixer benchmark: GDP-Hybrid against all-attention of the same width and depth, on the CPU.

Every figure comes from this one run, with untrained weights (speed does not depend on them):

1. Train-step tokens/s (forward and backward at k = 1, fp32) of the hybrid (Gated DeltaProduct
   and attention 3:1, as config/4b.yaml) and of the all-attention model at sequence lengths 256,
   1024 and 4096, with the same tokens per step; the hybrid / attention ratio per length shows how
   each model's cost grows with length.
2. Decode tokens/s (greedy, per-loop cache, k = 1 and 2) after a prompt of 4096 tokens, and the
   cache bytes per token at that context: attention KV plus recurrent state, divided by 4096.
3. The PyTorch chunked recurrence against a plain token-by-token loop of the same formula at
   length 1024 (forward, and forward plus backward); the issue asks for at least 5x.

Variants run round-robin after a warm-up; the median of the repeats is reported.

    python bench/mixers.py [--out bench/results/mixers.json] [--threads 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

from elr_lightning.inference.cache import PerLoopCache, kv_cache_bytes, recurrent_state_bytes
from elr_lightning.config import ModelConfig
from elr_lightning.inference.generate import stream_generate
from elr_lightning.mixers.delta_rule import chunked_delta_product
from elr_lightning.model import LoopedLM

ATTENTION = ModelConfig(vocab_size=256, d_model=128, n_heads=2, n_in=4, n_rec=4, n_out=4, max_seq_len=4200, max_loops=2)
HYBRID = replace(
    ATTENTION,
    token_pattern=["gdp", "gdp", "gdp", "attention"],
    mixers={"gdp": {"class_path": "elr_lightning.mixers.GatedDeltaProduct", "init_args": {"num_householder": 2}}},
)
LENGTHS = (256, 1024, 4096)
TOKENS_PER_STEP = 4096
CONTEXT = 4096


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def train_step(model: LoopedLM, batch: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        logits = model(batch[:, :-1], 1)
        F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
        model.zero_grad(set_to_none=True)

    return step


def bench_train(models: dict[str, LoopedLM], repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for length in LENGTHS:
        batch = torch.randint(0, 256, (TOKENS_PER_STEP // length, length + 1))
        steps = {name: train_step(m, batch) for name, m in models.items()}
        for step in steps.values():
            step()  # warm-up
        rates = {name: TOKENS_PER_STEP / median_time(step, repeats) for name, step in steps.items()}
        ratio = rates["hybrid"] / rates["attention"]
        out[length] = {**{f"{n}_tok_s": r for n, r in rates.items()}, "hybrid_over_attention": ratio}
        print(f"train  T={length:5d}: hybrid {rates['hybrid']:8.0f} tok/s  attention {rates['attention']:8.0f} tok/s  "
              f"ratio {ratio:.2f}x", flush=True)  # fmt: skip
    return out


def bench_decode(models: dict[str, LoopedLM], repeats: int, new_tokens: int = 33) -> dict[str, Any]:
    out: dict[str, Any] = {}
    prompt = torch.randint(0, 256, (1, CONTEXT))
    for loops in (1, 2):
        rates = {}
        for name, model in models.items():
            times = []
            for _ in range(repeats):
                cache = PerLoopCache(max_len=CONTEXT + new_tokens)
                stream = stream_generate(
                    model, prompt, loops=loops, kv_cache=cache, max_new_tokens=new_tokens, greedy=True
                )
                next(stream)
                first = time.perf_counter()
                for _ in stream:
                    pass
                times.append(time.perf_counter() - first)
            rates[name] = (new_tokens - 1) / statistics.median(times)
            config = model.config
            kv = kv_cache_bytes(config, loops, "per_loop", CONTEXT)
            state = recurrent_state_bytes(config, loops, "per_loop")
            assert cache.nbytes(used=False) == kv_cache_bytes(config, loops, "per_loop", cache.max_len)
            assert cache.state_nbytes() == state
            out.setdefault(loops, {})[name] = {
                "decode_tok_s": rates[name],
                "kv_bytes_per_token": kv // CONTEXT,
                "recurrent_state_bytes": state,
                "cache_bytes_per_token_at_context": (kv + state) / CONTEXT,
            }
        out[loops]["decode_hybrid_over_attention"] = rates["hybrid"] / rates["attention"]
        h, a = out[loops]["hybrid"], out[loops]["attention"]
        bytes_ratio = h["cache_bytes_per_token_at_context"] / a["cache_bytes_per_token_at_context"]
        out[loops]["cache_bytes_hybrid_over_attention"] = bytes_ratio
        print(f"decode k={loops} at context {CONTEXT}: hybrid {h['decode_tok_s']:.1f} tok/s, "
              f"{h['cache_bytes_per_token_at_context']:.0f} B/token; attention {a['decode_tok_s']:.1f} tok/s, "
              f"{a['cache_bytes_per_token_at_context']:.0f} B/token; ratios "
              f"{out[loops]['decode_hybrid_over_attention']:.2f}x speed, {bytes_ratio:.3f}x bytes")  # fmt: skip
    return out


def token_by_token(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, n: int
) -> torch.Tensor:
    """The recurrence as written, one token and one Householder step at a time."""
    b, t, h, dk = q.shape
    state = q.new_zeros(b, h, dk, v.shape[-1])
    outs = []
    for i in range(t):
        state = state * g[:, i].exp()[..., None, None]
        for j in range(n):
            kk, vv, bb = k[:, i * n + j], v[:, i * n + j], beta[:, i * n + j][..., None, None]
            state = state - bb * kk[..., :, None] * (kk[..., None, :] @ state)
            state = state + bb * kk[..., :, None] * vv[..., None, :]
        outs.append((q[:, i, ..., None] * state).sum(-2))
    return torch.stack(outs, 1)


def bench_recurrence(repeats: int, length: int = 1024, n: int = 2) -> dict[str, Any]:
    h, dk = 4, 64
    q = torch.randn(1, length, h, dk) * dk**-0.5
    k = F.normalize(torch.randn(1, length * n, h, dk), dim=-1)
    v = torch.randn(1, length * n, h, dk)
    g = -F.softplus(torch.randn(1, length, h))
    beta = torch.rand(1, length * n, h)
    inputs = [x.requires_grad_() for x in (q, k, v, g, beta)]
    out: dict[str, Any] = {"length": length, "num_householder": n, "heads": h, "head_dim": dk}
    for mode in ("forward", "forward_backward"):

        def run(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
            def go() -> None:
                if mode == "forward":
                    with torch.no_grad():
                        fn()
                else:
                    fn().sum().backward()

            return go

        chunked = run(lambda: chunked_delta_product(*inputs, num_householder=n)[0])
        plain = run(lambda: token_by_token(*inputs, n))
        chunked()
        t_chunked = median_time(chunked, repeats)
        t_plain = median_time(plain, max(1, repeats // 2))
        out[mode] = {"chunked_s": t_chunked, "token_by_token_s": t_plain, "speedup": t_plain / t_chunked}
        print(f"recurrence T={length} n={n} {mode}: chunked {t_chunked * 1e3:.1f} ms, token-by-token "
              f"{t_plain * 1e3:.1f} ms, {t_plain / t_chunked:.1f}x", flush=True)  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/mixers.json")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    torch.manual_seed(0)
    models = {"hybrid": LoopedLM(HYBRID).eval(), "attention": LoopedLM(ATTENTION).eval()}
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}
    print(f"parameters: hybrid {params['hybrid']:,}  attention {params['attention']:,}; threads {args.threads}")
    results = {
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": args.threads},
        "parameters": params,
        "train": bench_train(models, args.repeats),
        "decode": bench_decode(models, args.repeats),
        "recurrence": bench_recurrence(args.repeats),
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
