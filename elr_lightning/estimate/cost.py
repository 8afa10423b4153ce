"""Static cost of a configuration: parameters, effective depth (eq. 1), FLOPs and KV memory per loop
count, the sampler's eq. 3 statistics and the eq. 5 training-compute multipliers.

Models are built on the meta device, so a 4B configuration is counted without allocating it.
``elr cost --config config/4b.yaml`` prints the table.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Optional, Union

import torch
from torch import nn

from elr_lightning.arguments import CommandParser, add_loops, add_switch, command_parser
from elr_lightning.callbacks.switch import DEFAULT_SWITCH_FRACTION
from elr_lightning.flops import compute_multiplier, forward_flops_per_token
from elr_lightning.inference.cache import CACHE_POLICIES, kv_cache_bytes, recurrent_state_bytes
from elr_lightning.lightning_cli import build_module, merged_config
from elr_lightning.mixers import ChannelMixer, TokenMixer
from elr_lightning.model import LoopedLM
from elr_lightning.module import ELRModule


def mixed_fraction(config: dict[str, Any]) -> Optional[float]:
    """rho of eq. 5, the fraction of training tokens in the mixed phase, from a :func:`merged_config`.

    ``1 - switch_fraction`` of a ``DelayedMixedDepth`` callback (its default 0.75 when it names
    neither a fraction nor a step), ``1 - switch_step / trainer.max_steps`` for a step, and 1 (mixed
    from scratch) without the callback. ``None`` when a switch step is given without ``max_steps``.
    """
    trainer = config.get("trainer") or {}
    for callback in trainer.get("callbacks") or []:
        if not str(callback.get("class_path", "")).endswith("DelayedMixedDepth"):
            continue
        args = callback.get("init_args") or {}
        if args.get("switch_step") is not None:
            max_steps = trainer.get("max_steps")
            return 1.0 - args["switch_step"] / max_steps if max_steps and max_steps > 0 else None
        fraction = args.get("switch_fraction")
        if fraction is None:
            fraction = 0.0 if args.get("init_from") else DEFAULT_SWITCH_FRACTION
        return 1.0 - fraction
    return 1.0


def parameter_counts(model: LoopedLM) -> dict[str, int]:
    """Unique parameters of a :class:`~elr_lightning.model.LoopedLM`, per block and in total.

    Shared (tied) tensors are counted once. ``active`` is what one token uses in one pass through
    every layer: ``total`` less the routed experts a mixture of experts does not pick (each mixer's
    :meth:`~elr_lightning.mixers.ChannelMixer.active_parameters`).
    """
    seen: set[int] = set()

    def count(module: nn.Module) -> int:
        total = 0
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
        return total

    counts = {
        "embedding": count(model.embed),
        "input_block": count(model.input_layers),
        "recurrent_block": count(model.core),
        "output_block": count(model.output_layers),
        "final_norm_and_head": count(model.norm) + count(model.head),
    }
    counts["total"] = sum(counts.values())
    mixers = [m for m in model.modules() if isinstance(m, (TokenMixer, ChannelMixer))]
    inactive = sum(sum(p.numel() for p in m.parameters()) - m.active_parameters() for m in mixers)
    counts["active"] = counts["total"] - inactive
    counts["gate"] = sum(p.numel() for p in model.parameters_with_role(group="gate"))
    counts["conditioning"] = sum(p.numel() for p in model.parameters_with_role(group="conditioning"))
    return counts


def cost_report(paths: Union[str, Sequence[str]], loops: Optional[list[int]] = None) -> dict[str, Any]:
    """Parameters, D_eff(k) (eq. 1), the sampler's eq. 3 statistics and eq. 5 for merged config files."""
    config = merged_config(paths)
    module = build_module(config)
    path = paths if isinstance(paths, str) else " + ".join(paths)
    arch = module.arch
    loops = list(range(1, arch.max_loops + 1)) if loops is None else loops
    rank = getattr(module.model.conditioner, "rank", 0)
    report: dict[str, Any] = {
        "config": path,
        "parameters": parameter_counts(module.model),
        "effective_depth": {k: arch.effective_depth(k) for k in loops},
        "forward_gflops_per_token": {k: forward_flops_per_token(arch, k, adapter_rank=rank) / 1e9 for k in loops},
        "kv_bytes_per_token_bf16": {
            k: {policy: kv_cache_bytes(arch, k, policy, 1, torch.bfloat16) for policy in CACHE_POLICIES}
            for k in loops
        },
        # Recurrent (linear-attention and conv) state per sequence: fixed, it does not grow with tokens.
        "recurrent_state_bytes_bf16": {
            k: {policy: recurrent_state_bytes(arch, k, policy, torch.bfloat16) for policy in CACHE_POLICIES}
            for k in loops
        },
        "layer_pattern": {
            block: [arch.layer_mixers(block, j)[0] for j in range(n)]
            for block, n in (("in", arch.n_in), ("rec", arch.n_rec), ("out", arch.n_out))
        },
        "sampler": repr(module.sampler),
    }
    for name in ("expected_p1", "expected_mean_loops"):
        method = getattr(module.sampler, name, None)
        if callable(method):
            report[name] = method()
    if "expected_mean_loops" in report:
        mean = report["expected_mean_loops"]
        rho = mixed_fraction(config)
        report["mixed_fraction"] = rho
        report["eq5_multiplier"] = {
            r: compute_multiplier(arch, r, mean) for r in sorted({0.25, 1.0} | ({rho} if rho is not None else set()))
        }
    return report


