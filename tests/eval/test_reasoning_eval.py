"""The ``elr_reasoning`` harness tasks in ``elr eval``, reasoning scores in ``elr ablate``, and the shipped config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from conftest import REPO_ROOT, fit_two_steps
from elr_lightning.ablate.run import run_ablation
from elr_lightning.cli import main, run
from elr_lightning.config import ModelConfig
from elr_lightning.module import ELRModule
from elr_lightning.reasoning import GENERATORS, ReasoningTextDataModule, heldout_instances
from elr_lightning.reasoning.report import ablation_section, checks, collect
from elr_lightning.reasoning.score import greedy_answers
from elr_lightning.tokenizers import ByteTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = REPO_ROOT
TASKS = ROOT / "elr_lightning" / "eval" / "tasks"
ARCH = ModelConfig(vocab_size=256, d_model=32, n_heads=2, n_in=1, n_rec=1, n_out=1, max_loops=3, max_seq_len=64)


def test_every_task_and_level_has_a_harness_task_in_the_group():
    group = yaml.safe_load((TASKS / "elr_reasoning.yaml").read_text())
    assert group["group"] == "elr_reasoning" and group["task"] == [f"elr_reasoning_{name}" for name in GENERATORS]
    for name, generator in GENERATORS.items():
        levels = yaml.safe_load((TASKS / f"elr_reasoning_{name}.yaml").read_text())["task"]
        assert levels == [f"elr_reasoning_{name}_d{level}" for level in generator.difficulties()]
        for task in levels:
            config = yaml.safe_load((TASKS / f"{task}.yaml").read_text())
            level = int(task.rsplit("_d", 1)[1])
            assert config["task"] == task and config["dataset_kwargs"] == {"generator": name, "difficulty": level}
            assert config["metadata"]["chance"] == pytest.approx(generator.chance, abs=1e-3)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two training steps on the reasoning mix, saved with its byte tokenizer."""
    root = tmp_path_factory.mktemp("reasoning_ckpt")
    text = root / "text.txt"
    text.write_text("".join(f"x{i} = {i}\n" for i in range(300)))
    data = ReasoningTextDataModule(reasoning_tasks={"hops": 1, "addition": 2}, examples_per_level=50,
                                   sources=[str(text)], seq_len=48, batch_size=4, cache_dir=str(root / "cache"))  # fmt: skip
    torch.manual_seed(0)
    module = ELRModule(arch=ARCH, warmup_steps=0)
    path = fit_two_steps(module, data, root / "tiny.ckpt")
    return path


def test_harness_generation_equals_the_ablation_scorer(checkpoint: Path):
    pytest.importorskip("lm_eval")
    from elr_lightning.eval import ELRLM
    from elr_lightning.inference.generate import load_model

    model, _ = load_model(str(checkpoint))
    prompts = [i.prompt for i in heldout_instances("hops", 1, 4) + heldout_instances("addition", 2, 4)]
    lm = ELRLM.from_model(model, ByteTokenizer(), loops=2, batch_size=3)
    harness = lm.generate_texts(prompts, ["\n"], max_gen_toks=4, do_sample=False)
    ours = greedy_answers(model, ByteTokenizer(), prompts, loops=2, max_new_tokens=4)
    assert harness == [text[:4] for text in ours] and any(harness)


