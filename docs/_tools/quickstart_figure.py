"""Draw the quickstart's figure from its results file, the one the pages quote (``docs/_tools/results.py``).

    elr fit --config config/quickstart.yaml
    python docs/_tools/results.py fit runs/quickstart/version_0 docs/results/quickstart.json --config config/quickstart.yaml
    python docs/_tools/quickstart_figure.py docs/results/quickstart.json docs/images/quickstart-loss-per-k.png

Left: validation loss at every k over training. Right: the last validation's loss against k, with
one kind of label beside each point: its change from k = 1 (a running total, so the label at K is
the gain the pages quote as ``gain_k1_to_K``), never the step from the previous k.
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main(results: str, out: str) -> None:
    validations = json.load(open(results))["validations"]
    steps = sorted(validations, key=int)
    ks = sorted(validations[steps[-1]]["loss"], key=int)
    fig, (left, right) = plt.subplots(1, 2, figsize=(7.2, 2.7), dpi=110, gridspec_kw={"width_ratios": [1.6, 1]})
    for k in ks:
        left.plot([int(s) for s in steps], [validations[s]["loss"][k] for s in steps], marker="o", markersize=2.5,
                  linewidth=1.2, label=f"k = {k}")  # fmt: skip
    left.set(xlabel="optimizer step", ylabel="validation loss (nats/byte)", title="one model at every k (the curves overlap)")
    left.legend(frameon=False)
    last = {int(k): validations[steps[-1]]["loss"][k] for k in ks}
    right.plot(list(last), list(last.values()), marker="o", color="black", linewidth=1.2)
    first = min(last)
    for k, loss in list(last.items())[1:]:
        right.annotate(f"{loss - last[first]:+.4f}", (k, loss), textcoords="offset points", xytext=(-8, 6),
                       ha="right", fontsize=8)  # fmt: skip
    right.set(xlabel="loops k", ylabel="validation loss", xticks=list(last), title=f"step {steps[-1]}: change from k = {first}")
    right.ticklabel_format(axis="y", useOffset=False)
    fig.tight_layout()
    fig.savefig(out)
    print(f"wrote {out}: " + ", ".join(f"k = {k}: {loss:.4f}" for k, loss in last.items()))


if __name__ == "__main__":
    main(*sys.argv[1:3])
