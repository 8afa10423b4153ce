"""``elr eval``: lm-evaluation-harness accuracy of one checkpoint at several loop counts k.

The checkpoint is loaded once; for each k the harness runs the tasks through the same
:class:`~elr_lightning.eval.adapter.ELRLM` with its loop count set to k. Prints one table (tasks
by k, with the chance level, the average, and the fraction of the k = K gain each k captures, as
the paper's "two and three loops capture 79% and 96% of the gain"), and writes the harness's JSON
per k, ``summary.json`` and a PNG of accuracy against k; optionally logs to TensorBoard.

``--loops 1,2,3,auto`` adds adaptive depth per token (``loops=auto`` of the adapter), once per
``--threshold`` (e.g. ``0.01,0.001``) under ``--exit_criterion`` and the budget ``--max_loops``:
each such point is a column of the table with its mean loops per scored token, an entry of
``summary.json``'s ``adaptive``, and a star in the PNG at its mean loops.
``elr eval-tasks`` writes the local tasks' data files.

A checkpoint trained on a depth task (:mod:`elr_lightning.depth`, whose alphabet is its saved
tokenizer) is scored without the harness (``--tasks depth`` or no ``--tasks``): exact match per
difficulty and k, from k = 1 to 2K by default, as a table, ``summary.json`` and
``depth_heatmap.png`` (:mod:`elr_lightning.depth.evaluate`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from collections.abc import Sequence
from typing import Any, Literal, Optional

import torch

from elr_lightning.arguments import CommandParser, add_loops, add_switch, command_parser
from elr_lightning.files import print_written, refuse_to_replace, save_figure, write_file
from elr_lightning.errors import refuse_unread_flags
from elr_lightning.loop_points import auto_label, check_loops, parse_thresholds
from elr_lightning.checkpoints.tokenizer import choose_tokenizer
from elr_lightning.checkpoints.trust import add_trust_argument, apply_trust_argument

def eval_parser() -> CommandParser:
    """The parser of ``elr eval``."""
    p = command_parser("eval", "lm-evaluation-harness accuracy of a checkpoint at several k.")
    p.add_argument("--ckpt_path", type=str, required=True, help="Checkpoint written by `elr fit`.")
    add_loops(
        p, "Loop counts, with auto for depth per token (e.g. 1-3,auto); default 1..max_loops (depth tasks: 1..2K)",
        auto=True,
    )  # fmt: skip
    p.add_argument("--threshold", type=Optional[str], default=None,
                   help="Exit thresholds of --loops auto, one point each, e.g. 0.01,0.001; default 0.001.")  # fmt: skip
    p.add_argument("--exit_criterion", type=Optional[Literal["kl", "delta"]], default=None,
                   help="Exit criterion of --loops auto; default kl.")  # fmt: skip
    p.add_argument("--max_loops", type=Optional[int], default=None, help="Budget of --loops auto (arch.max_loops).")
    p.add_argument("--tasks", type=Optional[str], default=None,
                   help="Comma-separated harness tasks, e.g. elr_reasoning, or 'depth'; default elr_local, or depth for a "
                   "checkpoint trained on a depth task.")  # fmt: skip
    p.add_argument("--limit", type=Optional[float], default=None,
                   help="At most this many documents per task (< 1: a fraction); depth: instances per difficulty (256).")  # fmt: skip
    p.add_argument("--difficulties", type=Optional[str], default=None,
                   help="Depth tasks: difficulties to score, e.g. 1,3,6; default the checkpoint's data.eval_difficulties.")  # fmt: skip
    p.add_argument("--num_fewshot", type=Optional[int], default=None, help="Few-shot examples per prompt.")
    p.add_argument("--batch_size", type=int, default=16, help="Requests per forward pass.")
    p.add_argument(
        "--kv_cache", type=Literal["per_loop", "last_loop"], default="per_loop",
        help="KV-cache policy; per_loop (default) scores independently of the context/continuation split.",
    )  # fmt: skip
    p.add_argument("--device", type=str, default="cpu", help="Device, e.g. cpu or cuda.")
    p.add_argument("--dtype", type=Literal["float32", "bfloat16", "float16"], default="float32", help="Autocast dtype.")
    p.add_argument("--tokenizer", type=Optional[str], default=None, help="Override the checkpoint's saved tokenizer.")
    add_switch(p, "--allow_extrapolation", False, "Allow loops above arch.max_loops.")
    add_switch(
        p, "--fold", None,
        "Compute each k's conditioning constants once (default, the model's serve_folded); --no_fold runs the "
        "conditioner per forward pass.",
    )  # fmt: skip
    p.add_argument("--include_path", type=Optional[str], default=None, help="Extra folder of task YAMLs.")
    p.add_argument("--data_dir", type=Optional[str], default=None, help="Local task data (built there if missing).")
    p.add_argument("--output_dir", type=str, default="eval", help="Folder for the JSON results and the PNG.")
    add_switch(p, "--overwrite", False, "Replace the result files of an earlier elr eval in --output_dir.")
    p.add_argument("--log_dir", type=Optional[str], default=None, help="TensorBoard log folder.")
    p.add_argument("--seed", type=int, default=0, help="Seed of the harness's samplers and of sampled generation.")
    add_trust_argument(p)
    return p


#: The files an ``elr eval`` writes into ``--output_dir`` (harness tasks and depth tasks).
RESULT_FILES = re.compile(r"^(summary\.json|results_.+\.json|accuracy_vs_k\.png|reasoning_vs_k\.png|depth_heatmap\.png)$")


def earlier_results(output_dir: str) -> list[str]:
    """The result files of an earlier ``elr eval`` in ``output_dir`` (:data:`RESULT_FILES`), sorted."""
    if not os.path.isdir(output_dir):
        return []
    return sorted(name for name in os.listdir(output_dir) if RESULT_FILES.match(name))


def eval_command(argv: list[str]) -> None:
    """``elr eval``; ``elr`` reports a bad input in one line with exit status 1."""
    run_eval(eval_parser().parse_args(argv))


def run_eval(args: Any) -> dict[str, Any]:
    """Run the harness at every requested k; return the summary that ``summary.json`` holds."""
    loops, auto = (list(args.loops.counts), args.loops.auto) if args.loops is not None else (None, False)
    if not auto:
        flags = {"--threshold": args.threshold, "--exit_criterion": args.exit_criterion, "--max_loops": args.max_loops}
        refuse_unread_flags(flags, "--loops auto", "add auto, e.g. --loops 1-3,auto")
    thresholds = parse_thresholds(args.threshold) if args.threshold is not None else [1e-3]
    criterion = args.exit_criterion or "kl"
    if not os.path.exists(args.ckpt_path):
        raise FileNotFoundError(f"--ckpt_path: checkpoint {args.ckpt_path!r} does not exist")
    refuse_to_replace("--output_dir", args.output_dir, earlier_results(args.output_dir), args.overwrite,
                      "the earlier results")  # fmt: skip
    apply_trust_argument(args.trust_module)
    from elr_lightning.depth.evaluate import depth_task_of, run_depth_eval
    from elr_lightning.inference.generate import load_model

    loaded = None
    if args.tasks in (None, "depth"):
        loaded = load_model(args.ckpt_path, map_location=torch.device(args.device))
        task = depth_task_of(loaded[1].tokenizer)
        if task is not None:
            return run_depth_eval(args, loaded[0], task)
        if args.tasks == "depth":
            raise ValueError("--tasks depth: this checkpoint was not trained on a depth task (its tokenizer is no task's alphabet)")
    if args.difficulties is not None:
        raise ValueError("--difficulties is only read for a checkpoint trained on a depth task; drop it")
    from elr_lightning.eval import LOCAL_GROUP, TASKS_DIR, require_harness

    require_harness()
    from lm_eval.tasks import TaskManager

    from elr_lightning.eval import ELRLM
    from elr_lightning.eval.reasoning import by_difficulty
    from elr_lightning.reasoning.report import by_k, format_levels, plot_panels

    tasks = [t.strip() for t in (args.tasks or LOCAL_GROUP).split(",") if t.strip()]
    include = [TASKS_DIR] + ([args.include_path] if args.include_path else [])
    metadata = {"data_dir": args.data_dir} if args.data_dir else {}
    logging.getLogger("lm_eval.api.task").addFilter(_drop_custom_kwargs_hint)
    # The local tasks alone need no index of the harness's thousands of task files (seconds saved).
    manager = TaskManager(include_path=include, include_defaults=False, metadata=metadata)
    if not all(manager.match_tasks([t]) for t in tasks):
        manager = TaskManager(include_path=include, metadata=metadata)
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        raise ValueError(
            f"--tasks: unknown task(s) {', '.join(unknown)}; `lm_eval ls tasks` lists the harness's, "
            f"{LOCAL_GROUP} runs the local ones"
        )
    model, module = loaded or load_model(args.ckpt_path, map_location=torch.device(args.device))
    config = model.config
    loops = list(range(1, config.max_loops + 1)) if loops is None else loops
    for k in loops:
        check_loops(k, config.max_loops, args.allow_extrapolation, field="--loops", flag="--allow_extrapolation")
    budget = config.max_loops if args.max_loops is None else args.max_loops
    check_loops(budget, config.max_loops, args.allow_extrapolation, field="--max_loops", flag="--allow_extrapolation")
    tokenizer = choose_tokenizer(module.tokenizer, args.tokenizer, config.vocab_size)
    lm = ELRLM.from_model(model, tokenizer, loops=loops[0] if loops else "auto", kv_cache=args.kv_cache,
                          batch_size=args.batch_size, dtype=args.dtype, allow_extrapolation=True, fold=args.fold,
                          exit_criterion=criterion, max_loops=budget)  # fmt: skip
    os.makedirs(args.output_dir, exist_ok=True)
    points = len(loops) + (len(thresholds) if auto else 0)
    per_k: dict[int, dict[str, Any]] = {}
    for k in loops:
        lm.loops = k
        print(f"elr eval: k={k} ({loops.index(k) + 1}/{points})", file=sys.stderr, flush=True)
        per_k[k] = _evaluate(lm, tasks, manager, args)
        _write_json(os.path.join(args.output_dir, f"results_k{k}.json"), per_k[k])
    adaptive: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    for i, threshold in enumerate(thresholds if auto else []):
        label = auto_label(criterion, threshold)
        lm.loops, lm.threshold, lm.auto_loops, lm.auto_tokens = "auto", threshold, 0, 0
        print(f"elr eval: {label} ({len(loops) + i + 1}/{points})", file=sys.stderr, flush=True)
        results = _evaluate(lm, tasks, manager, args)
        info = {"criterion": criterion, "threshold": threshold, "max_loops": budget,
                "mean_loops": lm.mean_loops()}  # fmt: skip
        adaptive[label] = (results, info)
        _write_json(os.path.join(args.output_dir, f"results_{label.replace(':', '_')}.json"), results)
    summary = summarize(per_k, adaptive)
    summary.update(ckpt_path=args.ckpt_path, kv_cache=args.kv_cache, limit=args.limit)
    levels = by_difficulty(summary)
    if levels:
        summary["reasoning"] = levels
    table = os.path.join(args.output_dir, "summary.json")
    _write_json(table, summary)
    print(format_table(summary))
    pictures = [os.path.join(args.output_dir, "accuracy_vs_k.png")]
    plot(summary, pictures[0])
    if levels:
        print(format_levels(levels, loops))
        pictures.append(os.path.join(args.output_dir, "reasoning_vs_k.png"))
        plot_panels(by_k(levels), pictures[-1])
    print_written("eval", table, pictures)
    if args.log_dir:
        log_tensorboard(summary, args.log_dir)
    return summary


def _drop_custom_kwargs_hint(record: logging.LogRecord) -> bool:
    """Hide the harness's hint about ``--metadata`` that every ``custom_dataset`` task logs on load."""
    return "Custom kwargs can be passed" not in record.getMessage()


