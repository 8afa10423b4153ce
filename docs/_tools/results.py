"""One source for every figure the documentation quotes: the JSON files of ``docs/results/``.

A run's figures go into ``docs/results/<name>.json``, written from the run's own output files:

    OMP_NUM_THREADS=1 /usr/bin/time -v elr fit --config config/quickstart.yaml
    python docs/_tools/results.py fit runs/quickstart/version_0 docs/results/quickstart.json \\
        --config config/quickstart.yaml --cpu_s 345.6 --wall_s 670.7 --about "2 CPU cores shared with other jobs"
    python docs/_tools/results.py eval eval/summary.json docs/results/quickstart_depth.json --key eval

``fit`` reads the TensorBoard scalars of an ``elr fit`` run (``val/loss_k*`` and ``val/bpb_k*`` at each
validation, and the last validation's loss at k = 1 less its loss at K) and, with ``--config``, the
parameter count (``elr cost``). Its ``about`` always says how the run was made: the command, the
thread count (``OMP_NUM_THREADS`` of this shell, or torch's default), the CPUs, then ``--about``; and
``cpu_s``, ``wall_s``, ``max_rss_gb`` are this run's or absent, never an earlier run's. ``eval`` adds an ``elr eval``
``summary.json`` (or the JSON a ``bench/`` script writes) under ``--key``; ``ablate`` adds each run of
an ``elr ablate`` ``results.json`` under ``--key``, by run name (``baseline-s0``). Other keys of an
existing file are kept.

A page quotes a figure between two HTML comments that name where it comes from, invisible on GitHub
and on the site: ``<!-- fig quickstart.validations.800.loss .4f -->1.3507 / 1.3470 / 1.3444<!-- /fig -->``.
The name is the file, then keys; an object or list stands for its values in order, joined by `` / ``,
or by `` | `` in a table row (one cell each). A marker never starts a line: Markdown would read the
comment as a block of its own and split the paragraph. The format is a Python format spec, or ``min`` (seconds
as ``6 min 41 s``), ``pct`` (a fraction as a percentage, ``.1f``), ``K`` or ``M`` (thousands or
millions, ``75.9K``, ``1.09M``), ``GiB`` (bytes in GiB, ``.1f``).

    python docs/_tools/results.py write     # rewrite every quoted figure from the JSON files
    python docs/_tools/results.py check     # list the figures that disagree with them (tests/test_docs.py)
    python docs/_tools/results.py check --results mine   # a rerun's results files, within TOLERANCES

``check --results DIR`` compares the figures the pages quote with a rerun's results files in
``DIR`` (named as in ``docs/results/``; files it lacks are not compared), each number within the
tolerance :data:`TOLERANCES` gives its measure: how far a figure moves between machines and thread
counts. Timings and memory are the machine's, not the recipe's, and are not compared.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
#: How far a rerun's figure may differ from the quoted one, by the measure its path names, in the unit
#: the page prints (nats, bits per byte, percentage points, loops); ``None``: not compared (the
#: machine's, not the recipe's). A path naming none of these (parameter counts, memory estimates)
#: must agree exactly. Losses move by up to 0.005 nats between one thread and two
#: (docs/getting-started.md), exact match by a few points.
TOLERANCES: dict[str, float | None] = {
    "loss": 0.01, "gain_k1_to_K": 0.01, "bpb": 0.015, "exact": 5.0, "mean_loops": 0.25,
    "cpu_s": None, "wall_s": None, "max_rss_gb": None,
}  # fmt: skip

MARKER = re.compile(r"<!-- fig (?P<path>\S+)(?: (?P<spec>\S+))? -->(?P<text>.*?)<!-- /fig -->")


def pages() -> list[Path]:
    """README.md and every page of the site."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def lookup(path: str, cache: dict[str, Any]) -> Any:
    """The value at ``file.key.key...`` of ``docs/results/``.

    Raises:
        KeyError: No such file or key, naming the path.
    """
    name, *keys = path.split(".")
    if name not in cache:
        file = RESULTS / f"{name}.json"
        if not file.is_file():
            raise KeyError(f"{path}: no docs/results/{name}.json")
        cache[name] = json.loads(file.read_text())
    value = cache[name]
    for key in keys:
        try:
            value = value[int(key)] if isinstance(value, list) else value[key]
        except (KeyError, IndexError, ValueError):
            raise KeyError(f"{path}: docs/results/{name}.json has no {key!r} there") from None
    return value


