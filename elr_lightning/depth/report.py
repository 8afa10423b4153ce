"""Depth-task accuracy in ``elr ablate`` reports: tables per arm (difficulty x k), the issue's targets, heatmaps.

``elr ablate --depth N`` stores each run's exact match ``{difficulty: {k: accuracy}}`` in its result
(key ``depth``); :func:`ablation_section` turns the runs into the report's section, mean ± half the
range over seeds, with the targets checked on the ``elr`` arm at the hardest training difficulty:

* depth pays: k = K at least :data:`DEPTH_GAIN` above k = 1, and no k in 1..K more than
  :data:`MONOTONE_SLACK` below an earlier one;
* no overthinking: k = 2K at most :data:`EXTRAPOLATION_DROP` below k = K (where 2K was scored);
* no dips beyond the budget: at every trained difficulty (up to the hardest), every k in K + 1..2K
  at most :data:`EXTRAPOLATION_SLACK` below k = K;
* longer than trained: at twice the hardest difficulty (where scored), some k <= 2K reaches
  :data:`LONGER_TARGET`;
* k = 1 costs nothing: within :data:`K1_TOLERANCE` of the ``baseline`` arm at every difficulty;
* the ``specialist`` (trained at k = K only) is the ceiling at k = K: the gap is reported.
"""

from __future__ import annotations

from statistics import mean
from typing import Any, Optional

from elr_lightning.files import save_figure

DEPTH_GAIN = 0.40
"""Exact-match points k = K must add over k = 1 at the hardest training difficulty."""

MONOTONE_SLACK = 0.02
"""How far accuracy may dip from one k to a larger one (up to K) and still count as monotone."""

EXTRAPOLATION_DROP = 0.05
"""How far accuracy at k = 2K may fall below k = K."""

EXTRAPOLATION_SLACK = 0.02
"""How far any k in K + 1..2K may fall below k = K at a trained difficulty."""

LONGER_TARGET = 0.80
"""Exact match some k <= 2K must reach at twice the hardest training difficulty."""

K1_TOLERANCE = 0.02
"""How far below the baseline ELR's k = 1 may be."""

#: ``{arm: {difficulty: {k: [accuracy per seed]}}}``.
Collected = dict[str, dict[int, dict[int, list[float]]]]


def collect(results: list[dict[str, Any]]) -> Collected:
    """The exact match of every run that carries depth scores, by arm, difficulty and k."""
    table: Collected = {}
    for run in results:
        for difficulty, row in ((run.get("depth") or {}).get("exact") or {}).items():
            for k, value in row.items():
                cell = table.setdefault(run["arm"], {}).setdefault(int(difficulty), {})
                cell.setdefault(int(k), []).append(float(value))
    return table


