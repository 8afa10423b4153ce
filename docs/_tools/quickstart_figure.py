"""Draw the front page's figure from a quickstart run's TensorBoard scalars.

    elr fit --config config/quickstart.yaml
    python docs/_tools/quickstart_figure.py runs/quickstart/version_0 docs/images/quickstart-loss-per-k.png

Left: validation loss at every k over training. Right: the last validation's loss against k, with
the change from k = 1 written beside each point.
"""

from __future__ import annotations

import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def main(run_dir: str, out: str) -> None:
    events = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    events.Reload()
    tags = sorted((t for t in events.Tags()["scalars"] if re.fullmatch(r"val/loss_k\d+", t)), key=lambda t: int(t[10:]))
    if not tags:
        raise SystemExit(f"{run_dir}: no val/loss_k* scalars; give the folder of a quickstart run's event file")
    curves = {int(t[10:]): [(s.step + 1, s.value) for s in events.Scalars(t)] for t in tags}
    fig, (left, right) = plt.subplots(1, 2, figsize=(7.2, 2.7), dpi=110, gridspec_kw={"width_ratios": [1.6, 1]})
    for k, points in curves.items():
        left.plot(*zip(*points), marker="o", markersize=2.5, linewidth=1.2, label=f"k = {k}")
    left.set(xlabel="optimizer step", ylabel="validation loss (nats/byte)", title="one model at every k (the curves overlap)")
    left.legend(frameon=False)
    last = {k: points[-1][1] for k, points in curves.items()}
    ks = sorted(last)
    right.plot(ks, [last[k] for k in ks], marker="o", color="black", linewidth=1.2)
    for k in ks[1:]:
        right.annotate(f"{last[k] - last[ks[0]]:+.4f}", (k, last[k]), textcoords="offset points", xytext=(-8, 6),
                       ha="right", fontsize=8)
    step = curves[ks[0]][-1][0]
    right.set(xlabel="loops k", ylabel="validation loss", xticks=ks, title=f"after {step} steps, zoomed")
    right.ticklabel_format(axis="y", useOffset=False)
    fig.tight_layout()
    fig.savefig(out)
    print(f"wrote {out}: " + ", ".join(f"k = {k}: {last[k]:.4f}" for k in ks))


if __name__ == "__main__":
    main(*sys.argv[1:3])
