"""`elr eval` of a depth-task checkpoint with the core install only, the install command every
"needs the X extra" message names, and the rule that `elr eval` never replaces earlier results unasked."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from elr_lightning import errors
from elr_lightning.cli import run
from conftest import REPO_ROOT

ROOT = REPO_ROOT

#: Makes lm-evaluation-harness unimportable in the interpreter it is on the path of, as on a core install.
NO_HARNESS = "import sys\nsys.modules['lm_eval'] = None\n"


class _Distribution:
    def __init__(self, direct_url: object) -> None:
        self.direct_url = direct_url

    def read_text(self, name: str) -> str | None:
        assert name == "direct_url.json"
        return None if self.direct_url is None else json.dumps(self.direct_url)


@pytest.mark.parametrize(
    ("direct_url", "where", "expected"),
    [
        (None, "checkout", 'pip install "elr-lightning[eval]"'),
        ({"url": "https://example.org/elr.whl", "archive_info": {}}, "checkout", 'pip install "elr-lightning[eval]"'),
        ({"url": "file:///CHECKOUT", "dir_info": {}}, "checkout", 'pip install "elr-lightning[eval]"'),
        ({"url": "file:///CHECKOUT", "dir_info": {"editable": True}}, "checkout", 'pip install -e ".[eval]"'),
        ({"url": "file:///CHECKOUT", "dir_info": {"editable": True}}, "elsewhere", 'pip install -e "CHECKOUT[eval]"'),
    ],
)
def test_install_command_fits_an_editable_checkout_or_the_registry(tmp_path, monkeypatch, direct_url, where, expected):
    checkout, elsewhere = tmp_path / "checkout", tmp_path / "elsewhere"
    checkout.mkdir()
    elsewhere.mkdir()
    if direct_url is not None and direct_url["url"].startswith("file:"):
        direct_url = {**direct_url, "url": checkout.as_uri()}
    monkeypatch.setattr("importlib.metadata.distribution", lambda name: _Distribution(direct_url))
    monkeypatch.chdir(checkout if where == "checkout" else elsewhere)
    assert errors.install_extra("eval") == expected.replace("CHECKOUT", str(checkout))


def test_every_install_message_uses_the_one_helper():
    """No string of the package but a docstring spells an install command: each message asks :func:`install_extra`."""
    spelled = []
    for path in sorted((ROOT / "elr_lightning").rglob("*.py")):
        if path.name == "errors.py":  # the helper itself
            continue
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
        }  # fmt: skip
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                if "pip install" in node.value:
                    spelled.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value}")
    assert not spelled, spelled


def _tiny_depth_checkpoint(tmp_path: Path) -> str:
    """Two steps of the shipped depth quickstart, shrunk, into ``tmp_path/ckpt/last.ckpt``."""
    config = yaml.safe_load((ROOT / "config" / "quickstart_depth.yaml").read_text())
    config["trainer"].update(
        max_steps=2, val_check_interval=2, enable_progress_bar=False, enable_model_summary=False, logger=False,
        default_root_dir=str(tmp_path / "runs"),
        callbacks=[{"class_path": "elr_lightning.callbacks.AtomicModelCheckpoint",
                    "init_args": {"dirpath": str(tmp_path / "ckpt"), "save_last": True}}],
    )  # fmt: skip
    config["model"]["init_args"]["arch"].update(d_model=16, n_heads=2, max_loops=2)
    config["model"]["init_args"]["sampler"]["init_args"]["max_loops"] = 2
    config["model"]["init_args"]["warmup_steps"] = 0
    config["data"]["init_args"].update(difficulty=2, batch_size=4, val_batches=1, eval_difficulties=[1, 2])
    path = tmp_path / "depth.yaml"
    path.write_text(yaml.safe_dump(config))
    run(["fit", "--config", str(path)])
    return str(tmp_path / "ckpt" / "last.ckpt")


def _elr(args: list[str], cwd: Path, shim: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shim), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    code = "import sys; from elr_lightning.cli import main; main(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


@pytest.mark.slow
def test_depth_eval_runs_without_the_harness_and_never_replaces_earlier_results(tmp_path):
    ckpt = _tiny_depth_checkpoint(tmp_path)
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(NO_HARNESS)
    args = ["eval", "--ckpt_path", ckpt, "--limit", "4", "--output_dir", "out"]

    first = _elr(args, tmp_path, shim)
    assert first.returncode == 0, first.stderr
    assert "exact match (%)" in first.stdout
    wrote = os.path.join("out", "summary.json"), os.path.join("out", "depth_heatmap.png")
    assert f"elr eval: wrote the table to {wrote[0]} and the picture to {wrote[1]}" in first.stderr
    assert (tmp_path / "out" / "depth_heatmap.png").stat().st_size > 0
    before = (tmp_path / "out" / "summary.json").read_bytes()

    again = _elr(args, tmp_path, shim)
    assert again.returncode == 1
    assert again.stderr.strip().splitlines()[-1] == (
        "elr eval: error: --output_dir 'out' already holds depth_heatmap.png, summary.json; choose a new folder, "
        "or add --overwrite to replace the earlier results"
    )
    assert (tmp_path / "out" / "summary.json").read_bytes() == before

    replaced = _elr([*args, "--overwrite"], tmp_path, shim)
    assert replaced.returncode == 0, replaced.stderr
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["task"] == "root"

    harness = _elr(["eval", "--ckpt_path", ckpt, "--tasks", "elr_local", "--output_dir", "other"], tmp_path, shim)
    assert harness.returncode == 1
    last = harness.stderr.strip().splitlines()[-1]
    assert last.startswith("elr eval: error: lm-evaluation-harness tasks need the eval extra; install it with pip install")
    assert last.endswith('[eval]"')