def _cell(values: Optional[list[float]]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{100 * values[0]:.1f}"
    return f"{100 * mean(values):.1f} ± {100 * (max(values) - min(values)) / 2:.1f}"


def checks(table: Collected, k_max: int, hardest: int) -> list[tuple[str, str, str]]:
    """The targets as ``(claim, figure, holds / does not hold / n/a)``."""
    elr = table.get("elr", {}).get(hardest)
    if not elr or 1 not in elr or k_max not in elr:
        return [("the elr arm was scored at k = 1 and K", f"no elr scores at difficulty {hardest}", "n/a")]
    at = {k: mean(v) for k, v in elr.items()}
    out = []
    gain = at[k_max] - at[1]
    out.append((f"difficulty {hardest}: k = {k_max} beats k = 1 by {100 * DEPTH_GAIN:.0f} points", f"{100 * gain:+.1f}",
                "holds" if gain >= DEPTH_GAIN else "does not hold"))  # fmt: skip
    dips = [at[j] - at[k] for k in range(1, k_max + 1) for j in range(1, k) if k in at and j in at]
    worst = max(dips, default=0.0)
    out.append((f"difficulty {hardest}: monotone in k = 1..{k_max} within {100 * MONOTONE_SLACK:.0f} points",
                f"largest dip {100 * max(worst, 0.0):.1f}", "holds" if worst <= MONOTONE_SLACK else "does not hold"))  # fmt: skip
    if 2 * k_max in at:
        drop = at[k_max] - at[2 * k_max]
        out.append((f"difficulty {hardest}: k = {2 * k_max} at most {100 * EXTRAPOLATION_DROP:.0f} points below k = {k_max}",
                    f"{100 * at[2 * k_max]:.1f} vs {100 * at[k_max]:.1f}", "holds" if drop <= EXTRAPOLATION_DROP else "does not hold"))  # fmt: skip
    out += _beyond_budget_checks(table["elr"], k_max, hardest)
    baseline = table.get("baseline", {})
    gaps = {d: mean(row[1]) - mean(baseline[d][1]) for d, row in table["elr"].items() if 1 in row and 1 in baseline.get(d, {})}
    if gaps:
        d, gap = min(gaps.items(), key=lambda item: item[1])
        out.append((f"k = 1 within {100 * K1_TOLERANCE:.0f} points of the baseline at every difficulty",
                    f"worst: difficulty {d}, {100 * gap:+.1f}", "holds" if gap >= -K1_TOLERANCE else "does not hold"))  # fmt: skip
    specialist = table.get("specialist", {}).get(hardest, {})
    if k_max in specialist:
        out.append((f"difficulty {hardest}: the specialist (k = {k_max} only) is the ceiling at k = {k_max}",
                    f"elr {100 * at[k_max]:.1f} vs specialist {100 * mean(specialist[k_max]):.1f}", "reported"))  # fmt: skip
    return out


def _beyond_budget_checks(elr: dict[int, dict[int, list[float]]], k_max: int, hardest: int) -> list[tuple[str, str, str]]:
    """No dips at k in K + 1..2K at the trained difficulties; twice the hardest difficulty reached at some k <= 2K."""
    out = []
    drops = [(mean(row[k_max]) - mean(row[k]), d, k) for d, row in elr.items() if d <= hardest and k_max in row
             for k in range(k_max + 1, 2 * k_max + 1) if k in row]  # fmt: skip
    if drops:
        drop, d, k = max(drops, key=lambda item: item[0])
        out.append((f"trained difficulties: every k in {k_max + 1}..{2 * k_max} within {100 * EXTRAPOLATION_SLACK:.0f} points of k = {k_max}",
                    f"worst: difficulty {d}, k = {k}, {100 * mean(elr[d][k]):.1f} vs {100 * mean(elr[d][k_max]):.1f}",
                    "holds" if drop <= EXTRAPOLATION_SLACK else "does not hold"))  # fmt: skip
    longer = elr.get(2 * hardest, {})
    reached = [(mean(v), k) for k, v in longer.items() if k <= 2 * k_max]
    if reached:
        best, k = max(reached, key=lambda item: item[0])
        out.append((f"difficulty {2 * hardest} (twice the trained): some k <= {2 * k_max} reaches {100 * LONGER_TARGET:.0f}%",
                    f"best: k = {k}, {100 * best:.1f}", "holds" if best >= LONGER_TARGET else "does not hold"))  # fmt: skip
    return out


def ablation_section(results: list[dict[str, Any]], k_max: int) -> str:
    """The report's Markdown section on depth-task accuracy (empty when no run was scored)."""
    table = collect(results)
    if not table:
        return ""
    task = next(run["depth"]["task"] for run in results if run.get("depth"))
    hardest = max(run["depth"]["trained_difficulty"] for run in results if run.get("depth"))
    counts = {d: n for run in results for d, n in ((run.get("depth") or {}).get("instances") or {}).items()}
    lines = [f"## Depth task `{task}`: exact match (%) on held-out instances", ""]
    if counts:
        lines += ["Distinct held-out instances per difficulty (the same for every arm, seed and k): "
                  + ", ".join(f"{d}: {n}" for d, n in sorted(counts.items(), key=lambda item: int(item[0]))) + ".", ""]  # fmt: skip
    for arm, rows in table.items():
        loops = sorted({k for row in rows.values() for k in row})
        lines += [f"### `{arm}`", "", "| difficulty | " + " | ".join(f"k={k}" for k in loops) + " |",
                  "|---" * (len(loops) + 1) + "|"]  # fmt: skip
        lines += [f"| {d} | " + " | ".join(_cell(rows[d].get(k)) for k in loops) + " |" for d in sorted(rows)]
        lines.append("")
    lines += [f"### Targets (hardest training difficulty: {hardest})", "", "| check | figure | status |", "|---|---|---|"]
    lines += [f"| {claim} | {figure} | **{status}** |" for claim, figure, status in checks(table, k_max, hardest)]
    return "\n".join(lines) + "\n"


def plot_heatmaps(results: list[dict[str, Any]], k_max: int, path: str) -> None:
    """PNG with one heatmap (difficulty x k, mean over seeds) per arm."""
    from matplotlib.figure import Figure

    from elr_lightning.depth.score import draw_heatmap

    table = collect(results)
    fig = Figure(figsize=(1.5 + 4.5 * len(table), 4.0), dpi=100)
    axes = fig.subplots(1, len(table), squeeze=False)[0]
    for ax, (arm, rows) in zip(axes, table.items()):
        cells = {d: {k: {"exact": mean(v)} for k, v in row.items()} for d, row in rows.items()}
        draw_heatmap(ax, cells, "exact", arm, k_max)
    fig.tight_layout()
    save_figure(fig, path)
