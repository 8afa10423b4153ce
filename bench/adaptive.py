"""Adaptive depth per token against fixed k: validation loss against mean loops per token (a Pareto plot).

For each checkpoint, held-out sequences of the default corpus (the validation split of
``TextDataModule``) are decoded token by token through the serving decoder
(:class:`~elr_lightning.inference.decode.Decoder`, teacher-forced: each step feeds the true next token), at
fixed k = 1..K and with ``loops="auto"`` at several thresholds of both exit criteria. Each point
is the mean next-token loss against the mean recurrent loops per token (the first token of each
sequence runs at the budget, as a prompt does). Adaptive depth beats fixed k where its loss lies
below the fixed-k line, linearly interpolated at its mean loops; the table prints that gap
(negative: adaptive is better at equal mean compute). Under ``per_loop`` the fixed-k points equal
the model's cache-free validation loss.

The same depths are scored on the local harness tasks (``elr_local``: ``elr_line_end`` accuracy,
``elr_complete_line`` exact match; ``--limit`` documents each, ``--limit 0`` skips them) through
the ``elr eval`` adapter (:class:`~elr_lightning.eval.ELRLM`, ``loops=auto`` for the adaptive
points): their average against the mean loops per scored continuation token (the first token of a
continuation runs at the budget, as the prefilled context does; generated tokens are not counted),
with the same gap to the fixed-k line (positive: adaptive is better). Needs the ``eval`` extra.

Writes ``bench/results/adaptive.json`` and ``bench/results/adaptive.png`` (loss above, accuracy below).

    python bench/adaptive.py --ckpt_path quickstart=runs/quickstart/version_0/checkpoints/last.ckpt \\
        --ckpt_path hybrid=runs/quickstart_hybrid/version_0/checkpoints/last.ckpt

A checkpoint trained on a depth task (``config/quickstart_depth.yaml``) is scored on its task's
held-out instances instead (:func:`~elr_lightning.depth.score.score_adaptive`, ``--instances`` per
difficulty, teacher-forced through the same decoder): exact match at each difficulty and the mean
over difficulties against the mean loops per token, for fixed k = 1..K and for ``auto`` at each
threshold of both criteria; ``fixed at same loops`` interpolates the fixed-k line at the auto point's
loops, and ``K's loops`` is the auto point's mean loops over K's. Writes ``bench/results/adaptive_depth.json``
and its PNG unless ``--out`` says otherwise.

    python bench/adaptive.py --ckpt_path depth=runs/quickstart_depth/version_0/checkpoints/last.ckpt
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
from elr_lightning.inference.decode import AdaptiveDepth, Depth
from elr_lightning.depth.evaluate import depth_task_of
from elr_lightning.depth.score import decode_teacher_forced, score_adaptive
from elr_lightning.inference.generate import load_model
from elr_lightning.model import LoopedLM


@torch.inference_mode()
def teacher_forced(model: LoopedLM, batches: list[torch.Tensor], depth: Depth, policy: str) -> tuple[float, float]:
    """Mean next-token loss and mean loops per token of ``batches`` decoded one token per step at ``depth``."""
    total, count, loops = 0.0, 0, []
    for batch in batches:
        logits, used = decode_teacher_forced(model, batch[:, :-1], depth, policy)
        total += float(F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum"))
        count += batch[:, 1:].numel()
        loops.append(used.flatten())
    return total / count, float(torch.cat(loops).float().mean())


def evaluate_depth(name: str, ckpt: str, task: Any, model: LoopedLM, args: argparse.Namespace) -> dict[str, Any]:
    """Exact match per difficulty (and their mean) against mean loops per token, fixed k = 1..K and ``auto``."""
    from elr_lightning.depth.evaluate import saved_difficulties

    K = model.config.max_loops
    difficulties = saved_difficulties(ckpt) or [task.min_difficulty]
    depths: list[tuple[str, Any, Depth]] = [("fixed", k, k) for k in range(1, K + 1)]
    depths += [(crit, th, AdaptiveDepth(K, th, crit)) for crit, ths in (("kl", args.kl), ("delta", args.delta)) for th in ths]
    points = []
    for kind, value, depth in depths:
        start = time.perf_counter()
        cells = score_adaptive(model, task, difficulties, depth, args.instances, kv_cache=args.kv_cache)
        mean_exact = float(np.mean([c["exact"] for c in cells.values()]))
        loops = float(np.mean([c["mean_loops"] for c in cells.values()]))
        points.append({"kind": kind, "value": value, "exact": mean_exact, "mean_loops": loops,
                       "per_difficulty": {str(d): c for d, c in cells.items()}})  # fmt: skip
        print(f"{name:10s} {kind:6s} {value!s:>8s}  exact {mean_exact:.4f}  loops/token {loops:.3f}  "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    fixed = sorted((p["mean_loops"], p["exact"]) for p in points if p["kind"] == "fixed")
    for p in points:
        if p["kind"] != "fixed":
            p["fixed_exact_at_same_loops"] = float(np.interp(p["mean_loops"], *zip(*fixed)))
            p["gap"] = p["exact"] - p["fixed_exact_at_same_loops"]
            p["loops_of_K"] = p["mean_loops"] / K
            p["exact_minus_K"] = p["exact"] - fixed[-1][1]
    return {"ckpt": ckpt, "task": task.name, "max_loops": K, "difficulties": difficulties,
            "instances": args.instances, "points": points}  # fmt: skip


def local_accuracy(model: LoopedLM, module: Any, depths: list[tuple[str, Any, Depth]], args: argparse.Namespace) -> list[dict]:
    """Per depth, the ``elr_local`` scores, their average and the mean loops per scored token."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from elr_lightning.eval import LOCAL_GROUP, TASKS_DIR, ELRLM
    from elr_lightning.eval.command import summarize
    from elr_lightning.loop_points import auto_label
    from elr_lightning.checkpoints.tokenizer import choose_tokenizer

    manager = TaskManager(include_path=[TASKS_DIR], include_defaults=False,
                          metadata={"data_dir": args.data_dir} if args.data_dir else {})  # fmt: skip
    tokenizer = choose_tokenizer(module.tokenizer, None, model.config.vocab_size)
    lm = ELRLM.from_model(model, tokenizer, kv_cache=args.kv_cache, batch_size=args.batch_size)
    per_k: dict[int, dict] = {}
    adaptive: dict[str, tuple[dict, dict]] = {}
    for kind, value, depth in depths:
        lm.loops = depth if kind == "fixed" else "auto"
        if kind != "fixed":
            lm.threshold, lm.exit_criterion, lm.auto_loops, lm.auto_tokens = value, kind, 0, 0
        results = simple_evaluate(model=lm, tasks=[LOCAL_GROUP], task_manager=manager, limit=args.limit,
                                  random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)  # fmt: skip
        if kind == "fixed":
            per_k[value] = results
        else:
            adaptive[auto_label(kind, value)] = (results, {"max_loops": depth.max_loops, "mean_loops": lm.mean_loops()})
    summary = summarize(per_k, adaptive)
    out = []
    for kind, value, _ in depths:
        if kind == "fixed":
            scores = {name: t["scores"][value] for name, t in summary["tasks"].items()}
            out.append({"scores": scores, "average": summary["average"][value], "mean_loops": float(value)})
        else:
            point = summary["adaptive"][auto_label(kind, value)]
            out.append({"scores": point["scores"], "average": point["average"], "mean_loops": point["mean_loops"]})
    return out


