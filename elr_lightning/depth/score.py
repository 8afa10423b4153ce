"""Accuracy of a looped model on held-out depth instances, per difficulty and loop count k; its table and heatmap.

One forward pass per difficulty and k scores every labelled position at once (the inputs are
given, so nothing is generated): an instance is right when the prediction at every labelled
position is its label (exact match), and the labels of the instance's own difficulty (the
hardest level it holds) are scored alone too (``deep``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
import torch

from elr_lightning.inference.cache import PolicyLike
from elr_lightning.inference.decode import Decoder, Depth, budget
from elr_lightning.depth.datamodule import instance_rng
from elr_lightning.batches import IGNORE_INDEX
from elr_lightning.depth.tasks import DepthTask, draw
from elr_lightning.model import LoopedLM
from elr_lightning.updates import NonRecurrent

#: ``{difficulty: {k: {"exact": ..., "deep": ..., "instances": ...}}}``: accuracies in [0, 1] and the distinct
#: held-out instances the cell holds (:func:`heldout_arrays`).
Table = dict[int, dict[int, dict[str, float]]]


def default_loops(model: LoopedLM) -> list[int]:
    """The loop counts a depth report scores: 1..2K (K + 1..2K extrapolate), or just 1 for the non-recurrent baseline."""
    if isinstance(model.update, NonRecurrent):
        return [1]
    return list(range(1, 2 * model.config.max_loops + 1))


PATIENCE = 8
""":func:`heldout_arrays` takes the held-out space as exhausted after ``PATIENCE * n`` draws in a row bring no new instance."""


def heldout_arrays(task: DepthTask, difficulty: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Up to ``n`` distinct held-out instances of ``difficulty`` as ``(input_ids, labels, levels)``.

    Draws ``(seed, "eval", difficulty, i)`` for ``i = 0, 1, ...`` without replacement: an instance
    already taken is skipped. Drawing stops at ``n`` distinct instances, or when ``PATIENCE * n``
    draws in a row were all repeats: the held-out space is then smaller than ``n`` (prefix parity of
    8 bits holds about 40 strings) and every instance of it is in. The rows are as many as were found.
    """
    rows, seen, i, repeats = [], set(), 0, 0
    while len(rows) < n and repeats < PATIENCE * n:
        row = draw(task, instance_rng(seed, "eval", difficulty, i), difficulty, heldout=True)
        i += 1
        key = row[0].tobytes()
        if key in seen:
            repeats += 1
            continue
        seen.add(key)
        rows.append(row)
        repeats = 0
    return tuple(torch.from_numpy(np.stack(parts)) for parts in zip(*rows))  # type: ignore[return-value]


