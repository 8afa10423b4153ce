"""Cross-loop route replay against dynamic routing (A), and grouped expert dispatch against a dense
one-hot reference, on CPU at a size where the MoE layers dominate.

Replay vs dynamic (the paper's table 4.3 for (C): -11.7% mixed-depth train update, -19.6% fixed
k = 4 train update, -1.2% inference forward): (C) ``replay`` as the paper defines it (loop 1's
experts and gate weights reused, the router runs once) and the ``replay_experts`` variant (experts
reused, gates recomputed by the router at every loop), each as a ratio against (A) ``dynamic``:
the same weights, batches and loop schedules, rounds interleaved so drift hits all alike, medians
over rounds.

Dispatch: one MoE layer's forward and forward + backward at E = 16, top-2: the sorted grouped path
(``torch._grouped_mm``, and the per-expert loop over contiguous slices) against running every expert
on every token and mixing with a dense one-hot gate matrix (target: at least 3x).

Decode with conditioning (why ``fold_conditioning`` refuses MoE): a conditioned MoE model decodes
with each loop's eq. 4 constants and its own weights shared (``serving_model``, what ``elr generate
--fold`` runs), against the same model with the conditioning switched off, whose op sequence is what
folding the constants into copies of the weights would run (at the cost of every expert copied per
loop). Greedy decoding, batch 1, per-loop cache, tokens/s as a ratio.

    python bench/moe.py                 # prints a table, writes bench/results/moe.json
    python bench/moe.py --rounds 5 --threads 2
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from dataclasses import replace
from typing import Any, Callable

import torch
import torch.nn.functional as F

from elr_lightning.conditioning import LoopConditioner
from elr_lightning.config import ModelConfig
from elr_lightning.inference.generate import generate
from elr_lightning.mixers.dispatch import combine, expert_swiglu, plan_dispatch
from elr_lightning.model import LoopedLM
from elr_lightning.optim import param_groups
from elr_lightning.sampling import OneLoopOverride

PAPER = {"mixed_depth_train_step": -11.7, "fixed_k4_train_step": -19.6, "inference_forward": -1.2}

#: The replay modes measured against (A) ``dynamic``.
REPLAYS = ("replay", "replay_experts")


def train_step(model: LoopedLM, batches: list[torch.Tensor], schedules: list[list[int]]) -> Callable[[int], float]:
    """One optimizer step over the shards of ``batches[i]`` at ``schedules[i]``: CE + balance loss, AdamW."""
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-5)

    def step(i: int) -> float:
        batch, loops = batches[i % len(batches)], schedules[i % len(schedules)]
        start = time.perf_counter()
        for shard, k in zip(batch.tensor_split(len(loops)), loops):
            aux: dict[str, torch.Tensor] = {}
            logits = model(shard[:, :-1], k, aux_losses=aux)
            loss = F.cross_entropy(logits.flatten(0, 1), shard[:, 1:].flatten()) + sum(aux.values())
            (loss / len(loops)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    return step


def forward(model: LoopedLM, batch: torch.Tensor, loops: int) -> Callable[[int], float]:
    def run(i: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            model(batch[:, :-1], loops)
        return time.perf_counter() - start

    return run


def rounds_of(cases: dict[str, Callable[[int], float]], rounds: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per case and round after the warm-up, the cases run in turn in every round."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(warmup + rounds):
        for name, fn in cases.items():
            t = fn(r)
            if r >= warmup:
                times[name].append(t)
    return times


def interleaved(cases: dict[str, Callable[[int], float]], rounds: int, warmup: int) -> dict[str, float]:
    """Median seconds per case, the cases run in turn in every round."""
    return {name: statistics.median(ts) for name, ts in rounds_of(cases, rounds, warmup).items()}


def against_dynamic(cases: dict[str, Callable[[int], float]], rounds: int, warmup: int) -> dict[str, Any]:
    """Median seconds per case, and each replay mode's change against (A) as the median of per-round ratios.

    A round runs every case on the same batch and loop schedule, so the per-round ratio cancels what
    differs between rounds (k = 1 or 3 steps of the mixed schedule, load from other processes).
    """
    times = rounds_of(cases, rounds, warmup)
    result: dict[str, Any] = {name: statistics.median(ts) for name, ts in times.items()}
    result["delta_percent"] = {
        mode: 100.0 * (statistics.median(a / b for a, b in zip(times[mode], times["dynamic"])) - 1.0) for mode in REPLAYS
    }
    return result


def replay_bench(args: argparse.Namespace) -> dict[str, Any]:
    n_in, n_rec, n_out = args.layers
    moe = {"num_experts": args.experts, "top_k": args.top_k, "expert_dim": args.expert_dim, "aux_loss_coef": 0.01}
    config = ModelConfig(
        vocab_size=256, d_model=args.d_model, n_heads=args.n_heads, n_in=n_in, n_rec=n_rec, n_out=n_out,
        max_seq_len=args.seq_len, max_loops=4, channel_pattern=["moe"],
        mixers={"moe": {"class_path": "elr_lightning.mixers.MoE", "init_args": moe}},
    )
    torch.manual_seed(0)
    models = {}
    for mode in ("dynamic", *REPLAYS):
        models[mode] = LoopedLM(replace(config, route_replay=mode), conditioner=LoopConditioner(d_cond=32, rank=8))
    for mode in REPLAYS:
        models[mode].load_state_dict(models["dynamic"].state_dict())
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (args.batch, args.seq_len + 1), generator=g) for _ in range(4)]
    sampler = OneLoopOverride(max_loops=4, override_fraction=0.15)
    mixed = [sampler.schedule(0, step, args.shards) for step in range(args.warmup + args.rounds)]
    fixed = [[4] * args.shards]
    results: dict[str, Any] = {"mixed_schedules": mixed}
    for name, schedules in (("mixed_depth_train_step", mixed), ("fixed_k4_train_step", fixed)):
        cases = {mode: train_step(copy.deepcopy(m).train(), batches, schedules) for mode, m in models.items()}
        results[name] = against_dynamic(cases, args.rounds, args.warmup)
    cases = {mode: forward(m.eval(), batches[0], 4) for mode, m in models.items()}
    results["inference_forward"] = against_dynamic(cases, args.rounds, args.warmup)
    return results


def decode_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Decode tokens/s of a conditioned MoE model served with constants, against it unconditioned, at k = 1 and 4."""
    n_in, n_rec, n_out = args.layers
    moe = {"num_experts": args.experts, "top_k": args.top_k, "expert_dim": args.expert_dim}
    config = ModelConfig(
        vocab_size=256, d_model=args.d_model, n_heads=args.n_heads, n_in=n_in, n_rec=n_rec, n_out=n_out,
        max_seq_len=args.seq_len, max_loops=4, channel_pattern=["moe"], route_replay="replay",
        mixers={"moe": {"class_path": "elr_lightning.mixers.MoE", "init_args": moe}},
    )
    torch.manual_seed(0)
    model = LoopedLM(config, conditioner=LoopConditioner(d_cond=32, rank=8)).eval()
    with torch.no_grad():  # every head acts, so the constants are not an identity
        for p in model.conditioner.parameters():
            p.add_(0.02 * torch.randn_like(p))
    prompt = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(2))
    new_tokens = args.decode_tokens

    def decode(loops: int, active: bool) -> Callable[[int], float]:
        def run(i: int) -> float:
            model.conditioner.set_active(active)
            start = time.perf_counter()
            generate(model, prompt, loops=loops, max_new_tokens=new_tokens, greedy=True, fold=active or None)
            return time.perf_counter() - start

        return run

    results: dict[str, Any] = {"new_tokens": new_tokens}
    for loops in (1, 4):
        t = interleaved({"served": decode(loops, True), "unconditioned": decode(loops, False)}, args.rounds, args.warmup)
        t["served_over_unconditioned_rate"] = t["unconditioned"] / t["served"]
        results[f"k{loops}"] = t
    model.conditioner.set_active(True)
    return results


