"""``elr eval`` on a checkpoint trained on a depth task: accuracy per difficulty x k, a table, a heatmap.

The task is the one whose alphabet is the checkpoint's saved tokenizer; the difficulties are
``--difficulties``, else the ``eval_difficulties`` of the checkpoint's data module. Scores come from
:func:`~elr_lightning.depth.score.score` (and, for ``--loops ...,auto``, from the serving decoder
with depth per token, :func:`~elr_lightning.depth.score.score_adaptive`).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Optional

import torch

from elr_lightning.files import print_written, save_figure, write_file
from elr_lightning.inference.decode import AdaptiveDepth
from elr_lightning.depth.score import Table, default_loops, format_table, heatmap, score, score_adaptive
from elr_lightning.depth.tasks import TASKS, DepthTask
from elr_lightning.model import LoopedLM
from elr_lightning.tokenizers import CharTokenizer, Tokenizer
from elr_lightning.checkpoints.trust import shown


def depth_task_of(tokenizer: Optional[Tokenizer]) -> Optional[DepthTask]:
    """The depth task whose alphabet ``tokenizer`` is, or ``None``."""
    if not isinstance(tokenizer, CharTokenizer):
        return None
    return next((task for task in TASKS.values() if task.alphabet == tokenizer.alphabet), None)


def saved_difficulties(ckpt_path: str) -> Optional[list[int]]:
    """The ``eval_difficulties`` of the data module a checkpoint was trained with, if it saved them.

    Read with ``weights_only=True``: Lightning keeps the data module's hyperparameters as plain data.
    They are checked as ``--difficulties`` is, before anything is drawn: a saved difficulty out of
    the task's range would size the instances (and their memory) by itself.

    Raises:
        ValueError: A saved task, difficulty or ``eval_difficulties`` out of range, naming the field.
    """
    from elr_lightning.checkpoints.io import is_sharded_checkpoint, read_sharded_meta
    from elr_lightning.depth.datamodule import default_difficulties
    from elr_lightning.depth.tasks import get_task
    from elr_lightning.checkpoints.safe_load import load_weights_only

    raw = read_sharded_meta(ckpt_path) if is_sharded_checkpoint(ckpt_path) else load_weights_only(ckpt_path)
    hparams = raw.get("datamodule_hyper_parameters") if isinstance(raw, dict) else None
    if not isinstance(hparams, dict) or "task" not in hparams:
        return None
    field = f"{ckpt_path!r}: datamodule_hyper_parameters"
    if not isinstance(hparams["task"], str):
        raise ValueError(f"{field}.task={shown(hparams['task'])} is not a depth task; use another checkpoint")
    task = get_task(hparams["task"], f"{field}.task")
    difficulty = task.check_difficulty(hparams.get("difficulty", task.min_difficulty), f"{field}.difficulty")
    saved = hparams.get("eval_difficulties")
    if saved is None:
        return default_difficulties(task, difficulty)
    if not isinstance(saved, (list, tuple)) or not saved:
        raise ValueError(f"{field}.eval_difficulties={shown(saved)} must be a non-empty list; use another checkpoint")
    return sorted({task.check_difficulty(d, f"{field}.eval_difficulties") for d in saved})


def parse_difficulties(spec: str, task: DepthTask) -> list[int]:
    """``"1,2,4"`` -> sorted distinct difficulties of ``task`` (a one-line ``ValueError`` naming ``--difficulties``)."""
    try:
        values = [int(part) for part in str(spec).split(",")]
    except ValueError:
        raise ValueError(f"--difficulties {spec!r}: write whole numbers separated by commas, e.g. 1,3,6") from None
    return sorted({task.check_difficulty(v, "--difficulties") for v in values})


def run_depth_eval(args: Any, model: LoopedLM, task: DepthTask) -> dict[str, Any]:
    """Score ``model`` on ``task`` at every requested k (and ``auto`` point); print, write and plot the table.

    ``args`` is ``elr eval``'s namespace: ``loops`` (default 1..2K: the extrapolation beyond the
    budget K is part of the report; 1 for a non-recurrent model), ``threshold``, ``exit_criterion``, ``max_loops``, ``limit``
    (distinct instances per difficulty, at most, default 256), ``difficulties``, ``seed``, ``kv_cache``,
    ``output_dir`` and ``log_dir``. ``summary.json`` holds ``exact``, ``deep`` and ``instances`` (the
    distinct held-out instances of every cell, fewer than ``limit`` where the held-out space is smaller),
    each ``{difficulty: {k: value}}``.
    """
    from elr_lightning.loop_points import auto_label, check_loops, parse_points, parse_thresholds

    max_loops = model.config.max_loops
    if args.loops is None:
        loops, auto = default_loops(model), False
    else:
        loops, auto = parse_points(args.loops)
        for k in loops:
            check_loops(k, max_loops, args.allow_extrapolation, field="--loops", flag="--allow_extrapolation")
    if args.difficulties is not None:
        difficulties = parse_difficulties(args.difficulties, task)
    else:
        difficulties = saved_difficulties(args.ckpt_path)
        if difficulties is None:
            raise ValueError(f"--difficulties: the checkpoint names none; pass e.g. --difficulties {task.min_difficulty},{task.min_difficulty + 2}")
    n = 256 if args.limit is None else int(args.limit)
    if n < 1:
        raise ValueError(f"--limit {args.limit}: the depth tasks need a whole number of instances >= 1 per difficulty")
    print(f"elr eval: depth task {task.name!r}, difficulties {difficulties}, k = {loops}", file=sys.stderr, flush=True)
    table = score(model, task, difficulties, loops, n, args.seed)
    summary: dict[str, Any] = {"task": task.name, "max_loops": max_loops, "loops": loops, "difficulties": difficulties,
                               "limit": n, "chance_per_label": task.chance, "exact": {}, "deep": {}, "instances": {}}  # fmt: skip
    for metric in ("exact", "deep", "instances"):
        summary[metric] = {d: {k: row[k][metric] for k in loops} for d, row in table.items()}
    if auto:
        budget = max_loops if args.max_loops is None else args.max_loops
        summary["adaptive"] = {}
        criterion = args.exit_criterion or "kl"
        for threshold in parse_thresholds(args.threshold) if args.threshold is not None else [1e-3]:
            depth = AdaptiveDepth(budget, threshold, criterion)
            summary["adaptive"][auto_label(criterion, threshold)] = score_adaptive(
                model, task, difficulties, depth, n, args.seed, args.kv_cache
            )
    print(_report(table, task, summary))
    os.makedirs(args.output_dir, exist_ok=True)
    written = os.path.join(args.output_dir, "summary.json"), os.path.join(args.output_dir, "depth_heatmap.png")
    write_file(written[0], json.dumps(summary, indent=2))
    figure = heatmap(table, title=f"{task.name}: exact match (%); right of the line: k > K", max_loops=max_loops)
    save_figure(figure, written[1])
    print_written("eval", written[0], written[1:])
    if args.log_dir:
        _log_tensorboard(table, figure, args.log_dir, task)
    return summary


def _report(table: Table, task: DepthTask, summary: dict[str, Any]) -> str:
    lines = [f"exact match (%) of up to {summary['limit']} distinct held-out instances per difficulty (column instances):",
             format_table(table, "exact", task),
             "", f"accuracy (%) of the labels of each instance's own difficulty (chance {100 * task.chance:.0f}%):",
             format_table(table, "deep", task)]  # fmt: skip
    for label, cells in summary.get("adaptive", {}).items():
        row = ", ".join(f"d{d}: {100 * c['exact']:.1f}% exact at {c['mean_loops']:.2f} loops/token" for d, c in cells.items())
        lines.append(f"{label}: {row}")
    return "\n".join(lines)


def _log_tensorboard(table: Table, figure: Any, log_dir: str, task: DepthTask) -> None:
    """Scalars ``eval_depth/d{difficulty}/exact`` and ``.../deep`` with k as the step, the heatmap and the table."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(log_dir) as writer:
        for difficulty, row in table.items():
            for k, cell in row.items():
                for metric in ("exact", "deep"):
                    writer.add_scalar(f"eval_depth/d{difficulty}/{metric}", cell[metric], k)
        writer.add_figure("eval_depth/heatmap", figure)
        writer.add_text("eval_depth/table", format_table(table, "exact", task))
