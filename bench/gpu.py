"""The GPU figures of ``bench/gpu.sh``: one CUDA device, a ``config/gpt_0.5b.yaml``-shaped model.

The width, heads, vocabulary and sequence length of GPT-0.5B (d = 1152, 18 heads, 50304 tokens,
2048 positions) at a shortened depth (``--layers``, 2/4/2 by default), conditioning on (rank 16). Prints

1. bf16 training tokens/s and model FLOPs utilisation at k = 1..4, eager and with ``compile_layers``
   (every layer compiled, as ``ELRModule(compile_layers=True)`` does), AdamW included; MFU counts
   the model FLOPs of ``elr_lightning.flops.train_flops_per_token`` against the device's dense bf16
   peak (``--peak_tflops``, else looked up from the device name);
2. the peak allocated memory of a training step at each k with ``activation_checkpointing`` none
   and loop (``torch.accelerator.max_memory_allocated``, the CUDA caching allocator's peak);
3. greedy decode tokens/s at each k under both cache policies (batch 1, 128-token prompt);
4. whether a training step makes a host sync (``torch.cuda.set_sync_debug_mode("error")``);
5. fla's gated delta-product kernels against the PyTorch chunked path on the same bf16 inputs
   (B = 2, T = 512, 4 heads of 64, n = 2): relative differences of the outputs, final state and
   every input gradient, and the forward-plus-backward time of each;
6. the conditioning ratio: the bf16 k = 1 training step of the conditioned model over the same
   model without a conditioner, eager and with the whole looped forward compiled
   (``LoopedLM.compile()``, as ``ELRModule(compile_model=True)``), per-round ratios over
   interleaved rounds (target <= 1.03);
7. the MoE expert dispatch: ``torch._grouped_mm`` against the per-expert loop on the same bf16
   tokens (8 experts, top-2), forward plus backward, and their relative difference.

Writes ``bench/results/gpu.json`` after every section (a run stopped by the time limit keeps what
it measured). Figures are from this run only.

CPU smoke run (every code path once, in seconds; the figures mean nothing there)::

    python bench/gpu.py --device cpu --tiny --out bench/results/gpu_cpu.json

``--device`` other than ``cuda`` runs sections 1 and 3 as on CUDA; section 2 needs the device's
allocator statistics (``torch.accelerator``), section 4 CUDA's sync debug mode and section 5 fla's
kernels (CUDA, bf16), so on CPU each reports ``{"not_measured": "<why>"}`` instead of figures.
``--tiny`` shrinks the model and the run (d = 64, 2 heads, 256 tokens, 64 positions, 1/1/1 layers,
k = 1..2, one step each); ``--d_model``, ``--n_heads`` and ``--vocab`` override the shape,
``--compile_backend`` the ``torch.compile`` backend (``aot_eager`` skips code generation).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from elr_lightning.conditioning import LoopConditioner
from elr_lightning.config import ModelConfig
from elr_lightning.flops import train_flops_per_token
from elr_lightning.inference.cache import CACHE_POLICIES
from elr_lightning.inference.generate import stream_generate
from elr_lightning.mixers.delta_rule import delta_product, fla_unsupported
from elr_lightning.mixers.dispatch import expert_swiglu, grouped_mm_supported, plan_dispatch
from elr_lightning.model import LoopedLM
from elr_lightning.optim import param_groups

#: Dense bf16 tensor-core peaks (TFLOP/s) by device-name fragment, first match wins.
PEAKS = {"H200": 989.0, "H100": 989.0, "GH200": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "L4": 121.0}


def peak_tflops(name: str, override: float | None) -> float | None:
    if override is not None:
        return override
    return next((v for k, v in PEAKS.items() if k in name), None)


#: ``--tiny``: the smallest run that still takes every code path (a CPU smoke test).
TINY = {"d_model": 64, "n_heads": 2, "vocab": 256, "layers": [1, 1, 1], "batch": 2, "seq_len": 64,
        "max_loops": 2, "warmup": 1, "steps": 1, "new_tokens": 4, "prompt_len": 8}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({platform.processor() or platform.machine()})"


def synchronize(device: torch.device) -> None:
    torch.get_device_module(device).synchronize()


def allocator_stats(device: torch.device) -> str | None:
    """``None`` where ``torch.accelerator`` keeps peak allocator statistics for ``device``, else why not."""
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None or accelerator.type != device.type:
        return (f"no allocator peak statistics on {device.type} (torch.accelerator.max_memory_allocated); "
                "bench/memory.py measures process peaks there")
    return None


def build(cfg: ModelConfig, args, compiled: bool, checkpointing: str = "none") -> LoopedLM:
    torch.manual_seed(0)
    model = LoopedLM(cfg, conditioner=LoopConditioner(d_cond=64, rank=16)).to(args.device)
    model.set_backprop(checkpointing)
    if compiled:
        for layer in [*model.input_layers, *model.core.layers, *model.output_layers]:
            layer.compile(backend=args.compile_backend)
    return model


def train_step(model: LoopedLM, optimizer, batch: torch.Tensor, loops: int) -> torch.Tensor:
    with torch.autocast(batch.device.type, dtype=torch.bfloat16):
        logits = model(batch[:, :-1], loops)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def throughput(cfg, args, batch, compiled: bool) -> list[dict]:
    device = batch.device
    model = build(cfg, args, compiled)
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-4, fused=True)
    rows = []
    for k in range(1, args.max_loops + 1):
        for _ in range(args.warmup):
            train_step(model, optimizer, batch, k)
        synchronize(device)
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            train_step(model, optimizer, batch, k)
            synchronize(device)
            times.append(time.perf_counter() - start)
        t = statistics.median(times)
        tokens = batch.shape[0] * (batch.shape[1] - 1)
        flops = train_flops_per_token(cfg, k, cfg.max_seq_len, adapter_rank=16) * tokens / t
        peak = peak_tflops(device_name(device), args.peak_tflops)
        rows.append({"compile_layers": compiled, "loops": k, "step_s": t, "tokens_per_s": tokens / t,
                     "model_tflops": flops / 1e12, "mfu": None if peak is None else flops / 1e12 / peak})
        mfu = "n/a" if peak is None else f"{100 * rows[-1]['mfu']:.1f}%"
        print(f"train  compile={str(compiled):<5} k={k}  {tokens / t:>10.0f} tok/s  {flops / 1e12:7.1f} TFLOP/s  MFU {mfu}",
              flush=True)
    del model, optimizer
    empty_cache(device)
    return rows


def empty_cache(device: torch.device) -> None:
    if allocator_stats(device) is None:
        torch.accelerator.empty_cache()


def memory(cfg, args, batch) -> list[dict] | dict:
    device = batch.device
    why = allocator_stats(device)
    if why is not None:
        print(f"memory not measured: {why}", flush=True)
        return {"not_measured": why}
    rows = []
    for checkpointing in ("none", "loop"):
        model = build(cfg, args, False, checkpointing)
        for k in range(1, args.max_loops + 1):
            model.zero_grad(set_to_none=True)
            synchronize(device)
            torch.accelerator.reset_peak_memory_stats(device)
            before = torch.accelerator.memory_allocated(device)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = model(batch[:, :-1], k)
            F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten()).backward()
            del logits
            synchronize(device)
            peak = torch.accelerator.max_memory_allocated(device) - before
            rows.append({"activation_checkpointing": checkpointing, "loops": k, "peak_bytes": peak})
            print(f"memory checkpointing={checkpointing:<4} k={k}  peak {peak / 2**30:6.2f} GiB above weights", flush=True)
        del model
        empty_cache(device)
    return rows


def decode(cfg, args) -> list[dict]:
    device = torch.device(args.device)
    model = build(cfg, args, False).eval()
    prompt = torch.randint(0, cfg.vocab_size, (1, args.prompt_len), device=device,
                           generator=torch.Generator(device).manual_seed(0))
    rows = []
    for policy in ("per_loop", "last_loop"):
        for k in range(1, args.max_loops + 1):
            rates = []
            for _ in range(2):  # the first run folds the conditioning for k and warms the kernels
                cache = CACHE_POLICIES[policy](max_len=args.prompt_len + args.new_tokens)
                stream = stream_generate(model, prompt, loops=k, kv_cache=cache, max_new_tokens=args.new_tokens,
                                         greedy=True, autocast_dtype=torch.bfloat16)
                next(stream)
                synchronize(device)
                start = time.perf_counter()
                n = sum(1 for _ in stream)
                synchronize(device)
                rates.append(n / (time.perf_counter() - start))
            rows.append({"policy": policy, "loops": k, "decode_tokens_per_s": rates[-1]})
            print(f"decode policy={policy:<9} k={k}  {rates[-1]:8.1f} tok/s", flush=True)
    return rows


def sync_check(cfg, args, batch) -> str | dict:
    if batch.device.type != "cuda":
        why = (f"torch.cuda.set_sync_debug_mode has no counterpart on {batch.device.type}; "
               "tests/test_host_syncs.py checks statically")
        print(f"host syncs not measured: {why}", flush=True)
        return {"not_measured": why}
    model = build(cfg, args, False, "loop")
    model.set_backprop("loop", 2)
    train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), batch, 3)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(batch[:, :-1], 3)
        F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten()).backward()
        verdict = "none"
    except RuntimeError as error:
        verdict = f"SYNC: {str(error).splitlines()[0]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    print(f"host syncs in a training forward and backward (k = 3, loop checkpointing, backprop_loops = 2): {verdict}",
          flush=True)
    return verdict


def fla_check(args) -> dict:
    """fla's kernels against :func:`chunked_delta_product`: forward, final state and gradients, and times."""
    device = torch.device(args.device)
    gen = torch.Generator(device).manual_seed(0)
    b, t, h, d, n = 2, 512, 4, 64, 2

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=gen)

    q = (randn(b, t, h, d) * d**-0.5).bfloat16()
    k = F.normalize(randn(b, t * n, h, d), dim=-1).bfloat16()
    v = randn(b, t * n, h, d).bfloat16()
    g = -F.softplus(randn(b, t, h))
    beta = torch.rand(b, t * n, h, device=device, generator=gen) * 2
    state = randn(b, h, d, d) * 0.1
    why = fla_unsupported(q, k, v, g, beta, state)
    if why is not None:
        print(f"fla not measured: {why}", flush=True)
        return {"not_measured": why}
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta, state)]
    w_o, w_s = randn(b, t, h, d), randn(b, h, d, d)
    runs = {}
    for kernels in ("fla", "torch"):
        times = []
        for _ in range(3):  # the first call compiles (fla) or warms up (torch)
            synchronize(device)
            start = time.perf_counter()
            o, s = delta_product(q, k, v, g, beta, n, state, kernels=kernels)
            grads = torch.autograd.grad((o.float() * w_o).sum() + (s * w_s).sum(), leaves)
            synchronize(device)
            times.append(time.perf_counter() - start)
        runs[kernels] = ([x.detach().float() for x in (o, s, *grads)], min(times[1:]))
    names = ("o", "state", "dq", "dk", "dv", "dg", "dbeta", "dstate")
    rel = {name: float((a - r).abs().max() / r.abs().max().clamp_min(1e-30))
           for name, a, r in zip(names, runs["fla"][0], runs["torch"][0])}
    row = {"max_rel_diff": rel, "fla_s": runs["fla"][1], "torch_s": runs["torch"][1],
           "speedup": runs["torch"][1] / runs["fla"][1]}
    print(f"fla vs torch: max rel diff {max(rel.values()):.2e} ({max(rel, key=rel.get)}), forward+backward "
          f"{runs['fla'][1] * 1e3:.1f} ms vs {runs['torch'][1] * 1e3:.1f} ms ({row['speedup']:.1f}x)", flush=True)
    return row