def dispatch_bench(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    n, d, f, e, k = args.dispatch_tokens, args.d_model, args.expert_dim, 16, 2
    x = torch.randn(n, d, requires_grad=True)
    w_up = (0.02 * torch.randn(e, d, 2 * f)).requires_grad_()
    w_down = (0.02 * torch.randn(e, f, d)).requires_grad_()
    router = (0.02 * torch.randn(d, e)).requires_grad_()

    def routed() -> tuple[torch.Tensor, torch.Tensor]:
        probs = (x @ router).softmax(-1)
        experts = torch.topk(probs, k, dim=-1).indices
        weights = probs.gather(-1, experts)
        return experts, weights / weights.sum(-1, keepdim=True)

    def sorted_path(grouped: bool) -> torch.Tensor:
        experts, weights = routed()
        plan = plan_dispatch(experts, e)
        return combine(expert_swiglu(x, w_up, w_down, plan, grouped), weights, plan, n)

    def dense() -> torch.Tensor:
        experts, weights = routed()
        gates = torch.zeros(n, e).scatter_add(1, experts, weights)
        out = torch.zeros_like(x)
        for i in range(e):
            gate, up = (x @ w_up[i]).chunk(2, dim=-1)
            out = out + gates[:, i : i + 1] * ((F.silu(gate) * up) @ w_down[i])
        return out

    paths = {"grouped_mm": lambda: sorted_path(True), "expert_loop": lambda: sorted_path(False), "dense_one_hot": dense}
    grad = torch.randn(n, d)
    torch.testing.assert_close(paths["grouped_mm"](), paths["dense_one_hot"](), rtol=1e-4, atol=1e-5)

    def timed(fn: Callable[[], torch.Tensor], backward: bool) -> Callable[[int], float]:
        def run(i: int) -> float:
            start = time.perf_counter()
            if backward:
                fn().backward(grad)
            else:
                with torch.no_grad():
                    fn()
            return time.perf_counter() - start

        return run

    results: dict[str, Any] = {"tokens": n, "d_model": d, "expert_dim": f, "experts": e, "top_k": k}
    for label, backward in (("forward", False), ("forward_backward", True)):
        t = interleaved({name: timed(fn, backward) for name, fn in paths.items()}, args.rounds, args.warmup)
        t["speedup_grouped_mm"] = t["dense_one_hot"] / t["grouped_mm"]
        t["speedup_expert_loop"] = t["dense_one_hot"] / t["expert_loop"]
        results[label] = t
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d_model", type=int, default=256)
    parser.add_argument("--n_heads", type=int, default=4)
    parser.add_argument("--layers", type=int, nargs=3, default=[1, 2, 1], metavar=("N_IN", "N_REC", "N_OUT"))
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top_k", type=int, default=2)
    parser.add_argument("--expert_dim", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--shards", type=int, default=4, help="shards per step, each with its own k (mixed depth)")
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--dispatch_tokens", type=int, default=2048)
    parser.add_argument("--decode_tokens", type=int, default=32, help="tokens per timed greedy decode")
    parser.add_argument("--only", choices=["dispatch", "replay", "decode"], default=None, help="run one section")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default="bench/results/moe.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)

    results: dict[str, Any] = {"args": vars(args), "paper_delta_percent": PAPER}
    if args.only in (None, "dispatch"):
        results["dispatch"] = dispatch_bench(args)
        for label in ("forward", "forward_backward"):
            t = results["dispatch"][label]
            print(
                f"dispatch E=16 top-2, {label:<16}: grouped_mm {t['grouped_mm'] * 1e3:7.2f} ms, expert loop "
                f"{t['expert_loop'] * 1e3:7.2f} ms, dense one-hot {t['dense_one_hot'] * 1e3:7.2f} ms: "
                f"{t['speedup_grouped_mm']:.2f}x / {t['speedup_expert_loop']:.2f}x faster than dense"
            )
    if args.only in (None, "replay"):
        results["replay"] = replay_bench(args)
        print("against (A) dynamic, median s:   (A) dynamic  (C) replay   delta  replay_experts   delta  paper (C)")
        for name, paper in PAPER.items():
            t = results["replay"][name]
            delta = t["delta_percent"]
            print(
                f"  {name:<28} {t['dynamic']:11.4f} {t['replay']:11.4f} {delta['replay']:+6.1f}% "
                f"{t['replay_experts']:15.4f} {delta['replay_experts']:+6.1f}% {paper:+9.1f}%"
            )
    if args.only in (None, "decode"):
        results["decode"] = decode_bench(args)
        for loops in (1, 4):
            t = results["decode"][f"k{loops}"]
            print(
                f"decode k={loops}: served with constants {t['served']:.3f} s, unconditioned {t['unconditioned']:.3f} s: "
                f"{t['served_over_unconditioned_rate']:.3f}x the unconditioned rate"
            )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
