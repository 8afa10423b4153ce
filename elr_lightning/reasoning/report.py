"""Reasoning accuracy in reports: tables by task, difficulty and k, the issue's targets, and plots.

``elr ablate --reasoning N`` stores each run's ``{task: {level: {k: accuracy}}}`` in its result;
:func:`ablation_section` turns the runs into the report's section (mean ± half the range over
seeds) with three checks on the ``elr`` arm:

* depth pays: at the hardest level it learns of some task (accuracy at k = K at least
  :data:`LEARNED_MARGIN` above chance), k = K beats k = 1 by at least :data:`DEPTH_GAIN`;
* k = 1 costs nothing: its mean accuracy over every task and level is at most
  :data:`K1_TOLERANCE` below the ``baseline`` arm's;
* accuracy rises with k: the mean over every task and level does not fall from one k to the next.
"""

from __future__ import annotations

from statistics import mean
from typing import Any, Optional

from elr_lightning.files import save_figure

from elr_lightning.reasoning.generators import GENERATORS

DEPTH_GAIN = 0.10
"""Accuracy points k = K must add over k = 1 at the hardest level learned (the issue's target)."""

K1_TOLERANCE = 0.02
"""How far below the baseline ELR's k = 1 may be (the issue's target)."""

LEARNED_MARGIN = 0.10
"""A level counts as learned when accuracy at k = K is this far above chance."""

#: ``{series label: {x: value}}`` per panel title.
Panels = dict[str, dict[str, dict[int, float]]]