def _evaluate(lm: Any, tasks: list[str], manager: Any, args: Any) -> dict[str, Any]:
    from lm_eval import simple_evaluate

    results = simple_evaluate(
        model=lm,
        tasks=tasks,
        task_manager=manager,
        limit=args.limit,
        num_fewshot=args.num_fewshot,
        random_seed=args.seed,
        numpy_random_seed=args.seed,
        torch_random_seed=args.seed,
        fewshot_random_seed=args.seed,
    )
    if results is None:
        raise ValueError("the harness returned no results")
    return results


def _write_json(path: str, obj: Any) -> None:
    from lm_eval.utils import handle_non_serializable

    write_file(path, json.dumps(obj, indent=2, default=handle_non_serializable, ensure_ascii=False))


def _primary_metric(config: dict[str, Any]) -> Optional[str]:
    names = [m["metric"] for m in config.get("metric_list", []) if isinstance(m.get("metric"), str)]
    return "acc" if "acc" in names else (names[0] if names else None)


def summarize(
    per_k: dict[int, dict[str, Any]], adaptive: Optional[dict[str, tuple[dict[str, Any], dict[str, Any]]]] = None
) -> dict[str, Any]:
    """Scores per task and k, the chance levels, the average and the gain captured at each k.

    The gain captured at k is ``(avg_k - avg_first) / (avg_K - avg_first)`` with ``first`` the
    smallest and ``K`` the largest k evaluated; ``None`` when ``avg_K == avg_first`` (or no k was).

    Args:
        per_k: The harness's results dictionary for each k.
        adaptive: Per adaptive point (:func:`~elr_lightning.loop_points.auto_label`), its results and ``{"criterion",
            "threshold", "max_loops", "mean_loops"}``.

    Returns:
        ``{"loops", "tasks": {task: {"metric", "chance", "scores": {k: score}}}, "average": {k: avg},
        "gain_captured": {k: fraction or None}, "adaptive": {label: {..., "scores": {task: score},
        "average", "gain_captured"}}}`` (``adaptive`` only when asked for).
    """
    adaptive = adaptive or {}
    loops = sorted(per_k)
    runs = [per_k[k] for k in loops] + [results for results, _ in adaptive.values()]
    tasks: dict[str, dict[str, Any]] = {}
    metrics: dict[str, str] = {}
    for name, config in sorted(runs[0]["configs"].items()):
        metric = _primary_metric(config)
        if metric is None:
            continue
        metrics[name] = metric
        chance = (config.get("metadata") or {}).get("chance")
        scores = {k: float(per_k[k]["results"][name][f"{metric},none"]) for k in loops}
        tasks[name] = {"metric": metric, "chance": chance, "scores": scores}

    def mean(scores: list[float]) -> float:
        return sum(scores) / max(len(scores), 1)

    average = {k: mean([t["scores"][k] for t in tasks.values()]) for k in loops}
    span = average[loops[-1]] - average[loops[0]] if loops else 0.0

    def captured(avg: float) -> Optional[float]:
        return (avg - average[loops[0]]) / span if span != 0 else None

    gain = {k: captured(average[k]) for k in loops}
    chances = [t["chance"] for t in tasks.values()]
    chance_avg = sum(chances) / len(chances) if chances and all(c is not None for c in chances) else None
    summary = {"loops": loops, "tasks": tasks, "average": average, "chance_average": chance_avg, "gain_captured": gain}
    if adaptive:
        summary["adaptive"] = {}
        for label, (results, info) in adaptive.items():
            scores = {name: float(results["results"][name][f"{metric},none"]) for name, metric in metrics.items()}
            avg = mean(list(scores.values()))
            summary["adaptive"][label] = {**info, "scores": scores, "average": avg, "gain_captured": captured(avg)}
    return summary


