"""``bench/gpu.py`` runs end to end on CPU (``--device cpu --tiny``) and ``bench/gpu.sh`` refuses without CUDA.

The CPU run takes every code path the CUDA run takes except the two that need CUDA (allocator peaks,
the sync debug mode), which must say so in the JSON instead of giving figures.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from elr_lightning.mixers import delta_rule
from test_fla_dispatch import fake_fla

ROOT = Path(__file__).resolve().parents[1]


def load_gpu_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "bench" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def env_without_cuda() -> dict[str, str]:
    """This checkout first on the path, one thread, and no CUDA device visible even where one exists."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.slow
def test_cpu_smoke_run_writes_every_section(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    args = ["--device", "cpu", "--tiny", "--compile_backend", "aot_eager", "--out", str(out)]
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), *args], cwd=tmp_path,
                         env=env_without_cuda(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result) == {"config", "device", "torch", "sync_check", "train", "memory", "decode", "fla",
                           "conditioning", "moe_dispatch", "wall_s"}
    for mode in ("eager", "compiled"):
        assert positive(result["conditioning"][mode]["median"]), result["conditioning"]
    assert result["moe_dispatch"]["max_rel_diff"] < 0.05 and positive(result["moe_dispatch"]["speedup"])
    loops = result["config"]["max_loops"]
    assert loops == 2 and result["config"]["d_model"] == 64 and result["device"].startswith("cpu")
    assert [(r["compile_layers"], r["loops"]) for r in result["train"]] == [
        (compiled, k) for compiled in (False, True) for k in range(1, loops + 1)
    ]
    for row in result["train"]:
        assert all(positive(row[key]) for key in ("step_s", "tokens_per_s", "model_tflops")), row
        assert row["mfu"] is None  # no peak known for a CPU: no made-up utilisation
    assert [(r["policy"], r["loops"]) for r in result["decode"]] == [
        (policy, k) for policy in ("per_loop", "last_loop") for k in range(1, loops + 1)
    ]
    assert all(positive(row["decode_tokens_per_s"]) for row in result["decode"])
    assert "max_memory_allocated" in result["memory"]["not_measured"]
    assert "set_sync_debug_mode" in result["sync_check"]["not_measured"]
    assert result["fla"] == {"not_measured": "the tensors are not on CUDA"}
    assert positive(result["wall_s"])
    assert "memory not measured" in run.stdout and "host syncs not measured" in run.stdout


def test_gpu_sh_refuses_without_cuda_in_one_line() -> None:
    run = subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh")], env=env_without_cuda(),
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 2
    assert run.stderr.strip().count("\n") == 0 and "no CUDA device visible to torch" in run.stderr


def test_tiny_preset_yields_to_explicit_flags_and_cuda_is_the_default() -> None:
    gpu = load_gpu_bench()
    full = gpu.parse_args([])
    assert (full.device, full.d_model, full.n_heads, full.vocab, full.layers) == ("cuda", 1152, 18, 50304, [2, 4, 2])
    tiny = gpu.parse_args(["--tiny", "--d_model", "96", "--layers", "2", "2", "2"])
    assert (tiny.d_model, tiny.layers, tiny.n_heads, tiny.vocab, tiny.seq_len) == (96, [2, 2, 2], 2, 256, 64)


def test_fla_section_compares_every_output_and_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA-only section, run on CPU through the fake kernel that enforces fla's input asserts."""
    calls: list[dict] = []
    monkeypatch.setattr(delta_rule, "_fla_kernel", lambda: fake_fla(calls))
    monkeypatch.setattr(delta_rule, "FLA_DEVICE_TYPES", ("cuda", "cpu"))
    gpu = load_gpu_bench()
    row = gpu.fla_check(gpu.parse_args(["--device", "cpu"]))
    assert len(calls) == 3 and all(c["dtype"] == torch.bfloat16 and c["state"] for c in calls)
    assert set(row["max_rel_diff"]) == {"o", "state", "dq", "dk", "dv", "dg", "dbeta", "dstate"}
    # the fake is the PyTorch path on beta rounded to bf16, as fla receives it: close, not equal
    assert all(0 <= d < 0.05 for d in row["max_rel_diff"].values()), row
    assert positive(row["fla_s"]) and positive(row["torch_s"]) and positive(row["speedup"])