def evaluate(name: str, ckpt: str, args: argparse.Namespace) -> dict[str, Any]:
    model, module = load_model(ckpt)
    task = depth_task_of(module.tokenizer)
    if task is not None:
        return evaluate_depth(name, ckpt, task, model, args)
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
    if args.limit:
        start = time.perf_counter()
        for p, acc in zip(points, local_accuracy(model, module, depths, args)):
            p["accuracy"] = acc
        print(f"{name:10s} elr_local accuracy at {len(depths)} depths ({time.perf_counter() - start:.0f} s)", flush=True)
    fixed = sorted((p["mean_loops"], p["loss"]) for p in points if p["kind"] == "fixed")
    fixed_acc = sorted((p["accuracy"]["mean_loops"], p["accuracy"]["average"]) for p in points if p["kind"] == "fixed" and "accuracy" in p)
    for p in points:
        if p["kind"] != "fixed":
            p["fixed_loss_at_same_loops"] = float(np.interp(p["mean_loops"], *zip(*fixed)))
            p["gap"] = p["loss"] - p["fixed_loss_at_same_loops"]
            acc = p.get("accuracy")
            if acc and acc["mean_loops"] is not None:
                acc["fixed_at_same_loops"] = float(np.interp(acc["mean_loops"], *zip(*fixed_acc)))
                acc["gap"] = acc["average"] - acc["fixed_at_same_loops"]
    return {"ckpt": ckpt, "max_loops": K, "tokens": sum(b.numel() - b.shape[0] for b in batches), "points": points}


