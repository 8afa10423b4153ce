"""The README's first commands, run as written in a fresh virtual environment on a copy of the repository.

The commands are read from README.md's first ``bash`` block, so the test follows the README: a
changed set-up line, config or checkpoint path is what runs here. The block runs whole in ``bash -e``
from the copy's root, without this interpreter's ``PYTHONPATH`` or virtual environment: the set-up
line creates ``.venv`` and installs what it names (pip's cache and the machine's pip configuration
serve the wheels, as for a user), ``elr fit`` trains the depth quickstart (about 2.5 min of CPU
time), and ``elr eval`` writes the table and the heatmap the README shows.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: How far the README's exact-match figures may move on another machine or thread count, in points:
#: the same as ``docs/_tools/results.py check --tolerance`` states for them (docs/depth.md).
EXACT_TOLERANCE_POINTS = 5.0


def readme_block() -> str:
    """README.md's first ``bash`` block: the set-up line and the quickstart's commands."""
    found = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert found, "README.md has no bash block"
    return found.group(1)


def _copy_repository(dest: Path) -> None:
    """The repository's files as a clone has them: tracked and untracked-but-not-ignored (no .venv, runs, ...)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=False)  # fmt: skip
    if listed.returncode != 0:  # not a git checkout: everything but what .gitignore names
        ignored = [p.strip().rstrip("/") for p in (ROOT / ".gitignore").read_text().splitlines() if p.strip()]
        shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(".git", *ignored))
        return
    for name in filter(None, listed.stdout.decode().split("\0")):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def test_readme_block_is_the_setup_line_then_fit_then_eval():
    """What the slow test runs: checked fast, so a README edit that drops a step fails at once."""
    lines = [line.split(" #", 1)[0].strip() for line in readme_block().splitlines() if line.strip()]
    assert lines[0].startswith("python3 -m venv .venv && . .venv/bin/activate && pip install ")
    assert lines[0].endswith(" -e ."), "the set-up line installs the checkout itself"
    commands = [[word for word in line.split() if not re.fullmatch(r"[A-Z_]+=\S*", word)][:2] for line in lines[1:]]
    assert commands == [["elr", "fit"], ["elr", "eval"]]
    assert "--ckpt_path runs/" in lines[2]


@pytest.mark.slow
def test_readme_commands_run_as_written_in_a_fresh_environment(tmp_path):
    copy = tmp_path / "elr-lightning"
    copy.mkdir()
    _copy_repository(copy)
    script = "set -euo pipefail\n" + readme_block()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if "venv" not in p)
    done = subprocess.run(["bash", "-c", script], cwd=copy, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    # elr eval said where it wrote the table and the picture the README shows, and they are there
    wrote = re.search(r"elr eval: wrote the table to (\S+) and the picture to (\S+)", done.stderr)
    assert wrote, done.stderr[-3000:]
    table, picture = copy / wrote[1], copy / wrote[2]
    assert picture.suffix == ".png" and picture.stat().st_size > 10_000
    # the package ran from the fresh environment, not from this interpreter's
    assert (copy / ".venv").is_dir() and "exact match (%)" in done.stdout
    # the figures the README quotes, within the tolerance the docs state
    summary = json.loads(table.read_text())
    quoted = json.loads((ROOT / "docs" / "results" / "quickstart_depth.json").read_text())["eval"]["exact"]
    moved = {
        (depth, k): (round(100 * summary["exact"][depth][k], 1), round(100 * value, 1))
        for depth, row in quoted.items() for k, value in row.items()
        if abs(100 * summary["exact"][depth][k] - 100 * value) > EXACT_TOLERANCE_POINTS
    }  # fmt: skip
    assert not moved, f"(difficulty, k): (this run, quoted) beyond {EXACT_TOLERANCE_POINTS} points: {moved}"