def formatted(value: Any, spec: str) -> str:
    """One number (or text) in the format ``spec`` of a marker."""
    if isinstance(value, str):
        return value
    if spec == "min":
        minutes, seconds = divmod(round(value), 60)
        return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"
    if spec == "pct":
        return f"{100 * value:.1f}"
    if spec == "GiB":
        return f"{value / 2**30:.1f}"
    if spec in ("K", "M"):
        return f"{value / (1e3 if spec == 'K' else 1e6):.{1 if spec == 'K' else 2}f}{spec}"
    return format(value, spec)


def render(value: Any, spec: str, table: bool) -> str:
    """A marker's text: ``value``'s numbers in ``spec``, joined as in a table row or in prose."""
    values = list(value.values()) if isinstance(value, dict) else value if isinstance(value, list) else [value]
    if any(isinstance(v, (dict, list)) for v in values):
        raise ValueError("a quoted figure must name a number or an object or list of numbers")
    return (" | " if table else " / ").join(formatted(v, spec) for v in values)


def markers(text: str) -> Iterator[tuple[re.Match, bool]]:
    """Each figure marker of a page, and whether it stands in a table row."""
    for match in MARKER.finditer(text):
        line = text[text.rfind("\n", 0, match.start()) + 1 :]
        yield match, line.lstrip().startswith("|")


def sync(write: bool) -> list[str]:
    """Compare (or, with ``write``, rewrite) every quoted figure with the JSON files; the disagreements."""
    cache: dict[str, Any] = {}
    wrong = []
    for page in pages():
        text = page.read_text()
        out, last = [], 0
        for match, table in markers(text):
            expected = render(lookup(match["path"], cache), match["spec"] or "", table)
            if match["text"] != expected:
                wrong.append(f"{page.relative_to(ROOT)}: {match['path']} quotes {match['text']!r}, the results give {expected!r}")
            out.append(text[last : match.start("text")] + expected)
            last = match.end("text")
        if write and wrong:
            page.write_text("".join(out) + text[last:])
    return wrong


def _numbers(text: str) -> list[float]:
    return [float(n) for n in re.findall(r"-?\d+(?:\.\d+)?", text)]


def compare(results_dir: str) -> list[str]:
    """The quoted figures that a rerun's results files in ``results_dir`` miss by more than :data:`TOLERANCES`."""
    cache: dict[str, Any] = {}
    wrong = []
    for page in pages():
        for match, table in markers(page.read_text()):
            name, spec = match["path"].split(".")[0], match["spec"] or ""
            file = Path(results_dir) / f"{name}.json"
            tolerance = next((TOLERANCES[key] for key in match["path"].split(".") if key in TOLERANCES), 0.0)
            if not file.is_file() or tolerance is None:
                continue
            if name not in cache:
                cache[name] = json.loads(file.read_text())
            try:
                rerun = render(lookup(match["path"], {name: cache[name]}), spec, table)
            except KeyError:
                wrong.append(f"{page.relative_to(ROOT)}: {match['path']}: {file} has no such figure")
                continue
            quoted, got = _numbers(match["text"]), _numbers(rerun)
            if len(quoted) != len(got) or any(abs(a - b) > tolerance + 1e-9 for a, b in zip(quoted, got)):
                wrong.append(
                    f"{page.relative_to(ROOT)}: {match['path']} quotes {match['text']!r}, the rerun gives {rerun!r} "
                    f"(tolerance {tolerance:g})"
                )
    return wrong


def run_about(config: list[str] | None, about: str) -> str:
    """How a run was made: its command, threads and CPUs (this shell's, where the run was made), and ``about``."""
    import torch

    threads = os.environ.get("OMP_NUM_THREADS")
    command = "elr fit" + "".join(f" --config {c}" for c in config or [])
    made = f"OMP_NUM_THREADS={threads}" if threads else f"OMP_NUM_THREADS unset (torch's {torch.get_num_threads()} threads)"
    return "; ".join(filter(None, [f"{made} {command}", f"{os.cpu_count()} CPU cores", about]))