@pytest.mark.slow
def test_elr_eval_reports_accuracy_per_difficulty(checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture):
    pytest.importorskip("lm_eval")
    out = tmp_path / "out"
    main(["eval", "--ckpt_path", str(checkpoint), "--loops", "1,3", "--limit", "3", "--output_dir", str(out),
          "--tasks", "elr_reasoning_hops_d1,elr_reasoning_hops_d2,elr_reasoning_addition_d1"])  # fmt: skip
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["reasoning"]) == {"hops", "addition"} and set(summary["reasoning"]["hops"]) == {"1", "2"}
    for k in ("1", "3"):
        results = json.loads((out / f"results_k{k}.json").read_text())["results"]
        assert summary["reasoning"]["hops"]["2"][k] == results["elr_reasoning_hops_d2"]["exact_match,none"]
        assert results["elr_reasoning_hops_d2"]["sample_len"] == 3
    assert "| task | difficulty | k=1 | k=3 |" in printed and "| hops | 2 |" in printed
    assert (out / "reasoning_vs_k.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _result(arm: str, seed: int, table: dict) -> dict:
    return {"arm": arm, "seed": seed, "reasoning": {t: {str(lv): {str(k): v for k, v in s.items()} for lv, s in levels.items()}
                                                   for t, levels in table.items()}}  # fmt: skip


def test_targets_hold_and_fail_where_they_should():
    good = [
        _result("baseline", 0, {"hops": {1: {1: 0.50}, 2: {1: 0.20}}}),
        _result("elr", 0, {"hops": {1: {1: 0.50, 2: 0.60, 3: 0.70}, 2: {1: 0.20, 2: 0.28, 3: 0.40}}}),
        _result("elr", 1, {"hops": {1: {1: 0.52, 2: 0.60, 3: 0.72}, 2: {1: 0.22, 2: 0.30, 3: 0.42}}}),
    ]
    found = checks(collect(good), 3)
    assert [c[2] for c in found] == ["holds", "holds", "holds"]
    assert found[0][1] == "hops level 2: +0.200" and collect(good)["elr"]["hops"][2][3] == [0.40, 0.42]
    section = ablation_section(good, 3)
    assert "| hops | 2 | 0.210 ± 0.010 | 0.290 ± 0.010 | 0.410 ± 0.010 |" in section and "### `baseline`" in section
    bad = [
        _result("baseline", 0, {"hops": {1: {1: 0.60}}}),
        _result("elr", 0, {"hops": {1: {1: 0.50, 2: 0.45, 3: 0.55}}}),
    ]
    assert [c[2] for c in checks(collect(bad), 3)] == ["does not hold"] * 3
    assert checks(collect(bad[:1]), 3)[0][2] == "n/a" and ablation_section([{"arm": "elr", "seed": 0}], 3) == ""


@pytest.mark.slow
def test_ablate_scores_every_arm_on_the_reasoning_levels(tmp_path: Path):
    text = tmp_path / "text.txt"
    text.write_text("".join(f"y{i} = {i}\n" for i in range(300)))
    config = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "max_steps": 2, "val_check_interval": 2, "check_val_every_n_epoch": None,
                    "enable_progress_bar": False, "enable_model_summary": False},
        "model": {"class_path": "elr_lightning.ELRModule",
                  "init_args": {"arch": {**ARCH.__dict__, "max_loops": 2}, "virtual_ranks": 2, "warmup_steps": 0}},
        "data": {"class_path": "elr_lightning.reasoning.ReasoningTextDataModule",
                 "init_args": {"reasoning_tasks": {"hops": "1-2"}, "examples_per_level": 40, "sources": [str(text)],
                               "seq_len": 48, "batch_size": 4, "val_batches": 1, "cache_dir": str(tmp_path / "cache")}},
    }  # fmt: skip
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "out"
    results = run_ablation(str(path), str(out), arms=["baseline", "elr"], reasoning=5, log=lambda _: None)
    assert set(results[0]["reasoning"]["hops"]["2"]) == {"1"}
    assert set(results[1]["reasoning"]["hops"]["1"]) == {"1", "2"}
    report = (out / "ablate.md").read_text()
    assert "## Reasoning accuracy" in report and "| hops | 2 |" in report and "### Targets" in report
    assert (out / "reasoning_vs_k.png").stat().st_size > 1000
    stored = json.loads((out / "runs" / "elr-s0" / "result.json").read_text())
    assert stored["reasoning"] == results[1]["reasoning"]


@pytest.mark.slow
def test_shipped_reasoning_config_trains_a_few_steps(tmp_path: Path):
    config = ROOT / "config" / "quickstart_reasoning.yaml"
    run(["fit", "--config", str(config), "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
         "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.logger.init_args.save_dir", str(tmp_path),
         "--trainer.enable_progress_bar", "false", "--model.init_args.arch.d_model", "32",
         "--data.init_args.examples_per_level", "20", "--data.init_args.text_bytes", "20000",
         "--data.init_args.cache_dir", str(tmp_path / "cache"), "--data.init_args.val_batches", "1"])  # fmt: skip
    (last,) = tmp_path.glob("**/last.ckpt")
    saved = torch.load(last, map_location="cpu", weights_only=True)
    assert saved["global_step"] == 2 and saved["datamodule_hyper_parameters"]["reasoning_tasks"]["hops"] == "1-4"


@pytest.mark.parametrize(
    "override, message",
    [
        ('--data.init_args.reasoning_tasks={"parity": null}', "data.reasoning_tasks: unknown reasoning task 'parity'"),
        ('--data.init_args.reasoning_tasks={"hops": 9}', "data.reasoning_tasks: difficulty 9 of reasoning task 'hops'"),
        ("--data.init_args.seed=1.5", "data.init_args.seed"),
    ],
)
def test_a_bad_reasoning_setting_is_one_line_from_elr_fit(override: str, message: str, monkeypatch, capsys):
    monkeypatch.delenv("ELR_DEBUG", raising=False)
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(ROOT / "config" / "quickstart_reasoning.yaml"), override, "--trainer.max_steps", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 1 and len(err) == 1 and err[0].startswith("elr fit: error: ") and message in err[0]
