"""The report of ``elr ablate``: per-arm table, the paper's checks (§6) and a loss-vs-k plot.

Spread: with several seeds, an arm's spread at k is the range (max - min) of its seeds' losses.
A check compares a figure with a threshold; when the two differ by less than the spread of the
arms involved, it is marked ``within spread`` (undecided), not as holding or not. Two arms are
compared on the seeds both ran (:func:`paired`), so an arm run at more seeds than another
does not compare its mean with the other's single seed. Comparisons inside one arm (its loss at
k against k - 1, its gain) are paired by seed and judged on the per-seed differences.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from statistics import mean
from typing import Any, Callable, Mapping, Optional

from elr_lightning.files import save_figure, write_file
from elr_lightning.depth import report as depth_report
from elr_lightning.reasoning.report import ablation_panels, ablation_section, plot_panels

HOLDS, FAILS, NOISE, MISSING = "holds", "does not hold", "within spread", "n/a"


@dataclass(frozen=True)
class ArmSummary:
    """Final validation figures of one arm over its seeds, per k."""

    arm: str
    seeds: list[int]
    loss: dict[int, list[float]]
    bpb: dict[int, list[float]]

    def mean(self, k: int) -> float:
        """Mean loss at k over seeds."""
        return mean(self.loss[k])

    def spread(self, k: int) -> float:
        """Range of the loss at k over seeds (0 with one seed)."""
        return max(self.loss[k]) - min(self.loss[k])

    def gain(self, k: int) -> list[float]:
        """Per-seed loss at k = 1 minus loss at ``k``."""
        return [a - b for a, b in zip(self.loss[1], self.loss[k])]

    def on_seeds(self, seeds: list[int]) -> "ArmSummary":
        """This arm restricted to ``seeds``, in that order."""
        keep = [self.seeds.index(seed) for seed in seeds if seed in self.seeds]
        pick = lambda table: {k: [v[j] for j in keep] for k, v in table.items()}  # noqa: E731
        return ArmSummary(self.arm, [self.seeds[j] for j in keep], pick(self.loss), pick(self.bpb))


def paired(a: ArmSummary, b: ArmSummary) -> tuple[ArmSummary, ArmSummary]:
    """``a`` and ``b`` on the seeds both ran, so that a difference of means is not a difference of
    seeds (a run's level moves with its seed); unchanged when they share none."""
    common = [seed for seed in a.seeds if seed in b.seeds]
    return (a.on_seeds(common), b.on_seeds(common)) if common else (a, b)


def summarise(results: list[dict[str, Any]]) -> dict[str, ArmSummary]:
    """Group run results (``result.json`` contents) by arm, keeping the run order of arms and seeds."""
    arms: dict[str, ArmSummary] = {}
    for r in results:
        s = arms.setdefault(r["arm"], ArmSummary(r["arm"], [], {}, {}))
        s.seeds.append(int(r["seed"]))
        for key, table in (("loss", s.loss), ("bpb", s.bpb)):
            for k, value in r[key].items():
                table.setdefault(int(k), []).append(float(value))
    return arms


@dataclass(frozen=True)
class Check:
    """One of the paper's claims, its figure and whether it holds here."""

    claim: str
    figure: str
    status: str


def _decide(margin: float, noise: float) -> str:
    """``holds`` if ``margin > 0``, ``within spread`` if ``|margin| < noise``, else ``does not hold``."""
    if noise > 0 and abs(margin) < noise:
        return NOISE
    return HOLDS if margin > 0 else FAILS


def _missing(claim: str, *names: str) -> Check:
    return Check(claim, f"needs arm(s) {', '.join(names)}", MISSING)


def _near_baseline(elr: ArmSummary, base: ArmSummary, k_max: int) -> tuple[str, str]:
    noise = max(elr.spread(1), base.spread(1)) / base.mean(1)
    e, b = paired(elr, base)
    rel = (e.mean(1) - b.mean(1)) / b.mean(1)
    return f"{rel:+.2%} vs the baseline", _decide(0.005 - rel, noise)


def _worse_at_every_k(elr: ArmSummary, other: ArmSummary, k_max: int) -> tuple[str, str]:
    ks = [k for k in elr.loss if k in other.loss]
    e, o = paired(elr, other)
    diffs = {k: o.mean(k) - e.mean(k) for k in ks}
    worst = min(ks, key=lambda k: diffs[k])
    noise = max(elr.spread(worst), other.spread(worst))
    return ", ".join(f"k={k} {d:+.4f}" for k, d in diffs.items()), _decide(diffs[worst], noise)


def _f0_above_baseline(f0: ArmSummary, base: ArmSummary, k_max: int) -> tuple[str, str]:
    f, b = paired(f0, base)
    d = f.mean(1) - b.mean(1)
    return f"{d:+.4f}", _decide(d, max(f0.spread(1), base.spread(1)))


def _conditioning_helps(elr: ArmSummary, nc: ArmSummary, k_max: int) -> Optional[tuple[str, str]]:
    if k_max < 2:
        return None
    ks = [k for k in range(2, k_max + 1) if k in elr.loss and k in nc.loss]
    e, n = paired(elr, nc)
    diffs = {k: n.mean(k) - e.mean(k) for k in ks}
    worst = min(ks, key=lambda k: diffs[k])
    figure = ", ".join(f"k={k} {d:+.4f} without" for k, d in diffs.items())
    return figure, _decide(diffs[worst], max(elr.spread(worst), nc.spread(worst)))


def _delayed_keeps_gain(elr: ArmSummary, delayed: ArmSummary, k_max: int) -> tuple[str, str]:
    e, d = paired(elr, delayed)
    g_elr, g_del = mean(e.gain(k_max)), mean(d.gain(k_max))
    noise = max(max(g) - min(g) for g in (elr.gain(k_max), delayed.gain(k_max)))  # gains are paired per seed
    if g_elr <= 0:
        return f"ELR has no k = K gain ({g_elr:+.4f})", FAILS
    return f"{g_del / g_elr:.0%} ({g_del:+.4f} of {g_elr:+.4f})", _decide(g_del - 0.8 * g_elr, noise)


def _falls_with_k(elr: ArmSummary, k_max: int) -> Optional[tuple[str, str]]:
    if not all(k in elr.loss for k in range(1, k_max + 1)):
        return None
    # The k's of a run share its weights, so the steps are paired within each seed: the claim holds
    # when every seed falls at every step, fails when one step rises in every seed, else the seeds disagree.
    per_seed = {k: [b - a for a, b in zip(elr.loss[k - 1], elr.loss[k])] for k in range(2, k_max + 1)}
    figure = ", ".join(f"k={k - 1}->{k} {mean(d):+.4f}" for k, d in per_seed.items())
    if all(d < 0 for steps in per_seed.values() for d in steps):
        return figure, HOLDS
    if any(all(d >= 0 for d in steps) for steps in per_seed.values()):
        return figure, FAILS
    return figure, NOISE


@dataclass(frozen=True)
class Claim:
    """One of the paper's claims (§6): the arms it compares and how its figure and status are found.

    Attributes:
        text: The claim, as the report's table shows it.
        arms: The arms it needs, passed to ``judge`` in this order (then ``k_max``).
        judge: ``(figure, status)``, or ``None`` where the arms cannot decide it (``n/a``).
    """

    text: str
    arms: tuple[str, ...]
    judge: Callable[..., Optional[tuple[str, str]]]


#: The claims that :func:`paper_checks` checks, in the report's order (the specialist's last).
CLAIMS: tuple[Claim, ...] = (
    Claim("ELR within 0.5% of the baseline at k = 1", ("elr", "baseline"), _near_baseline),
    Claim("replace update worse than adaptive delta at every k", ("elr", "replace"), _worse_at_every_k),
    Claim("residual update worse than adaptive delta at every k", ("elr", "residual"), _worse_at_every_k),
    Claim("f = 0 above the baseline at k = 1", ("f0", "baseline"), _f0_above_baseline),
    Claim("conditioning lowers the loss at every k >= 2", ("elr", "no_cond"), _conditioning_helps),
    Claim("delayed switch keeps >= 80% of ELR's k = K gain", ("elr", "delayed"), _delayed_keeps_gain),
    Claim("ELR's loss falls strictly from k = 1 to K", ("elr",), _falls_with_k),
)


def paper_checks(arms: dict[str, ArmSummary], k_max: int) -> list[Check]:
    """The checks of issue 10 / the paper's §6 (:data:`CLAIMS`) on the arms present (others are ``n/a``)."""
    checks = []
    for claim in CLAIMS:
        found = [arms.get(name) for name in claim.arms]
        judged = claim.judge(*found, k_max) if all(found) else None
        checks.append(Check(claim.text, *judged) if judged else _missing(claim.text, *claim.arms))
    checks.append(specialist_check(arms, k_max))
    return checks


def specialist_check(arms: dict[str, ArmSummary], k_max: int) -> Check:
    """Issue 10's target: ELR's k = K gain over its own k = 1 is >= 80% of the best specialist seed's
    k = K gain over the baseline (of the same seed where the baseline ran it); when no specialist
    seed beats the baseline, >= 1% of ELR's k = 1 loss."""
    claim = "ELR's k = K gain >= 80% of the specialist's (best seed) gain over the baseline"
    elr, base, spec = arms.get("elr"), arms.get("baseline"), arms.get("specialist")
    if not (elr and base and spec and k_max in spec.loss and k_max in elr.loss):
        return _missing(claim, "elr", "baseline", "specialist")
    gains = elr.gain(k_max)
    gain, noise = mean(gains), max(gains) - min(gains)
    common = [seed for seed in spec.seeds if seed in base.seeds]
    if common:
        best = max(base.on_seeds([seed]).mean(1) - spec.on_seeds([seed]).mean(k_max) for seed in common)
    else:  # no seed in common: each specialist seed against the baseline's mean
        best = max(base.mean(1) - v for v in spec.loss[k_max])
    if best > 0:
        figure = f"{gain / best:.0%} ({gain:+.4f} of {best:+.4f})"
        return Check(claim, figure, _decide(gain - 0.8 * best, noise))
    need = 0.01 * elr.mean(1)
    figure = f"no specialist seed beats the baseline ({best:+.4f}); gain {gain:+.4f}, need >= {need:.4f}"
    return Check(claim, figure, _decide(gain - need, noise))


def _cell(values: Optional[list[float]], digits: int) -> str:
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{mean(values):.{digits}f} ± {(max(values) - min(values)) / 2:.{digits}f}"


def markdown(
    arms: dict[str, ArmSummary], checks: list[Check], k_max: int, descriptions: Mapping[str, str]
) -> str:
    """The report's Markdown: one table of loss and one of bpb per arm and k, then the checks.

    ``descriptions`` says in a few words what each arm changes (shown beside its name).
    """
    ks = sorted({k for s in arms.values() for k in s.loss} | set(range(1, k_max + 1)))
    seeds = sorted({seed for s in arms.values() for seed in s.seeds})
    lines = [
        "# `elr ablate` report",
        "",
        f"Final validation per arm at each k (seeds {', '.join(map(str, seeds))}; "
        + ("mean ± half the range over seeds)." if len(seeds) > 1 else "one seed)."),
        "",
    ]
    for key, title, digits in (("loss", "Validation loss", 4), ("bpb", "Bits per byte", 4)):
        lines += [f"## {title}", "", "| arm | " + " | ".join(f"k = {k}" for k in ks) + " | gain k = 1 → K |"]
        lines.append("|---|" + "---|" * (len(ks) + 1))
        for name, s in arms.items():
            table = s.loss if key == "loss" else s.bpb
            gain = _cell(s.gain(k_max), digits) if key == "loss" and {1, k_max} <= set(s.loss) and k_max > 1 else "—"
            label = f"`{name}`" + (f" ({descriptions[name]})" if name in descriptions else "")
            lines.append(f"| {label} | " + " | ".join(_cell(table.get(k), digits) for k in ks) + f" | {gain} |")
        lines.append("")
    lines += ["## The paper's checks", "", "| check | figure | status |", "|---|---|---|"]
    lines += [f"| {c.claim} | {c.figure} | **{c.status}** |" for c in checks]
    lines.append("")
    return "\n".join(lines)


def plot(arms: dict[str, ArmSummary], path: str) -> None:
    """PNG of the mean validation loss against k, one line per arm (error bars: the seed range)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4), dpi=110)
    ax = fig.add_subplot()
    for name, s in arms.items():
        ks = sorted(s.loss)
        means = [s.mean(k) for k in ks]
        half = [s.spread(k) / 2 for k in ks]
        if len(ks) == 1 and name == "baseline":
            ax.axhline(means[0], color="black", linestyle="--", linewidth=1, label="baseline (k = 1)")
            continue
        ax.errorbar(ks, means, yerr=half, marker="o", capsize=3, label=name)
    ax.set_xlabel("loops k")
    ax.set_ylabel("final validation loss")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


def write_report(results: list[dict[str, Any]], out: str, k_max: int, descriptions: Mapping[str, str]) -> str:
    """Write ``ablate.md``, ``loss_vs_k.png`` and ``results.json`` to ``out``; return the Markdown's path.

    Runs scored on the reasoning tasks add a section to ``ablate.md``
    (:func:`~elr_lightning.reasoning.report.ablation_section`) and ``reasoning_vs_k.png``; runs scored
    on a depth task (:func:`~elr_lightning.depth.report.ablation_section`) and ``depth_heatmaps.png``.
    """
    arms = summarise(results)
    checks = paper_checks(arms, k_max)
    write_file(os.path.join(out, "results.json"), json.dumps({"runs": results, "checks": [c.__dict__ for c in checks]}, indent=1))
    plot(arms, os.path.join(out, "loss_vs_k.png"))
    reasoning = ablation_section(results, k_max)
    if reasoning:
        plot_panels(ablation_panels(results), os.path.join(out, "reasoning_vs_k.png"))
    depth = depth_report.ablation_section(results, k_max)
    if depth:
        depth_report.plot_heatmaps(results, k_max, os.path.join(out, "depth_heatmaps.png"))
    path = os.path.join(out, "ablate.md")
    write_file(path, markdown(arms, checks, k_max, descriptions) + "".join("\n" + s for s in (reasoning, depth) if s))
    return path
