"""``elr serve`` refuses a bad checkpoint with ``elr generate``'s one line, before any worker starts."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT

pytest.importorskip("litserve")

import _malicious as hostile  # noqa: E402
from _forked_cli import run_commands  # noqa: E402

ROOT = REPO_ROOT


def _bad_checkpoints(root: Path) -> dict[str, Path]:
    good = root / "good.ckpt"
    raw = hostile.good_checkpoint(good)
    data = good.read_bytes()
    (root / "truncated.ckpt").write_bytes(data[: len(data) // 2])
    (root / "random.ckpt").write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0))
                                       .to(torch.uint8).numpy().tobytes())  # fmt: skip
    raw["hyper_parameters"]["update"] = {"class_path": "elr_lightning.sampling.FixedLoops", "init_args": {"k": 1}}
    torch.save(raw, root / "not_an_update.ckpt")
    return {
        "truncated": root / "truncated.ckpt",
        "random bytes": root / "random.ckpt",
        "refused class_path": hostile.untrusted_plugin(root / "plugin.ckpt"),
        "plug-in of the wrong seam": root / "not_an_update.ckpt",
        "pickled object": hostile.pickled_payload(root / "pickle.ckpt"),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess, ...]]:
    """``elr generate`` and ``elr serve`` on each bad checkpoint, each in its own process (forked from one that imported
    the CLI once), the hostile module importable from the checkpoints' folder."""
    root = tmp_path_factory.mktemp("bad_serve")
    hostile.write_evil_module(root)
    bad = _bad_checkpoints(root)
    keys, jobs = [], []
    for name, path in bad.items():
        for command, args in (("generate", ["generate", "--ckpt_path", str(path), "--prompt", "ab"]),
                              ("serve", ["serve", "--ckpt_path", str(path), "--port", str(_free_port())])):  # fmt: skip
            keys.append((name, command))
            jobs.append({"args": args, "cwd": root, "env": {}})
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{root}", "OMP_NUM_THREADS": "1",
           hostile.MARKER_ENV: str(root / "MARKER")}  # fmt: skip
    for name in ("ELR_DEBUG", "ELR_TRUST_MODULES"):
        env.pop(name, None)
    done = dict(zip(keys, run_commands(jobs, env)))
    assert not (root / "MARKER").exists()
    return {name: (done[name, "generate"], done[name, "serve"]) for name in bad}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["truncated", "random bytes", "refused class_path", "plug-in of the wrong seam", "pickled object"]
)
def test_serve_refuses_a_bad_checkpoint_with_the_line_generate_gives(
    name: str, results: dict[str, tuple[subprocess.CompletedProcess, ...]]
) -> None:
    generate, serve = results[name]
    lines = {}
    for label, proc in (("generate", generate), ("serve", serve)):
        said = [line for line in proc.stderr.splitlines() if line.startswith("elr")]
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert len(said) == 1 and "looks like a bug" not in proc.stderr, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        lines[label] = said[0]
    assert lines["serve"].removeprefix("elr serve: ") == lines["generate"].removeprefix("elr generate: ")
    assert len(serve.stderr.strip().splitlines()) <= 2, serve.stderr  # no worker started to say anything
