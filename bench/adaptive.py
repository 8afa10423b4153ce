"""Adaptive depth per token against fixed k: validation loss against mean loops per token (a Pareto plot).

For each checkpoint, held-out sequences of the default corpus (the validation split of
``TextDataModule``) are decoded token by token through the serving decoder
(:class:`~elr_lightning.decode.Decoder`, teacher-forced: each step feeds the true next token), at
fixed k = 1..K and with ``loops="auto"`` at several thresholds of both exit criteria. Each point
is the mean next-token loss against the mean recurrent loops per token (the first token of each
sequence runs at the budget, as a prompt does). Adaptive depth beats fixed k where its loss lies
below the fixed-k line, linearly interpolated at its mean loops; the table prints that gap
(negative: adaptive is better at equal mean compute). Under ``per_loop`` the fixed-k points equal
the model's cache-free validation loss.

Writes ``bench/results/adaptive.json`` and ``bench/results/adaptive.png``.

    python bench/adaptive.py --ckpt_path quickstart=runs/quickstart/version_0/checkpoints/last.ckpt \\
        --ckpt_path hybrid=runs/quickstart_hybrid/version_0/checkpoints/last.ckpt
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from elr_lightning.data import TextDataModule
from elr_lightning.decode import AdaptiveDepth, Decoder, Depth
from elr_lightning.generation import load_model
from elr_lightning.model import LoopedLM


@torch.inference_mode()
def teacher_forced(model: LoopedLM, batches: list[torch.Tensor], depth: Depth, policy: str) -> tuple[float, float]:
    """Mean next-token loss and mean loops per token of ``batches`` decoded one token per step at ``depth``."""
    total, count, loops = 0.0, 0, []
    for batch in batches:
        rows, length = batch.shape
        decoder = Decoder(model, rows, length, policy)
        logits = torch.stack([decoder.prefill(r, batch[r, :1], depth) for r in range(rows)])
        loops.append(torch.full((rows,), depth.max_loops if isinstance(depth, AdaptiveDepth) else depth))
        for t in range(1, length):
            total += float(F.cross_entropy(logits, batch[:, t], reduction="sum"))
            count += rows
            if t + 1 < length:
                logits, used = decoder.step(list(range(rows)), batch[:, t], [depth] * rows)
                loops.append(used)
    return total / count, float(torch.cat(loops).float().mean())


def evaluate(name: str, ckpt: str, args: argparse.Namespace) -> dict[str, Any]:
    model, _ = load_model(ckpt)
    data = TextDataModule(seq_len=args.seq_len, batch_size=args.batch_size, val_batches=args.batches)
    data.setup("validate")
    batches = [b for _, b in zip(range(args.batches), data.val_dataloader())]
    K = model.config.max_loops
    points: list[dict[str, Any]] = []
    depths: list[tuple[str, Any, Depth]] = [("fixed", k, k) for k in range(1, K + 1)]
    depths += [(crit, th, AdaptiveDepth(K, th, crit)) for crit, ths in (("kl", args.kl), ("delta", args.delta)) for th in ths]
    for kind, value, depth in depths:
        start = time.perf_counter()
        loss, mean_loops = teacher_forced(model, batches, depth, args.kv_cache)
        points.append({"kind": kind, "value": value, "loss": loss, "mean_loops": mean_loops})
        print(f"{name:10s} {kind:6s} {value!s:>8s}  loss {loss:.4f}  loops/token {mean_loops:.3f}  "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    fixed = sorted((p["mean_loops"], p["loss"]) for p in points if p["kind"] == "fixed")
    for p in points:
        if p["kind"] != "fixed":
            p["fixed_loss_at_same_loops"] = float(np.interp(p["mean_loops"], *zip(*fixed)))
            p["gap"] = p["loss"] - p["fixed_loss_at_same_loops"]
    return {"ckpt": ckpt, "max_loops": K, "tokens": sum(b.numel() - b.shape[0] for b in batches), "points": points}


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, (name, result) in zip(axes[0], results.items()):
        for kind, style in (("fixed", "o-"), ("kl", "s--"), ("delta", "^:")):
            pts = sorted((p["mean_loops"], p["loss"]) for p in result["points"] if p["kind"] == kind)
            if pts:
                ax.plot(*zip(*pts), style, label="fixed k" if kind == "fixed" else f"auto ({kind})")
        ax.set(title=name, xlabel="mean loops per token", ylabel="validation loss (nats/token)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--ckpt_path", action="append", required=True, help="NAME=PATH, repeatable.")
    parser.add_argument("--batches", type=int, default=2, help="Validation batches per point.")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--kv_cache", default="per_loop", choices=["per_loop", "last_loop"])
    parser.add_argument("--kl", type=float, nargs="*", default=[1e-3, 1e-2, 3e-2, 0.1], help="KL thresholds.")
    parser.add_argument("--delta", type=float, nargs="*", default=[0.1, 0.3, 0.5, 1.0], help="Delta thresholds.")
    parser.add_argument("--out", default="bench/results/adaptive.json")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    results = {}
    for item in args.ckpt_path:
        name, _, path = item.partition("=")
        results[name] = evaluate(name, path, args)
    print(f"\n{'model':10s} {'depth':14s} {'loops/token':>11s} {'loss':>8s} {'fixed at same loops':>20s} {'gap':>8s}")
    for name, result in results.items():
        for p in result["points"]:
            depth = f"k={p['value']}" if p["kind"] == "fixed" else f"{p['kind']} {p['value']:g}"
            extra = f"{p['fixed_loss_at_same_loops']:20.4f} {p['gap']:+8.4f}" if "gap" in p else ""
            print(f"{name:10s} {depth:14s} {p['mean_loops']:11.3f} {p['loss']:8.4f} {extra}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    out.write_text(json.dumps({"settings": settings, "results": results}, indent=2))
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
