"""Round 3 of the checkpoint-safety tests: URLs, shards outside their folder, and sizes that cost memory before a check.

Each hostile artifact (:mod:`_malicious`) is small on disk and would, unchecked, run code (a pickle
served over HTTP), read or block outside its folder (a DCP index naming an absolute path, ``..``,
a link or a FIFO), or allocate gigabytes (a loop budget of 30 million, a 50M-token vocabulary, a
DCP index declaring a 4,000,000 x 128 tensor, a deflated 4 GiB zip record, saved difficulties of
300,000). Every entry point that opens it runs in a subprocess under ``RLIMIT_AS`` = 1 GB and a
30 s timeout, and must end in one line naming the field or file, with no marker file left behind.
"""

from __future__ import annotations

import http.server
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import _malicious as hostile
from test_cli_errors import TINY_CONFIG
from elr_lightning.checkpoints.schema import CheckpointConfigError
from elr_lightning.inference.generate import load_model
from elr_lightning.checkpoints.safe_load import OversizedCheckpointError
from conftest import REPO_ROOT

ROOT = REPO_ROOT

#: The address-space bound of every run, and its time bound.
MEMORY_BOUND = 1 << 30
TIME_BOUND_S = 30

#: What each artifact's refusal says (a part of the one line).
REFUSED = {
    "url_http": "is a URL, and elr-lightning opens checkpoints from local paths only",
    "url_file": "is a URL, and elr-lightning opens checkpoints from local paths only",
    "dcp_absolute": "stores 'state_dict.model.embed.weight' in '/",
    "dcp_dotdot": "which is not a file name inside the folder",
    "dcp_symlink": "in 'link.distcp', which is a link",
    "dcp_fifo": "in 'pipe.distcp', which is not a regular file",
    "dcp_huge": "declares 'state_dict.model.embed.weight' as [4000000, 128] torch.float32 (2048000000 bytes), but",
    "meta_link": "its meta.pt is a link",
    "loops": "arch.max_loops=30000000 exceeds the maximum 1024",
    "vocab": "model.embed.weight (256, 16) in the file, (50000000, 16) by hyper_parameters",
    "seq": "arch.max_seq_len=1099511627776 exceeds the maximum 1048576",
    "layers": "declares 30000001 layers (n_in + n_rec + n_out), but the checkpoint holds 20 tensors",
    "val_loops": "val_loops holds 30000000, over the maximum loop count 1024",
    "instantiator": "hyper_parameters._instantiator: ['x'] is not Lightning's instantiator",
    "bomb": "is compressed (4293918720 bytes from",
    "difficulties": "datamodule_hyper_parameters.eval_difficulties=300000 is out of range",
    "repeated": "state_dict.model.embed.weight declares [50000000, 16] (3200000000 bytes) over 4 bytes of data",
    "dcp_overlap": "(its entries overlap)",
    "fifo_ckpt": "is not a regular file (a FIFO, device or socket)",
}
FOLDERS = ("dcp_absolute", "dcp_dotdot", "dcp_symlink", "dcp_fifo", "dcp_huge", "dcp_overlap", "meta_link")


class _Payload(http.server.BaseHTTPRequestHandler):
    """Serves the pickled payload at every path and counts the requests."""

    body = b""
    requests = 0

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        type(self).requests += 1
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: Any) -> None:
        """Quiet."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A local HTTP server on 127.0.0.1 serving a checkpoint whose unpickling creates the marker file."""
    _Payload.body = hostile.pickled_payload(tmp_path_factory.mktemp("served") / "e.ckpt").read_bytes()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Payload)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/e.ckpt"
    httpd.shutdown()


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, server: str) -> dict[str, Any]:
    """Every artifact, in one folder with an ``elr fit`` config and a victim file outside every run folder."""
    root = tmp_path_factory.mktemp("sizes")
    (root / "tiny.yaml").write_text(TINY_CONFIG)
    (root / "corpus.txt").write_text("".join(f"line {i}: {i * 7919 % 1000}\n" for i in range(300)))
    victim = root / "victim.txt"
    victim.write_text("a file of the user's\n")
    return {
        "root": root,
        "victim": victim,
        "url_http": server,
        "url_file": hostile.pickled_payload(root / "local.ckpt").as_uri(),
        **{f"dcp_{where}": hostile.sharded_storage_at(root / f"dcp_{where}", where, victim)
           for where in ("absolute", "dotdot", "symlink", "fifo")},  # fmt: skip
        "dcp_huge": hostile.sharded_huge_tensor(root / "dcp_huge"),
        "meta_link": hostile.linked_meta(root / "meta_link", victim),
        "loops": hostile.oversized(root / "loops.ckpt", max_loops=30_000_000),
        "vocab": hostile.oversized(root / "vocab.ckpt", vocab_size=50_000_000),
        "seq": hostile.oversized(root / "seq.ckpt", max_seq_len=1 << 40),
        "layers": hostile.oversized(root / "layers.ckpt", n_rec=30_000_000),
        "val_loops": hostile.with_hparams(root / "val_loops.ckpt", val_loops=[30_000_000]),
        "instantiator": hostile.with_hparams(root / "instantiator.ckpt", _instantiator=["x"]),
        "bomb": hostile.deflated_member(root / "bomb.ckpt"),
        "difficulties": hostile.depth_checkpoint(root / "difficulties.ckpt", eval_difficulties=[300000]),
        "repeated": hostile.repeated_view(root / "repeated.ckpt"),
        "dcp_overlap": hostile.sharded_overlapping(root / "dcp_overlap"),
        "fifo_ckpt": hostile.fifo_checkpoint(root / "fifo.ckpt"),
    }