def format_table(summary: dict[str, Any]) -> str:
    """The summary as a Markdown table: one row per task, one column per k and per adaptive point."""
    loops = summary["loops"]
    adaptive = summary.get("adaptive", {})

    def fmt(x: Optional[float], pct: bool = False) -> str:
        return "-" if x is None else (f"{100 * x:.0f}%" if pct else f"{x:.3f}")

    head = ["task", "metric", "chance"] + [f"k={k}" for k in loops] + list(adaptive)
    rows = [head, ["---"] * len(head)]
    for name, t in summary["tasks"].items():
        auto = [fmt(a["scores"][name]) for a in adaptive.values()]
        rows.append([name, t["metric"], fmt(t["chance"])] + [fmt(t["scores"][k]) for k in loops] + auto)
    rows.append(["average", "", fmt(summary["chance_average"])] + [fmt(summary["average"][k]) for k in loops]
                + [fmt(a["average"]) for a in adaptive.values()])  # fmt: skip
    top = f"k={loops[-1]}" if loops else "the largest k"
    rows.append([f"gain captured (of {top})", "", ""] + [fmt(summary["gain_captured"][k], True) for k in loops]
                + [fmt(a["gain_captured"], True) for a in adaptive.values()])  # fmt: skip
    if adaptive:
        rows.append(["loops per token", "", ""] + [str(k) for k in loops]
                    + [fmt(a["mean_loops"]) for a in adaptive.values()])  # fmt: skip
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def plot(summary: dict[str, Any], path: str) -> None:
    """PNG of each task's score and the average against loops per token, chance levels dashed.

    Fixed k are lines at x = k; each adaptive point is a star at its mean loops per token.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loops = summary["loops"]
    adaptive = [a for a in summary.get("adaptive", {}).values() if a["mean_loops"] is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, t in summary["tasks"].items():
        (line,) = ax.plot(loops, [t["scores"][k] for k in loops], marker="o", label=f"{name} ({t['metric']})")
        ax.scatter([a["mean_loops"] for a in adaptive], [a["scores"][name] for a in adaptive], marker="*", s=80,
                   color=line.get_color())  # fmt: skip
        if t["chance"] is not None:
            ax.axhline(t["chance"], color=line.get_color(), linestyle="--", linewidth=0.8)
    ax.plot(loops, [summary["average"][k] for k in loops], marker="s", color="black", label="average")
    if adaptive:
        ax.scatter([a["mean_loops"] for a in adaptive], [a["average"] for a in adaptive], marker="*", s=120,
                   color="black", label="auto (average)")  # fmt: skip
    ax.set_xlabel("loops per token")
    ax.set_ylabel("score")
    ax.set_xticks(sorted(set(loops) | {a["max_loops"] for a in adaptive}))
    ax.set_title("accuracy vs loops (dashed: chance, stars: auto)" if adaptive else "accuracy vs loop count (dashed: chance)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=100)
    plt.close(fig)


def log_tensorboard(summary: dict[str, Any], log_dir: str) -> None:
    """Scalars ``eval/<task>/<metric>`` and ``eval/average`` with k as the step; ``eval/auto_<criterion>_<threshold>/average``
    and ``.../mean_loops`` per adaptive point, at its budget as the step."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(log_dir) as writer:
        for k in summary["loops"]:
            for name, t in summary["tasks"].items():
                writer.add_scalar(f"eval/{name}/{t['metric']}", t["scores"][k], k)
            writer.add_scalar("eval/average", summary["average"][k], k)
        for label, a in summary.get("adaptive", {}).items():  # one point each, at its budget
            tag = "eval/" + label.replace(":", "_")
            writer.add_scalar(f"{tag}/average", a["average"], a["max_loops"])
            if a["mean_loops"] is not None:
                writer.add_scalar(f"{tag}/mean_loops", a["mean_loops"], a["max_loops"])


def eval_tasks_parser() -> CommandParser:
    """The parser of ``elr eval-tasks``."""
    p = command_parser("eval-tasks", "Build the local evaluation tasks from held-out stdlib text.")
    p.add_argument("--out", type=Optional[str], default=None, help="Folder; default $ELR_EVAL_DATA or the user cache.")
    p.add_argument("--seed", type=int, default=0, help="Seed of the example draw.")
    p.add_argument("--n", type=int, default=500, help="Examples per task.")
    p.add_argument("--val_fraction", type=float, default=0.01, help="data.val_fraction of the evaluated run.")
    return p


def eval_tasks_command(argv: Sequence[str]) -> None:
    """``elr eval-tasks``: write the local tasks' JSONL files (offline, deterministic from the seed)."""
    from elr_lightning.eval.taskdata import build_tasks, default_data_dir

    args = eval_tasks_parser().parse_args(list(argv))
    paths = build_tasks(args.out or default_data_dir(), seed=args.seed, n=args.n, val_fraction=args.val_fraction)
    for name, path in paths.items():
        print(f"{name}: {path}")