def conditioning_ratio(cfg, args, batch) -> dict:
    """Conditioned over unconditioned k = 1 train step, eager and compiled, per-round ratios."""
    device = batch.device
    torch.manual_seed(0)
    models = {"plain": LoopedLM(cfg).to(device), "conditioned": build(cfg, args, False)}
    steps = {}
    for mode in ("eager", "compiled"):
        for name, model in models.items():
            run = model if mode == "eager" else torch.compile(model, backend=args.compile_backend)
            optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-4)
            steps[name, mode] = (run, optimizer)
    times = {key: [] for key in steps}
    for r in range(args.warmup + args.steps):
        for key in (list(steps) if r % 2 else list(reversed(steps))):
            synchronize(device)
            start = time.perf_counter()
            train_step(*steps[key], batch, 1)
            synchronize(device)
            if r >= args.warmup:
                times[key].append(time.perf_counter() - start)
    row = {}
    for mode in ("eager", "compiled"):
        ratios = [c / p for c, p in zip(times["conditioned", mode], times["plain", mode])]
        row[mode] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                     "plain_step_s": statistics.median(times["plain", mode])}
        print(f"conditioning {mode:<8} k=1 conditioned / plain step {row[mode]['median']:.3f} "
              f"({row[mode]['min']:.3f}-{row[mode]['max']:.3f}; target <= 1.03)", flush=True)
    eager, compiled = row["eager"]["plain_step_s"], row["compiled"]["plain_step_s"]
    row["compiled_over_eager_plain"] = compiled / eager
    del models, steps
    empty_cache(device)
    return row