@torch.inference_mode()
def decode_teacher_forced(
    model: LoopedLM, ids: torch.Tensor, depth: Depth, kv_cache: PolicyLike = "per_loop"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``[B, T, V]`` and loops used ``[B, T]`` of ``ids`` ``[B, T]`` fed one token per step to the serving decoder.

    Each row's first token is prefilled at the depth's budget; every later token is decoded at
    ``depth`` (a fixed k, or :class:`~elr_lightning.inference.decode.AdaptiveDepth` per token), teacher-forced:
    the next token fed is the true one, so position t's logits are ``elr generate``'s after ids[:t + 1].
    """
    rows, length = ids.shape
    decoder = Decoder(model, rows, length, kv_cache)
    logits = [torch.stack([decoder.prefill(r, ids[r, :1], depth) for r in range(rows)])]
    loops = [torch.full((rows,), budget(depth), dtype=torch.long)]
    for t in range(1, length):
        out, used = decoder.step(list(range(rows)), ids[:, t], [depth] * rows)
        logits.append(out)
        loops.append(used.long())
    return torch.stack(logits, dim=1), torch.stack(loops, dim=1)


def _cells(hit: torch.Tensor, labels: torch.Tensor, levels: torch.Tensor, difficulty: int) -> dict[str, float]:
    """Exact match and deepest-level accuracy of predictions ``hit`` (``[B, T]`` bool) of one difficulty, and its instances."""
    deepest = levels == difficulty
    return {
        "exact": float((hit | (labels == IGNORE_INDEX)).all(dim=1).float().mean()),
        "deep": float(hit[deepest].float().mean()) if bool(deepest.any()) else 0.0,
        "instances": hit.shape[0],
    }


@torch.no_grad()
def score(
    model: LoopedLM,
    task: DepthTask,
    difficulties: Sequence[int],
    loops: Sequence[int],
    n: int = 256,
    seed: int = 0,
    batch_size: int = 256,
) -> Table:
    """Exact match and deepest-level label accuracy on up to ``n`` distinct held-out instances per difficulty and k.

    Each cell also counts its instances (``instances``): fewer than ``n`` where the held-out space
    of a difficulty is smaller (:func:`heldout_arrays`).

    Args:
        model: The looped model (put in eval mode here; its mode is restored).
        task: The task it was trained on.
        difficulties: Difficulties to score.
        loops: Loop counts (above ``arch.max_loops``: extrapolation).
        n: Instances per difficulty (at most).
        seed: Seed of the held-out draw.
        batch_size: Instances per forward pass.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    table: Table = {}
    for difficulty in difficulties:
        ids, labels, levels = heldout_arrays(task, difficulty, n, seed)
        table[difficulty] = {}
        for k in loops:
            hits = [model(ids[i : i + batch_size].to(device), k).argmax(-1).cpu() for i in range(0, len(ids), batch_size)]
            table[difficulty][k] = _cells(torch.cat(hits) == labels, labels, levels, difficulty)
    model.train(was_training)
    return table


def score_adaptive(
    model: LoopedLM,
    task: DepthTask,
    difficulties: Sequence[int],
    depth: Depth,
    n: int = 256,
    seed: int = 0,
    kv_cache: PolicyLike = "per_loop",
) -> dict[int, dict[str, float]]:
    """:func:`score`'s cells at ``depth`` through the serving decoder, with the mean loops per token.

    Every token of an instance is decoded one at a time (:func:`decode_teacher_forced`), so
    ``mean_loops`` counts the loops of every position, labelled or not (the first at the budget).
    With a fixed k the cells equal :func:`score`'s (per-loop cache).

    Returns:
        ``{difficulty: {"exact", "deep", "mean_loops"}}``.
    """
    model.eval()
    out = {}
    for difficulty in difficulties:
        ids, labels, levels = heldout_arrays(task, difficulty, n, seed)
        logits, loops = decode_teacher_forced(model, ids, depth, kv_cache)
        cells = _cells(logits.argmax(-1).cpu() == labels, labels, levels, difficulty)
        out[difficulty] = {**cells, "mean_loops": float(loops.float().mean())}
    return out


def format_table(table: Table, metric: str = "exact", task: Optional[DepthTask] = None) -> str:
    """A Markdown table: one row per difficulty, one column per k, cells in percent.

    Where the cells count their instances, the column ``instances`` after the difficulty gives the
    distinct held-out instances behind every cell of the row (the same instances at every k).
    """
    loops = sorted({k for row in table.values() for k in row})
    name = task.name if task is not None else "difficulty"
    counted = all("instances" in cell for row in table.values() for cell in row.values())
    rows = [[name] + ["instances"] * counted + [f"k={k}" for k in loops], ["---"] * (len(loops) + 1 + counted)]
    for difficulty, row in sorted(table.items()):
        count = [f"{max(int(cell['instances']) for cell in row.values())}"] if counted else []
        rows.append([str(difficulty)] + count + [f"{100 * row[k][metric]:.1f}" if k in row else "-" for k in loops])
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def heatmap(table: Table, metric: str = "exact", title: str = "", max_loops: Optional[int] = None) -> Any:
    """A matplotlib ``Figure``: difficulty (rows) x k (columns), colour and number the accuracy in percent.

    ``max_loops`` draws a line after the trained budget K (columns to its right extrapolate).
    """
    from matplotlib.figure import Figure

    loops = sorted({k for row in table.values() for k in row})
    fig = Figure(figsize=(1.5 + 0.55 * len(loops), 1.0 + 0.45 * len(table)), dpi=100)
    image = draw_heatmap(fig.subplots(), table, metric, title or f"{metric} accuracy (%)", max_loops)
    fig.colorbar(image, ax=fig.axes[0], fraction=0.05)
    fig.tight_layout()
    return fig


def draw_heatmap(ax: Any, table: Table, metric: str, title: str, max_loops: Optional[int] = None) -> Any:
    """Draw :func:`heatmap`'s picture on the matplotlib axes ``ax``; return the image."""
    difficulties = sorted(table)
    loops = sorted({k for row in table.values() for k in row})
    values = np.array([[100 * table[d][k][metric] if k in table[d] else np.nan for k in loops] for d in difficulties])
    image = ax.imshow(values, vmin=0, vmax=100, cmap="viridis", aspect="auto", origin="lower")
    for i in range(len(difficulties)):
        for j in range(len(loops)):
            if not np.isnan(values[i, j]):
                ax.text(j, i, f"{values[i, j]:.0f}", ha="center", va="center", fontsize=7,
                        color="black" if values[i, j] > 60 else "white")  # fmt: skip
    ax.set_xticks(range(len(loops)), [str(k) for k in loops])
    counts = [max((int(c["instances"]) for c in table[d].values() if "instances" in c), default=0) for d in difficulties]
    ax.set_yticks(range(len(difficulties)), [f"{d} (n={m})" if m else str(d) for d, m in zip(difficulties, counts)])
    ax.set_xlabel("loops k")
    ax.set_ylabel("difficulty")
    if max_loops is not None and max_loops in loops and max_loops != loops[-1]:
        ax.axvline(loops.index(max_loops) + 0.5, color="white", linewidth=1.5, linestyle="--")
    ax.set_title(title, fontsize=9)
    return image