def _bounded() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BOUND, MEMORY_BOUND))


def _commands(path: str, config: str) -> dict[str, list[str]]:
    return {
        "generate": ["generate", "--ckpt_path", path, "--prompt", "1", "--max_new_tokens", "2"],
        "eval": ["eval", "--ckpt_path", path, "--loops", "1", "--limit", "1", "--output_dir", "evalout"],
        "export": ["export", "--ckpt_path", path, "--out", "exp"],
        "serve": ["serve", "--ckpt_path", path, "--port", "18990"],
        "validate": ["validate", "--config", config, "--trainer.callbacks", "[]", "--ckpt_path", path],
        "fit": ["fit", "--config", config, "--ckpt_path", path],
    }


#: Every artifact through ``elr generate``; each also through the other commands that open it.
COMMANDS = {
    **{name: ["generate"] for name in REFUSED if name != "difficulties"},
    "url_http": ["generate", "validate", "fit", "serve"],
    "url_file": ["generate", "validate"],
    "bomb": ["generate", "validate", "export"],
    "dcp_fifo": ["generate", "validate", "serve"],
    "dcp_huge": ["generate", "fit"],
    "dcp_symlink": ["generate", "eval"],
    "dcp_absolute": ["generate", "export"],
    "loops": ["generate", "eval"],
    "vocab": ["generate", "export"],
    "seq": ["generate", "serve"],
    "difficulties": ["eval"],
    "repeated": ["generate", "export"],
    "fifo_ckpt": ["generate", "validate", "eval"],
}
#: The Python loaders each artifact goes through (a folder is no file for ``load_from_checkpoint``).
PYTHON = {"load_model", "load_model(meta=True)", "verify_checkpoint_path", "ELRModule.load_from_checkpoint",
          "Trainer.validate, no callbacks"}  # fmt: skip
#: Artifacts that are data to a loader that does not build the checkpoint's model: the file check
#: passes them, and a trainer given its own model refuses them by comparing architectures instead.
NOT_ITS_CHECK = {
    "verify_checkpoint_path": {"loops", "vocab", "seq", "layers", "val_loops", "instantiator", "repeated"},
    "Trainer.validate, no callbacks": {"loops", "vocab", "seq", "layers", "val_loops", "instantiator", "repeated"},
}
#: The artifacts, in the groups that share one bounded process.
GROUPS = {
    "paths": ["url_http", "url_file", "fifo_ckpt"],
    "folders": list(FOLDERS),
    "sizes": ["loops", "vocab", "seq", "layers"],
    "fields": ["val_loops", "instantiator", "bomb", "difficulties", "repeated"],
}


def _specs(files: dict[str, Any], names: list[str]) -> list[dict[str, Any]]:
    runs = files["root"] / "runs"
    specs = []
    for name in names:
        path = str(files[name])
        for command in COMMANDS[name]:
            args = _commands(path, str(files["root"] / "tiny.yaml"))[command]
            specs.append({"name": f"elr {command} {name}", "cwd": str(runs / f"{command}-{name}"), "kind": "cli",
                          "args": args})  # fmt: skip
        if name == "difficulties":
            continue  # only elr eval reads a data module's saved fields
        for loader in sorted(PYTHON - ({"ELRModule.load_from_checkpoint", "Trainer.validate, no callbacks"}
                                       if name in FOLDERS else set())):  # fmt: skip
            specs.append({"name": f"{loader} {name}", "cwd": str(runs / f"python-{name}"), "kind": "python",
                          "loader": loader, "args": [path]})  # fmt: skip
    return specs