def moe_dispatch(args) -> dict:
    """``torch._grouped_mm`` against the per-expert loop: one MoE layer's expert SwiGLU, forward and backward."""
    device = torch.device(args.device)
    gen = torch.Generator(device).manual_seed(0)
    n, d, f, e = args.batch * args.seq_len, args.d_model, args.d_model, 8
    x = torch.randn(n, d, device=device, generator=gen).bfloat16().requires_grad_()
    w_up = (torch.randn(e, d, 2 * f, device=device, generator=gen) * d**-0.5).bfloat16().requires_grad_()
    w_down = (torch.randn(e, f, d, device=device, generator=gen) * f**-0.5).bfloat16().requires_grad_()
    if not grouped_mm_supported(x, w_up):
        why = f"torch._grouped_mm does not run here ({device.type}, bf16)"
        print(f"moe dispatch not measured: {why}", flush=True)
        return {"not_measured": why}
    plan = plan_dispatch(torch.randint(0, e, (n, 2), device=device, generator=gen), e)
    runs = {}
    for grouped in (True, False):
        times = []
        for _ in range(3):
            synchronize(device)
            start = time.perf_counter()
            y = expert_swiglu(x, w_up, w_down, plan, grouped)
            grads = torch.autograd.grad(y.float().square().mean(), (x, w_up, w_down))
            synchronize(device)
            times.append(time.perf_counter() - start)
        runs[grouped] = ([t.float() for t in (y, *grads)], min(times[1:]))
    rel = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(runs[True][0], runs[False][0]))
    row = {"tokens": n, "grouped_s": runs[True][1], "loop_s": runs[False][1], "speedup": runs[False][1] / runs[True][1],
           "max_rel_diff": rel}
    print(f"moe dispatch grouped vs loop: {row['grouped_s'] * 1e3:.1f} ms vs {row['loop_s'] * 1e3:.1f} ms "
          f"({row['speedup']:.1f}x), max rel diff {rel:.2e}", flush=True)
    return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="torch device; anything but cuda is a smoke run")
    parser.add_argument("--tiny", action="store_true", help=f"smoke-test sizes, unless given explicitly: {TINY}")
    parser.add_argument("--d_model", type=int, default=1152)
    parser.add_argument("--n_heads", type=int, default=18)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--layers", type=int, nargs=3, default=[2, 4, 2], metavar=("N_IN", "N_REC", "N_OUT"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--max_loops", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--prompt_len", type=int, default=128)
    parser.add_argument("--compile_backend", default="inductor", help="torch.compile backend of compile_layers")
    parser.add_argument("--peak_tflops", type=float, default=None, help="dense bf16 peak of the device")
    parser.add_argument("--out", default="bench/results/gpu.json")
    if parser.parse_known_args(argv)[0].tiny:  # the preset replaces the defaults; explicit flags still win
        parser.set_defaults(**TINY)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py: no CUDA device visible to torch; run it on a machine with one GPU")
    torch.set_float32_matmul_precision("high")
    n_in, n_rec, n_out = args.layers
    cfg = ModelConfig(vocab_size=args.vocab, d_model=args.d_model, n_heads=args.n_heads, n_in=n_in, n_rec=n_rec,
                      n_out=n_out, max_seq_len=args.seq_len, max_loops=args.max_loops)
    name = device_name(device)
    print(f"device {name}, torch {torch.__version__}, layers {args.layers}, d_model {args.d_model}, "
          f"batch {args.batch} x {args.seq_len}", flush=True)
    batch = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), device=device,
                          generator=torch.Generator(device).manual_seed(0))
    started = time.perf_counter()
    result = {"config": vars(args), "device": name, "torch": torch.__version__}
    sections = {
        "sync_check": lambda: sync_check(cfg, args, batch),
        "train": lambda: throughput(cfg, args, batch, False) + throughput(cfg, args, batch, True),
        "memory": lambda: memory(cfg, args, batch),
        "decode": lambda: decode(cfg, args),
        "fla": lambda: fla_check(args),
        "conditioning": lambda: conditioning_ratio(cfg, args, batch),
        "moe_dispatch": lambda: moe_dispatch(args),
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    for section, measure in sections.items():
        result[section] = measure()
        result["wall_s"] = time.perf_counter() - started
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2, allow_nan=False)
    print(f"done in {result['wall_s']:.0f} s; wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
