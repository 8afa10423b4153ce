"""The estimate's cache of traced steps: a second run reads what the first traced, and never a step of another run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch

from elr_lightning.cli import main
from elr_lightning.estimate import cache as estimate_cache
from elr_lightning.estimate import memory as estimate_memory
from elr_lightning.estimate import report as estimate_report
from elr_lightning.estimate.cache import TraceCache, default_cache_dir
from elr_lightning.estimate.fit import log_fit_estimate
from elr_lightning.estimate.memory import Setting, StepMemory, Target
from elr_lightning.estimate.report import format_memory_report, memory_report
from elr_lightning.lightning_cli import merged_config
from elr_lightning.module import ELRModule

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "config" / "quickstart.yaml")
COMMON = dict(micro_batch=4, seq_len=8, loops=[1, 3], modes=["none"], search=False, device_memory="1GB")

pytestmark = pytest.mark.usefixtures("one_thread")


def _no_tracing(*args: object, **kwargs: object) -> None:
    raise AssertionError("a step was traced although the cache holds it")


def test_a_second_run_reads_every_step_and_gives_the_same_report(tmp_path: Path, monkeypatch) -> None:
    first = memory_report(QUICKSTART, cache_dir=tmp_path, **COMMON)
    assert first["cached"] == [] and first["cache"] == {"directory": str(tmp_path), "write_error": None}
    assert len(list(tmp_path.rglob("*.json"))) == 2  # k = 1 and 3 (the configured step: k = K = 3, none)
    monkeypatch.setattr(estimate_report, "fake_training", _no_tracing)
    second = memory_report(QUICKSTART, cache_dir=tmp_path, **COMMON)
    assert second["rows"] == first["rows"] and second["verdict"] == first["verdict"]
    assert second["per_k_verdict"] == first["per_k_verdict"] and len(second["cached"]) == 2
    assert "2 step(s) read from the cache" in format_memory_report(second)
    assert not list(tmp_path.rglob("*.tmp"))


def test_the_micro_batch_search_is_cached_too(tmp_path: Path, monkeypatch) -> None:
    options = {**COMMON, "search": True, "loops": [3]}
    first = memory_report(QUICKSTART, cache_dir=tmp_path, **options)
    monkeypatch.setattr(estimate_report, "fake_training", _no_tracing)
    second = memory_report(QUICKSTART, cache_dir=tmp_path, **options)
    assert second["largest_micro_batch"] == first["largest_micro_batch"] is not None
    assert second["per_k"] == first["per_k"]


@pytest.mark.parametrize(
    "change",
    [{"precision": "bf16-mixed"}, {"gradient_clip_val": 1.0}, {"accumulate_grad_batches": 2}, {"world_size": 2}],
)
def test_another_target_misses_the_cache(tmp_path: Path, change: dict) -> None:
    model = merged_config(QUICKSTART)["model"]
    setting = Setting(2, "none", None, 4, 8)
    phases = {"step": StepMemory(1, 2, 3, 4), "update": StepMemory(1, 2, 3, 0)}
    TraceCache(tmp_path, model, True, Target()).put(setting, phases)
    assert TraceCache(tmp_path, model, True, Target()).get(setting) == phases
    assert TraceCache(tmp_path, model, True, dataclasses.replace(Target(), **change)).get(setting) is None
    assert TraceCache(tmp_path, model, False, Target()).get(setting) is None  # conditioning off
    assert TraceCache(tmp_path, model, True, Target()).get(dataclasses.replace(setting, micro_batch=2)) is None
    wider = json.loads(json.dumps(model))
    wider["init_args"]["arch"]["d_model"] *= 2
    assert TraceCache(tmp_path, wider, True, Target()).get(setting) is None


def test_other_code_misses_the_cache(tmp_path: Path, monkeypatch) -> None:
    model = merged_config(QUICKSTART)["model"]
    setting = Setting(1)
    TraceCache(tmp_path, model, True, Target()).put(setting, {"step": StepMemory(1, 1, 1, 1)})
    monkeypatch.setattr(estimate_cache, "code_digest", lambda: "0" * 64)
    assert TraceCache(tmp_path, model, True, Target()).get(setting) is None


@pytest.mark.parametrize(
    "content",
    ["{not json", "[]", '{"phases": {"step": {"params": 1}}}', '{"phases": {"step": {"params": -1, "grads": 0, '
     '"optimizer": 0, "activations": 0, "host": 0, "sharded": 0}}}', '{"phases": {"step": {"params": 1.5, "grads": 0, '
     '"optimizer": 0, "activations": 0, "host": 0, "sharded": 0}}}'],
)
def test_a_broken_entry_is_traced_again_and_replaced(tmp_path: Path, content: str) -> None:
    options = {**COMMON, "loops": [3]}
    good = memory_report(QUICKSTART, **options)
    memory_report(QUICKSTART, cache_dir=tmp_path, **options)
    entries = list(tmp_path.rglob("*.json"))
    for entry in entries:
        entry.write_text(content)
    again = memory_report(QUICKSTART, cache_dir=tmp_path, **options)
    assert again["cached"] == [] and again["rows"] == good["rows"]
    assert all(json.loads(entry.read_text())["phases"] for entry in entries)


def test_a_file_in_the_caches_place_says_so_and_the_estimate_stands(tmp_path: Path) -> None:
    blocker = tmp_path / "estimate"
    blocker.write_text("a user's file")
    report = memory_report(QUICKSTART, cache_dir=blocker, **{**COMMON, "loops": [3]})
    assert report["cache"]["write_error"] and report["rows"][0]["peak"] > 0
    assert blocker.read_text() == "a user's file"  # never overwritten


def test_the_default_folder_follows_the_environment(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ELR_ESTIMATE_CACHE", str(tmp_path / "here"))
    assert default_cache_dir() == tmp_path / "here"
    monkeypatch.delenv("ELR_ESTIMATE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "elr-lightning" / "estimate"


def test_the_command_caches_unless_told_not_to(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("ELR_ESTIMATE_CACHE", str(tmp_path))
    argv = ["estimate", "--config", QUICKSTART, "--micro_batch", "4", "--seq_len", "8", "--loops", "3", "--modes", "none",
            "--no_search", "--workers", "1", "--device_memory", "1GB"]  # fmt: skip
    main(argv)
    assert len(list(tmp_path.rglob("*.json"))) == 1
    main(argv)
    assert "1 step(s) read from the cache" in capsys.readouterr().out
    main([*argv, "--no_cache"])
    assert "read from the cache" not in capsys.readouterr().out
    other = tmp_path / "other"
    main([*argv, "--cache_dir", str(other)])
    assert len(list(other.rglob("*.json"))) == 1


def test_a_restarted_fit_reads_its_memory_check_from_the_cache(tmp_path: Path, monkeypatch, capsys) -> None:
    config = merged_config(QUICKSTART)
    config["model"]["init_args"]["arch"]["d_model"] = 64
    config["model"]["init_args"]["virtual_ranks"] = 1
    module = ELRModule(**config["model"]["init_args"])
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    data = SimpleNamespace(batch_size=2, seq_len=16)
    first = log_fit_estimate(trainer, module, data, total_memory=lambda device: 2**40, cache_dir=tmp_path)
    assert "traced in" in capsys.readouterr().err
    monkeypatch.setattr(estimate_memory, "fake_training", _no_tracing)
    second = log_fit_estimate(trainer, module, data, total_memory=lambda device: 2**40, cache_dir=tmp_path)
    assert second == first and "read from the cache in" in capsys.readouterr().err
    assert torch.device("cpu") == next(module.parameters()).device