def plot(results: dict[str, Any], path: Path) -> None:
    """Loss (top row) and, where measured, ``elr_local`` average accuracy (bottom row) against mean loops per token."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("loss", "validation loss (nats/token)")]
    if any("task" in r for r in results.values()):
        panels = [("exact", "exact match, mean over difficulties")]
    elif any("accuracy" in p for r in results.values() for p in r["points"]):
        panels.append(("accuracy", "elr_local average score"))
    fig, axes = plt.subplots(len(panels), len(results), figsize=(5 * len(results), 4 * len(panels)), squeeze=False)
    for col, (name, result) in enumerate(results.items()):
        for row, (metric, ylabel) in enumerate(panels):
            ax = axes[row][col]
            for kind, style in (("fixed", "o-"), ("kl", "s--"), ("delta", "^:")):
                pts = sorted(_xy(p, metric) for p in result["points"] if p["kind"] == kind and _xy(p, metric) is not None)
                if pts:
                    ax.plot(*zip(*pts), style, label="fixed k" if kind == "fixed" else f"auto ({kind})")
            ax.set(title=name, xlabel="mean loops per token", ylabel=ylabel)
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _xy(point: dict[str, Any], metric: str) -> Any:
    """``(mean loops, value)`` of a point's loss or accuracy, or ``None`` where not measured."""
    if metric in ("loss", "exact"):
        return (point["mean_loops"], point[metric]) if metric in point else None
    acc = point.get("accuracy")
    return None if acc is None or acc["mean_loops"] is None else (acc["mean_loops"], acc["average"])


def print_depth(results: dict[str, Any]) -> None:
    """The depth tasks' Pareto table: exact match (mean over difficulties) against mean loops per token."""
    print(f"\n{'model':10s} {'depth':14s} {'loops/token':>11s} {'of K':>6s} {'exact':>7s} {'fixed at same loops':>20s} "
          f"{'gap':>7s} {'vs K':>7s}  per difficulty")  # fmt: skip
    for name, result in results.items():
        for p in result["points"]:
            depth = f"k={p['value']}" if p["kind"] == "fixed" else f"{p['kind']} {p['value']:g}"
            extra = (f"{p['fixed_exact_at_same_loops']:20.4f} {p['gap']:+7.4f} {p['exact_minus_K']:+7.4f}" if "gap" in p
                     else f"{'':36s}")  # fmt: skip
            cells = ", ".join(f"d{d} {c['exact']:.3f}" for d, c in p["per_difficulty"].items())
            print(f"{name:10s} {depth:14s} {p['mean_loops']:11.3f} {p['mean_loops'] / result['max_loops']:6.2f} "
                  f"{p['exact']:7.4f} {extra}  {cells}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--ckpt_path", action="append", required=True, help="NAME=PATH, repeatable.")
    parser.add_argument("--batches", type=int, default=2, help="Validation batches per point.")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--kv_cache", default="per_loop", choices=["per_loop", "last_loop"])
    parser.add_argument("--kl", type=float, nargs="*", default=[1e-3, 1e-2, 3e-2, 0.1], help="KL thresholds.")
    parser.add_argument("--delta", type=float, nargs="*", default=[0.1, 0.3, 0.5, 1.0], help="Delta thresholds.")
    parser.add_argument("--limit", type=int, default=100, help="elr_local documents per task per depth (0: no accuracy).")
    parser.add_argument("--data_dir", default=None, help="elr_local task data (built there if missing).")
    parser.add_argument("--instances", type=int, default=128, help="Depth tasks: held-out instances per difficulty.")
    parser.add_argument("--out", default=None, help="Default bench/results/adaptive.json (adaptive_depth.json for depth tasks).")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    results = {}
    for item in args.ckpt_path:
        name, _, path = item.partition("=")
        results[name] = evaluate(name, path, args)
    depth = {name: r for name, r in results.items() if "task" in r}
    if depth:
        print_depth(depth)
    text = {name: r for name, r in results.items() if "task" not in r}
    if text:
        print(f"\n{'model':10s} {'depth':14s} {'loops/token':>11s} {'loss':>8s} {'fixed at same loops':>20s} {'gap':>8s}")
    for name, result in text.items():
        for p in result["points"]:
            depth = f"k={p['value']}" if p["kind"] == "fixed" else f"{p['kind']} {p['value']:g}"
            extra = f"{p['fixed_loss_at_same_loops']:20.4f} {p['gap']:+8.4f}" if "gap" in p else ""
            print(f"{name:10s} {depth:14s} {p['mean_loops']:11.3f} {p['loss']:8.4f} {extra}")
    if args.limit and text:
        print(f"\n{'model':10s} {'depth':14s} {'loops/token':>11s} {'elr_local':>9s} {'fixed at same loops':>20s} {'gap':>8s}  per task")
        for name, result in text.items():
            for p in result["points"]:
                depth, acc = f"k={p['value']}" if p["kind"] == "fixed" else f"{p['kind']} {p['value']:g}", p["accuracy"]
                loops = "-" if acc["mean_loops"] is None else f"{acc['mean_loops']:.3f}"
                extra = f"{acc['fixed_at_same_loops']:20.4f} {acc['gap']:+8.4f}" if "gap" in acc else f"{'':29s}"
                tasks = ", ".join(f"{t} {v:.3f}" for t, v in acc["scores"].items())
                print(f"{name:10s} {depth:14s} {loops:>11s} {acc['average']:9.4f} {extra}  {tasks}")
    out = Path(args.out or f"bench/results/adaptive{'_depth' if depth and not text else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    out.write_text(json.dumps({"settings": settings, "results": results}, indent=2))
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
