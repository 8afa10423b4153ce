"""``elr eval``, the local tasks and the harness's own command line over an ELR checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from _bpe import stdlib_text  # noqa: E402
from conftest import REPO_ROOT, fit_two_steps  # noqa: E402
from elr_lightning.cli import main  # noqa: E402
from elr_lightning.conditioning import LoopConditioner  # noqa: E402
from elr_lightning.config import ModelConfig  # noqa: E402
from elr_lightning.data import TextDataModule, default_corpus_files, iter_documents  # noqa: E402
from elr_lightning.eval import TASKS_DIR, build_tasks  # noqa: E402
from elr_lightning.eval.command import format_table, summarize  # noqa: E402
from elr_lightning.loop_points import parse_loops, parse_points, parse_thresholds  # noqa: E402
from elr_lightning.eval.taskdata import heldout_text  # noqa: E402
from elr_lightning.module import ELRModule  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = REPO_ROOT
ARCH = ModelConfig(vocab_size=256, d_model=32, n_heads=2, n_in=1, n_rec=1, n_out=1, max_loops=4, max_seq_len=128)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two training steps on a little stdlib text with the byte tokenizer (saved in the checkpoint)."""
    root = tmp_path_factory.mktemp("eval_ckpt")
    corpus = root / "corpus.txt"
    corpus.write_text(stdlib_text(20_000), encoding="utf-8")
    data = TextDataModule(sources=[str(corpus)], seq_len=32, batch_size=4, cache_dir=str(root / "cache"))
    torch.manual_seed(0)
    module = ELRModule(arch=ARCH, conditioner=LoopConditioner(d_cond=8, rank=2), warmup_steps=0)
    path = fit_two_steps(module, data, root / "tiny.ckpt")
    return path


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tasks")
    build_tasks(str(folder), seed=0)
    return folder


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("seq_len", [64, 128, 256])
def test_heldout_text_lies_in_the_validation_windows(seq_len: int) -> None:
    corpus = "\n".join(iter_documents(default_corpus_files())).encode("utf-8")
    held = heldout_text(0.01).encode("utf-8")
    assert corpus.endswith(held) and 0 < len(held) <= 0.009 * len(corpus) + 1
    n_windows = (len(corpus) - 1) // seq_len  # TextDataModule.setup, byte tokenizer: one token per byte
    first_val_token = (n_windows - max(1, round(0.01 * n_windows))) * seq_len
    assert len(corpus) - len(held) >= first_val_token


def test_task_files_are_deterministic_and_drawn_from_heldout_text(data_dir: Path, tmp_path: Path) -> None:
    held = heldout_text(0.01)
    again, other = build_tasks(str(tmp_path / "again"), seed=0), build_tasks(str(tmp_path / "other"), seed=1)
    for name, path in again.items():
        assert Path(path).read_bytes() == (data_dir / f"{name}.jsonl").read_bytes()
        assert Path(path).read_bytes() != Path(other[name]).read_bytes()
    line_end = _records(data_dir / "line_end.jsonl")
    assert len(line_end) == 500
    for doc in line_end:
        assert len(set(doc["choices"])) == 4 and 0 <= doc["label"] < 4
        assert doc["context"] + doc["choices"][doc["label"]] + "\n" in held
    complete = _records(data_dir / "complete_line.jsonl")
    assert len(complete) == 500
    assert all(doc["context"] + doc["target"] + "\n" in held and doc["target"] for doc in complete)
    assert sum(os.path.getsize(p) for p in again.values()) < 400_000  # nothing large


def test_parse_loops() -> None:
    assert parse_loops("1,2,4") == [1, 2, 4] and parse_loops("1-3") == [1, 2, 3] and parse_loops("3,1,3") == [1, 3]
    for bad in ("0", "1,x", "-1"):
        with pytest.raises(ValueError, match="--loops"):
            parse_loops(bad)
    with pytest.raises(ValueError, match="the range '3-1' is empty; write the smaller count first"):
        parse_loops("3-1")  # was "every loop count must be >= 1"