def format_levels(table: dict[str, dict[int, dict[int, Any]]], loops: list[int]) -> str:
    """A Markdown table of ``{task: {level: {k: cell}}}``: one row per task and level, one column per k.

    A cell is a float (printed with three decimals), a preformatted string, or missing (``-``).
    """
    rows = [["task", "difficulty"] + [f"k={k}" for k in loops]]
    rows.append(["---"] * len(rows[0]))
    for task, levels in table.items():
        for level, scores in levels.items():
            cells = [scores.get(k) for k in loops]
            rows.append([task, str(level)] + ["-" if c is None else c if isinstance(c, str) else f"{c:.3f}" for c in cells])
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def plot_panels(panels: Panels, path: str, xlabel: str = "difficulty", ylabel: str = "exact match") -> None:
    """PNG with one panel per task: each series' accuracy against ``xlabel``."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4 * max(len(panels), 1), 3.5), dpi=100)
    axes = fig.subplots(1, max(len(panels), 1), squeeze=False)[0]
    for ax, (title, series) in zip(axes, panels.items()):
        for label, points in series.items():
            xs = sorted(points)
            ax.plot(xs, [points[x] for x in xs], marker="o", label=label)
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=6)
    fig.tight_layout()
    save_figure(fig, path)


def by_k(table: dict[str, dict[int, dict[int, float]]]) -> Panels:
    """``{task: {level: {k: acc}}}`` as panels per task with one series per k (x: difficulty)."""
    panels: Panels = {}
    for task, levels in table.items():
        for level, scores in levels.items():
            for k, value in scores.items():
                panels.setdefault(task, {}).setdefault(f"k={k}", {})[level] = value
    return panels


def collect(results: list[dict[str, Any]]) -> dict[str, dict[str, dict[int, dict[int, list[float]]]]]:
    """``{arm: {task: {level: {k: [accuracy per seed]}}}}`` of the runs that carry reasoning scores."""
    table: dict[str, dict[str, dict[int, dict[int, list[float]]]]] = {}
    for run in results:
        for task, levels in (run.get("reasoning") or {}).items():
            for level, scores in levels.items():
                for k, value in scores.items():
                    cell = table.setdefault(run["arm"], {}).setdefault(task, {}).setdefault(int(level), {})
                    cell.setdefault(int(k), []).append(float(value))
    return table


def _mean_over_levels(arm: dict[str, dict[int, dict[int, list[float]]]], k: int) -> Optional[float]:
    values = [mean(s[k]) for levels in arm.values() for s in levels.values() if k in s]
    return mean(values) if values else None


def checks(table: dict[str, dict[str, dict[int, dict[int, list[float]]]]], k_max: int) -> list[tuple[str, str, str]]:
    """The three targets on the ``elr`` arm as ``(claim, figure, holds / does not hold / n/a)``."""
    elr = table.get("elr")
    if not elr:
        return [("the elr arm was scored", "no reasoning scores for arm elr", "n/a")]
    out = []
    best: Optional[tuple[float, str, int]] = None
    for task, levels in elr.items():
        chance = GENERATORS[task].chance if task in GENERATORS else 0.0
        learned = [lv for lv, s in levels.items() if k_max in s and mean(s[k_max]) >= chance + LEARNED_MARGIN]
        if learned and 1 in levels[max(learned)]:
            level = max(learned)
            gain = mean(levels[level][k_max]) - mean(levels[level][1])
            best = max(best, (gain, task, level)) if best else (gain, task, level)
    if best is None:
        out.append((f"k = {k_max} beats k = 1 by {DEPTH_GAIN:.0%} at the hardest level learned", "no level learned", "does not hold"))
    else:
        gain, task, level = best
        status = "holds" if gain >= DEPTH_GAIN else "does not hold"
        out.append((f"k = {k_max} beats k = 1 by {DEPTH_GAIN:.0%} at the hardest level learned",
                    f"{task} level {level}: {gain:+.3f}", status))  # fmt: skip
    k1, base = _mean_over_levels(elr, 1), _mean_over_levels(table.get("baseline", {}), 1)
    if k1 is None or base is None:
        out.append((f"k = 1 within {K1_TOLERANCE:.0%} of the baseline", "baseline or k = 1 not scored", "n/a"))
    else:
        status = "holds" if k1 >= base - K1_TOLERANCE else "does not hold"
        out.append((f"k = 1 within {K1_TOLERANCE:.0%} of the baseline", f"{k1:.3f} vs {base:.3f}", status))
    ks = sorted({k for levels in elr.values() for s in levels.values() for k in s})
    means = [_mean_over_levels(elr, k) for k in ks]
    rising = all(b >= a for a, b in zip(means, means[1:]))  # type: ignore[operator]
    figure = " → ".join(f"{m:.3f}" for m in means if m is not None)
    out.append(("mean accuracy does not fall as k grows", figure, "holds" if rising else "does not hold"))
    return out


def _cell(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{mean(values):.3f} ± {(max(values) - min(values)) / 2:.3f}"


def ablation_section(results: list[dict[str, Any]], k_max: int) -> str:
    """The report's Markdown section on reasoning accuracy (empty when no run was scored)."""
    table = collect(results)
    if not table:
        return ""
    ks = list(range(1, k_max + 1))
    lines = ["## Reasoning accuracy (exact match on held-out instances)", ""]
    for arm, tasks in table.items():
        cells = {task: {lv: {k: _cell(v) for k, v in s.items()} for lv, s in levels.items()} for task, levels in tasks.items()}
        lines += [f"### `{arm}`", "", format_levels(cells, ks), ""]
    lines += ["### Targets", "", "| check | figure | status |", "|---|---|---|"]
    lines += [f"| {claim} | {figure} | **{status}** |" for claim, figure, status in checks(table, k_max)]
    return "\n".join(lines) + "\n"


def ablation_panels(results: list[dict[str, Any]]) -> Panels:
    """Panels per task, one series per arm and k, of the mean accuracy over seeds against difficulty."""
    panels: Panels = {}
    for arm, tasks in collect(results).items():
        for task, levels in tasks.items():
            for level, scores in levels.items():
                for k, values in scores.items():
                    panels.setdefault(task, {}).setdefault(f"{arm} k={k}", {})[level] = mean(values)
    return panels