def read_scalars(run_dir: str) -> dict[str, dict[str, dict[str, float]]]:
    """``{step: {"loss": {k: value}, "bpb": {k: value}}}`` of a run's TensorBoard validations (steps counted from 1)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    events.Reload()
    found: dict[str, dict[str, dict[str, float]]] = {}
    for tag in events.Tags()["scalars"]:
        match = re.fullmatch(r"val/(loss|bpb)_k(\d+)", tag)
        if match:
            for event in events.Scalars(tag):
                found.setdefault(str(event.step + 1), {}).setdefault(match[1], {})[match[2]] = round(event.value, 6)
    if not found:
        raise SystemExit(f"{run_dir}: no val/loss_k* scalars; give the folder of an elr fit run's event file")
    ordered = {step: found[step] for step in sorted(found, key=int)}
    for step in ordered.values():
        for metric in step.values():
            metric.update(sorted(metric.items(), key=lambda kv: int(kv[0])))
    return ordered


def _update(out: str, entries: dict[str, Any], drop: tuple[str, ...] = ()) -> None:
    path = Path(out)
    data = json.loads(path.read_text()) if path.is_file() else {}
    for key in drop:
        data.pop(key, None)
    data.update(entries)
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {out}: {', '.join(entries)}")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="results.py", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    fit = commands.add_parser("fit", help="a run's validations (TensorBoard) into a results file")
    fit.add_argument("run_dir")
    fit.add_argument("out")
    fit.add_argument("--config", action="append", help="the run's config: adds its parameter count (elr cost)")
    fit.add_argument("--cpu_s", type=float, help="CPU seconds of the run (e.g. /usr/bin/time's user time)")
    fit.add_argument("--wall_s", type=float, help="wall-clock seconds of the run")
    fit.add_argument("--max_rss_gb", type=float, help="peak resident memory of the run, GB (/usr/bin/time -v)")
    fit.add_argument("--about", default="", help="more on how the run was made (the machine); the command, threads "
                     "and CPUs are written anyway")
    evaluate = commands.add_parser("eval", help="an elr eval summary.json (or a bench/ script's JSON) into a results file")
    evaluate.add_argument("summary")
    evaluate.add_argument("out")
    evaluate.add_argument("--key", default="eval")
    ablate = commands.add_parser("ablate", help="an elr ablate results.json into a results file, by run")
    ablate.add_argument("results")
    ablate.add_argument("out")
    ablate.add_argument("--key", default="ablate")
    commands.add_parser("write", help="rewrite the quoted figures of the pages from the results")
    check = commands.add_parser("check", help="list the quoted figures that disagree with the results")
    check.add_argument("--results", help="a folder of a rerun's results files: compare within TOLERANCES")
    args = parser.parse_args(argv)
    if args.command == "fit":
        validations = read_scalars(args.run_dir)
        last = validations[list(validations)[-1]]["loss"]
        entries: dict[str, Any] = {
            "about": run_about(args.config, args.about),
            "validations": validations,
            "gain_k1_to_K": round(last["1"] - last[max(last, key=int)], 6),  # the last validation's
        }
        if args.config:
            from elr_lightning.estimate.cost import cost_report

            entries["parameters"] = cost_report(args.config)["parameters"]["total"]
        measured = (("cpu_s", args.cpu_s), ("wall_s", args.wall_s), ("max_rss_gb", args.max_rss_gb))
        entries.update({k: v for k, v in measured if v is not None})
        _update(args.out, entries, drop=tuple(k for k, _ in measured))  # an earlier run's timings never stay
    elif args.command == "eval":
        _update(args.out, {args.key: json.loads(Path(args.summary).read_text())})
    elif args.command == "ablate":
        runs = json.loads(Path(args.results).read_text())["runs"]
        keep = ("steps", "loss", "bpb", "seconds")
        _update(args.out, {args.key: {f"{run['arm']}-s{run['seed']}": {k: run[k] for k in keep} for run in runs}})
    elif getattr(args, "results", None):
        wrong = compare(args.results)
        print("\n".join(wrong) or f"every quoted figure agrees with {args.results} within its tolerance")
        if wrong:
            sys.exit(1)
    else:
        wrong = sync(write=args.command == "write")
        print("\n".join(wrong) or "every quoted figure agrees with docs/results/")
        if wrong and args.command == "check":
            sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