def test_summary_gain_captured_is_the_papers_fraction() -> None:
    def results(acc: float, em: float) -> dict:
        configs = {"a": {"metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}], "metadata": {"chance": 0.25}},
                   "b": {"metric_list": [{"metric": "exact_match"}], "metadata": {"chance": 0.0}}}  # fmt: skip
        return {"configs": configs, "results": {"a": {"acc,none": acc}, "b": {"exact_match,none": em}}}

    per_k = {1: results(0.5, 0.1), 2: results(0.579, 0.179), 3: results(0.596, 0.196), 4: results(0.6, 0.2)}
    summary = summarize(per_k)
    assert summary["average"] == pytest.approx({1: 0.3, 2: 0.379, 3: 0.396, 4: 0.4})
    assert summary["gain_captured"] == pytest.approx({1: 0.0, 2: 0.79, 3: 0.96, 4: 1.0})
    assert summary["chance_average"] == pytest.approx(0.125)
    table = format_table(summary)
    assert "| average |  | 0.125 | 0.300 | 0.379 | 0.396 | 0.400 |" in table
    assert "| 0% | 79% | 96% | 100% |" in table


@pytest.mark.slow
def test_elr_eval_writes_table_json_png_and_tensorboard(
    checkpoint: Path, data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out, tb = tmp_path / "out", tmp_path / "tb"
    main(["eval", "--ckpt_path", str(checkpoint), "--loops", "1,2", "--limit", "6", "--data_dir", str(data_dir),
          "--output_dir", str(out), "--log_dir", str(tb), "--batch_size", "4", "--kv_cache", "last_loop"])  # fmt: skip
    table = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    for k in (1, 2):
        results = json.loads((out / f"results_k{k}.json").read_text())
        assert results["config"]["elr_loops"] == k and results["config"]["elr_kv_cache"] == "last_loop"
        assert summary["tasks"]["elr_line_end"]["scores"][str(k)] == results["results"]["elr_line_end"]["acc,none"]
        assert results["results"]["elr_line_end"]["sample_len"] == 6
        assert "exact_match,none" in results["results"]["elr_complete_line"]
    assert "| elr_line_end | acc | 0.250 |" in table and "| k=1 | k=2 |" in table
    assert (out / "accuracy_vs_k.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb))
    events.Reload()
    assert [e.step for e in events.Scalars("eval/average")] == [1, 2]
    assert [e.step for e in events.Scalars("eval/elr_line_end/acc")] == [1, 2]


def _error(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 1 and len(lines) == 1 and lines[0].startswith("elr eval: error: "), lines
    return lines[0]


@pytest.mark.slow
def test_elr_eval_bad_input_is_a_one_line_error(checkpoint: Path, data_dir: Path, tmp_path: Path, capsys) -> None:
    ckpt, data = str(checkpoint), str(data_dir)

    assert "does not exist" in _error(["eval", "--ckpt_path", str(tmp_path / "missing.ckpt")], capsys)
    assert ">= 1" in _error(["eval", "--ckpt_path", ckpt, "--loops", "0,1"], capsys)
    assert "unknown task(s) no_such_task" in _error(["eval", "--ckpt_path", ckpt, "--tasks", "no_such_task"], capsys)
    message = _error(["eval", "--ckpt_path", ckpt, "--loops", "5", "--data_dir", data], capsys)
    assert "--loops=5" in message and "max_loops=4" in message and "--allow_extrapolation" in message
    # From the console script: no traceback, non-zero exit status.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "elr_lightning.cli", "eval", "--ckpt_path", str(tmp_path / "nope.ckpt")],
                         capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith("elr eval: error: --ckpt_path")


@pytest.mark.slow
def test_the_harness_command_line_runs_the_adapter(checkpoint: Path, data_dir: Path, tmp_path: Path) -> None:
    """``lm_eval`` itself (its ``__main__``), with the adapter registered by importing elr_lightning.eval."""
    launcher = "import elr_lightning.eval.adapter, runpy; runpy.run_module('lm_eval', run_name='__main__')"
    args = ["--model", "elr", "--model_args", f"ckpt_path={checkpoint},loops=2,kv_cache=last_loop",
            "--include_path", TASKS_DIR, "--tasks", "elr_line_end", "--limit", "6", "--batch_size", "4",
            "--metadata", json.dumps({"data_dir": str(data_dir)}), "--output_path", str(tmp_path / "out")]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-c", launcher, *args], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    [path] = list((tmp_path / "out").rglob("results_*.json"))
    results = json.loads(path.read_text())
    assert results["config"]["elr_loops"] == 2 and results["results"]["elr_line_end"]["sample_len"] == 6
    assert 0.0 <= results["results"]["elr_line_end"]["acc,none"] <= 1.0
    assert "elr_line_end" in run.stdout  # the harness's own results table


def test_parse_points_and_thresholds() -> None:
    assert parse_points("1-3,auto") == ([1, 2, 3], True) and parse_points("auto") == ([], True)
    assert parse_points("2,1") == ([1, 2], False)
    assert parse_thresholds("0.01, 1e-3,0.01") == [0.01, 0.001]
    for bad in ("x", "-1", "nan", "inf", ""):
        with pytest.raises(ValueError, match="--threshold"):
            parse_thresholds(bad)
    with pytest.raises(ValueError, match="not a loop count"):
        parse_points("1,aut")


@pytest.mark.slow
def test_elr_eval_loops_auto_adds_adaptive_points(
    checkpoint: Path, data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """``--loops 2,auto``: threshold 0 is k = budget (same scores, 2 loops per token); a huge one exits at loop 1."""
    out, tb = tmp_path / "out", tmp_path / "tb"
    main(["eval", "--ckpt_path", str(checkpoint), "--loops", "2,auto", "--max_loops", "2", "--threshold", "0,1e9",
          "--tasks", "elr_line_end", "--limit", "6", "--data_dir", str(data_dir), "--output_dir", str(out),
          "--log_dir", str(tb), "--batch_size", "4"])  # fmt: skip
    table = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    never, always = summary["adaptive"]["auto:kl:0"], summary["adaptive"]["auto:kl:1e+09"]
    assert never["mean_loops"] == 2.0 and never["threshold"] == 0.0 and never["max_loops"] == 2
    assert never["scores"]["elr_line_end"] == summary["tasks"]["elr_line_end"]["scores"]["2"]
    assert 1.0 < always["mean_loops"] < 2.0  # each continuation's first token is read off the prefill, at the budget
    results = json.loads((out / "results_auto_kl_0.json").read_text())
    assert results["config"]["elr_loops"] == "auto" and results["config"]["elr_threshold"] == 0.0
    assert results["results"]["elr_line_end"]["sample_len"] == 6
    assert "| k=2 | auto:kl:0 | auto:kl:1e+09 |" in table
    assert f"| loops per token |  |  | 2 | 2.000 | {always['mean_loops']:.3f} |" in table
    assert (out / "accuracy_vs_k.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb))
    events.Reload()
    assert [e.value for e in events.Scalars("eval/auto_kl_0/mean_loops")] == [2.0]


@pytest.mark.parametrize(
    "flags", [["--exit_criterion", "delta"], ["--exit_criterion", "kl"], ["--threshold", "0.1"], ["--max_loops", "2"],
              ["--exit_criterion", "delta", "--max_loops", "2"]],
)
def test_auto_options_without_auto_are_refused_naming_each(flags: list[str], capsys) -> None:
    """``--loops 1 --exit_criterion delta`` would score k = 1 and ignore the criterion: refused, as ``--threshold``."""
    message = _error(["eval", "--ckpt_path", "missing.ckpt", "--loops", "1,2", *flags], capsys)
    named = [flag for flag in flags if flag.startswith("--")]
    assert all(flag in message for flag in named) and "only read with --loops auto" in message
    assert "does not exist" not in message  # refused before the checkpoint is looked at


@pytest.mark.slow
def test_elr_eval_auto_options_are_checked(checkpoint: Path, data_dir: Path, capsys) -> None:
    ckpt = str(checkpoint)
    assert "only read with --loops auto" in _error(["eval", "--ckpt_path", ckpt, "--loops", "1", "--threshold", "0.1"], capsys)
    assert "--threshold" in _error(["eval", "--ckpt_path", ckpt, "--loops", "auto", "--threshold", "-1"], capsys)
    message = _error(["eval", "--ckpt_path", ckpt, "--loops", "auto", "--max_loops", "5", "--data_dir", str(data_dir)], capsys)
    assert "--max_loops=5" in message and "max_loops=4" in message