@pytest.mark.slow
@pytest.mark.parametrize("group", list(GROUPS))
def test_every_entry_point_refuses_a_hostile_size_or_place_in_one_line_under_the_bounds(
    group: str, files: dict[str, Any]
) -> None:
    """Each artifact of ``group`` through every command and Python loader that opens it, in one process
    under RLIMIT_AS = 1 GB, each run under a 30 s alarm: one line naming the field or file, nothing run or fetched."""
    requests = _Payload.requests
    specs = _specs(files, GROUPS[group])
    spec_file = files["root"] / f"{group}.json"
    spec_file.write_text(json.dumps(specs))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2"}
    for variable in ("ELR_DEBUG", "ELR_TRUST_MODULES"):
        env.pop(variable, None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "_bounded_runner.py"), str(spec_file)], cwd=files["root"], env=env,
        capture_output=True, text=True, timeout=TIME_BOUND_S * (len(specs) + 1), preexec_fn=_bounded,
    )  # fmt: skip
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and len(results) == len(specs), proc.stderr[-3000:]
    for spec, result in zip(specs, results):
        name = spec["name"].split()[-1]
        assert not Path(spec["cwd"], "MARKER").exists(), f"{spec['name']}: code from the file ran"
        if spec["kind"] == "python" and name in NOT_ITS_CHECK.get(spec["loader"], ()):
            continue
        assert result["status"] == "refused", result
        assert len(result["said"]) == 1 and not result["traceback"], result
        assert REFUSED[name] in result["said"][0], result
        assert "tmp" not in result["said"][0].replace(str(files["root"]), ""), result  # no temporary path
    assert _Payload.requests == requests, "a URL was fetched"
    assert files["victim"].read_text() == "a file of the user's\n"


# ---- sizes mutated at random, under an address-space bound in this process --------------------------


@contextmanager
def address_space_headroom(extra: int = MEMORY_BOUND) -> Iterator[None]:
    """Bound this process's address space to what it maps now plus ``extra`` bytes, inside the block."""
    mapped = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (min(mapped + extra, hard) if hard != resource.RLIM_INFINITY
                                            else mapped + extra, hard))  # fmt: skip
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


#: Size fields of ``arch`` and the hyperparameters, mutated to huge values.
SIZE_FIELDS = ["vocab_size", "d_model", "max_loops", "max_seq_len", "n_rec", "n_in", "d_ff", "n_heads", "head_size"]
HUGE = st.integers(min_value=2, max_value=1 << 40)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mutated")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the mapped size from /proc (Linux)")
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from([*SIZE_FIELDS, "val_loops", "difficulties", "index_rows", "repeated_rows"]), value=HUGE)
def test_a_checkpoint_with_mutated_sizes_is_refused_within_the_memory_bound(field: str, value: int, base: Path) -> None:
    """Any huge size is refused in one line before allocating: a real load under 1 GB of fresh address space.

    Sizes of ``arch`` and the hyperparameters, saved difficulties, a DCP index's shapes, and the rows
    of an embedding that repeats one value (its shape agreeing with ``arch``).
    """
    from elr_lightning.depth.evaluate import saved_difficulties

    for stale in base.iterdir():
        if stale.is_dir():
            shutil.rmtree(stale)
    if field in SIZE_FIELDS:
        path, load = hostile.oversized(base / "m.ckpt", **{field: value}), load_model
    elif field == "val_loops":
        path, load = hostile.with_hparams(base / "m.ckpt", val_loops=[1, value]), load_model
    elif field == "difficulties":
        path, load = hostile.depth_checkpoint(base / "m.ckpt", eval_difficulties=[value]), saved_difficulties
    elif field == "repeated_rows":
        path, load = hostile.repeated_view(base / "m.ckpt", rows=value), load_model
    else:
        path, load = hostile.sharded_huge_tensor(base / "index", rows=value, width=64), load_model
    try:
        with address_space_headroom():
            load(str(path))
    except (CheckpointConfigError, OversizedCheckpointError, ValueError) as err:
        message = str(err)
        assert "\n" not in message and len(message) < 1000
        assert "can't allocate memory" not in message and "DefaultCPUAllocator" not in message, message
    except MemoryError:
        pytest.fail(f"{field}={value} allocated past the bound before any check")