def format_report(report: dict[str, Any]) -> str:
    """The report as a small human-readable table."""
    lines = [f"config: {report['config']}", f"sampler: {report['sampler']}", "parameters:"]
    lines += [f"  {name:<20} {n:>16,}" for name, n in report["parameters"].items()]
    lines.append("effective depth D_eff(k) = L_in + k L_rec + L_out (eq. 1):")
    d1 = report["effective_depth"][min(report["effective_depth"])]
    lines += [f"  k={k:<3} {d:>4} layers  {d / d1:5.2f}x" for k, d in report["effective_depth"].items()]
    lines.append("token mixers: " + "  ".join(f"{b}: {' '.join(p)}" for b, p in report["layer_pattern"].items() if p))
    lines.append("active forward GFLOPs per token (routed experts at top-k); attention KV bytes per token and")
    lines.append("recurrent-state bytes per sequence (bf16) per cache policy:")
    for k, gflops in report["forward_gflops_per_token"].items():
        kv = "  ".join(f"{policy} {n:,}" for policy, n in report["kv_bytes_per_token_bf16"][k].items())
        state = "  ".join(f"{policy} {n:,}" for policy, n in report["recurrent_state_bytes_bf16"][k].items())
        lines.append(f"  k={k:<3} {gflops:8.3f} GFLOPs   KV/token: {kv}   state: {state}")
    if "expected_p1" in report:
        lines.append(f"eq. 3: p_1 = {report['expected_p1']:.4f}, mean k = {report['expected_mean_loops']:.4f}")
        eq5, rho = report["eq5_multiplier"], report.get("mixed_fraction")
        if rho is not None:
            lines.append(f"eq. 5: this config mixes the last {rho:.0%} of tokens: training compute {eq5[rho]:.3f}x")
        lines.append(f"eq. 5: training compute {eq5[0.25]:.3f}x with the last 25% mixed, {eq5[1.0]:.3f}x from scratch")
    return "\n".join(lines)


def cost_parser() -> CommandParser:
    """The parser of ``elr cost``."""
    parser = command_parser("cost", "Parameters and compute per loop count of a config.")
    parser.add_argument(
        "--config", type=str, action="append", required=True,
        help="An `elr fit` YAML file; repeat to merge several, as `elr fit` does.",
    )  # fmt: skip
    add_loops(parser, "Loop counts to report; default 1..K")
    add_switch(parser, "--json", False, "Print JSON instead of a table.", was_bool=True)
    return parser


def main(argv: list[str]) -> None:
    """``elr cost --config FILE [--loops 1-4] [--json]``."""
    args = cost_parser().parse_args(argv)
    report = cost_report(args.config, None if args.loops is None else list(args.loops.counts))
    print(json.dumps(report, indent=2) if args.json else format_report(report))
