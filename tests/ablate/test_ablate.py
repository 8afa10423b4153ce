"""``elr ablate``: arm configs, resumable runs, the report and the paper's checks."""

from __future__ import annotations

import json
import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import yaml
from typing_extensions import override

from elr_lightning.ablate.run import ARMS, arm_config, largest_divisor_at_most, run_ablation
from elr_lightning.ablate.report import FAILS, HOLDS, MISSING, NOISE, paper_checks, summarise
from elr_lightning.cli import main, run
from conftest import REPO_ROOT

STEPS = 4


def _tiny_config(tmp_path: Any) -> str:
    corpus = tmp_path / "corpus.py"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(300)))
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_steps": 100,
            "val_check_interval": 2,
            "check_val_every_n_epoch": None,
            "log_every_n_steps": 1,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "callbacks": [{"class_path": "lightning.pytorch.callbacks.LearningRateMonitor"}],
        },
        "model": {
            "class_path": "elr_lightning.ELRModule",
            "init_args": {
                "arch": {"vocab_size": 256, "d_model": 32, "n_heads": 2, "n_in": 1, "n_rec": 1, "n_out": 1,
                         "max_seq_len": 64, "max_loops": 2},
                "sampler": {"class_path": "elr_lightning.sampling.OneLoopOverride",
                            "init_args": {"max_loops": 2, "override_fraction": 0.15}},
                "conditioner": {"class_path": "elr_lightning.conditioning.LoopConditioner",
                                "init_args": {"d_cond": 8, "rank": 2, "n_freqs": 2}},
                "virtual_ranks": 2,
                "warmup_steps": 1,
            },
        },
        "data": {
            "class_path": "elr_lightning.data.TextDataModule",
            "init_args": {"sources": [str(corpus)], "seq_len": 32, "batch_size": 4, "val_batches": 2,
                          "cache_dir": str(tmp_path / "cache")},
        },
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


class StopAt(pl.Callback):
    """Ends training gracefully after ``step`` optimizer steps, as an interrupted run would."""

    def __init__(self, step: int) -> None:
        self.step = step

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def _base(tmp_path: Any) -> dict[str, Any]:
    with open(_tiny_config(tmp_path)) as f:
        return yaml.safe_load(f)


@pytest.mark.parametrize("arm", list(ARMS))
def test_every_arm_config_is_the_base_with_one_change_and_the_run_paths(tmp_path, arm):
    base = _base(tmp_path)
    config = arm_config(base, arm, seed=3, out=str(tmp_path / "out"), steps=STEPS)
    model, base_model = config["model"]["init_args"], base["model"]["init_args"]
    assert config["seed_everything"] == 3 and config["data"]["init_args"]["seed"] == 3
    assert config["trainer"]["max_steps"] == STEPS and config["trainer"]["val_check_interval"] == 2
    assert model["arch"] == base_model["arch"]
    names = [c["class_path"].rsplit(".", 1)[-1] for c in config["trainer"]["callbacks"]]
    assert names.count("AtomicModelCheckpoint") == 1 and "ModelCheckpoint" not in names
    assert "LearningRateMonitor" in names
    changed = {key for key in set(model) | set(base_model) if model.get(key) != base_model.get(key)}
    expected = {
        "baseline": {"update", "sampler", "conditioner", "val_loops"},
        "elr": set(),
        "replace": {"update"},
        "residual": {"update"},
        "f0": {"sampler"},
        "no_cond": {"conditioner"},
        "delayed": set(),
        "specialist": {"sampler"},
    }[arm]
    assert changed == expected
    if arm == "delayed":
        assert {"DelayedMixedDepth", "ZeroInitConditioning"} <= set(names)
    if arm == "specialist":
        assert model["sampler"]["init_args"] == {"k": 2}
    if arm == "f0":
        assert model["sampler"]["init_args"]["override_fraction"] == 0.0


def test_bad_arm_and_missing_steps_name_the_fix(tmp_path):
    base = _base(tmp_path)
    with pytest.raises(ValueError, match="--arms: unknown arm 'deep'"):
        arm_config(base, "deep", 0, str(tmp_path))
    del base["trainer"]["max_steps"]
    with pytest.raises(ValueError, match="--steps N"):
        arm_config(base, "elr", 0, str(tmp_path))
    with pytest.raises(ValueError, match="--seeds"):
        run(["ablate", "--config", _tiny_config(tmp_path), "--out", str(tmp_path), "--seeds", "0,x"])


def test_validation_and_checkpoints_land_on_the_last_step():
    assert largest_divisor_at_most(800, 100) == 100
    assert largest_divisor_at_most(7, 100) == 7
    assert largest_divisor_at_most(30, 8) == 6


@pytest.mark.slow
def test_ablate_subset_report_skip_and_resume(tmp_path):
    """Two arms end to end; a rerun skips them; an interrupted arm resumes to the same result."""
    config = _tiny_config(tmp_path)
    out = str(tmp_path / "out")
    lines: list[str] = []
    results = run_ablation(config, out, arms=["elr", "baseline"], steps=STEPS, log=lines.append)
    assert [r["arm"] for r in results] == ["elr", "baseline"]
    assert set(results[0]["loss"]) == {"1", "2"} and set(results[1]["loss"]) == {"1"}
    report = (tmp_path / "out" / "ablate.md").read_text()
    assert "| `elr`" in report and "| `baseline`" in report and "`replace`" not in report
    assert "ELR within 0.5% of the baseline at k = 1" in report and f"**{MISSING}**" in report
    assert os.path.getsize(tmp_path / "out" / "loss_vs_k.png") > 1000
    for name in ("elr-s0", "baseline-s0"):
        assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "out" / "tensorboard" / name))
        assert (tmp_path / "out" / "configs" / f"{name}.yaml").exists()
    assert any("[ablate 1/2] elr-s0" in line for line in lines)

    lines.clear()
    again = run_ablation(config, out, arms=["elr", "baseline"], steps=STEPS, log=lines.append)
    assert again == results and sum("skipped" in line for line in lines) == 2

    out2 = str(tmp_path / "out2")
    with pytest.raises(ValueError, match="stopped at step 2 of 4; rerun"):
        run_ablation(config, out2, arms=["elr"], steps=STEPS, callbacks=[StopAt(2)], log=lines.append)
    lines.clear()
    resumed = run_ablation(config, out2, arms=["elr"], steps=STEPS, log=lines.append)
    assert any("resuming from" in line and "last.ckpt" in line for line in lines)
    assert resumed[0]["loss"] == pytest.approx(results[0]["loss"], abs=1e-6)
    (last,) = (tmp_path / "out2" / "runs").glob("elr-s0/**/last.ckpt")
    assert torch.load(last, weights_only=True)["global_step"] == STEPS  # no pickled object in an ablation's checkpoint
    saved = json.loads((tmp_path / "out2" / "results.json").read_text())
    assert saved["runs"][0]["arm"] == "elr"


@pytest.mark.slow
def test_an_arm_config_reruns_alone_with_elr_fit(tmp_path):
    out = str(tmp_path / "out")
    results = run_ablation(_tiny_config(tmp_path), out, arms=["specialist"], steps=2, log=lambda _: None)
    rerun = tmp_path / "rerun.yaml"
    config = yaml.safe_load((tmp_path / "out" / "configs" / "specialist-s0.yaml").read_text())
    config["trainer"]["default_root_dir"] = str(tmp_path / "rerun")
    config["trainer"]["logger"] = False
    config["trainer"]["callbacks"] = []
    rerun.write_text(yaml.safe_dump(config))
    main(["fit", "--config", str(rerun)])
    assert results[0]["steps"] == 2


def _run(arm: str, seed: int, **loss: float) -> dict[str, Any]:
    losses = {k[1:]: v for k, v in loss.items()}
    return {"arm": arm, "seed": seed, "loss": losses, "bpb": losses}


def test_checks_hold_on_a_paper_like_ablation():
    results = [
        _run("baseline", 0, k1=2.00),
        _run("elr", 0, k1=2.005, k2=1.97, k3=1.95),
        _run("replace", 0, k1=2.10, k2=2.05, k3=2.02),
        _run("residual", 0, k1=2.08, k2=2.03, k3=2.00),
        _run("f0", 0, k1=2.03, k2=1.97, k3=1.94),
        _run("no_cond", 0, k1=2.005, k2=1.98, k3=1.96),
        _run("delayed", 0, k1=2.00, k2=1.97, k3=1.955),
        _run("specialist", 0, k1=2.4, k2=2.1, k3=1.94),
    ]
    checks = paper_checks(summarise(results), 3)
    assert [c.status for c in checks] == [HOLDS] * len(checks)
    assert checks[0].figure == "+0.25% vs the baseline"
    assert checks[-1].figure.startswith("92%")


def test_checks_fail_where_the_paper_would_and_report_missing_arms():
    results = [
        _run("baseline", 0, k1=2.00),
        _run("elr", 0, k1=2.02, k2=2.01, k3=2.012),
        _run("f0", 0, k1=1.99, k2=1.98, k3=1.98),
        _run("specialist", 0, k1=2.4, k2=2.1, k3=2.05),
    ]
    statuses = {c.claim: c.status for c in paper_checks(summarise(results), 3)}
    assert statuses["ELR within 0.5% of the baseline at k = 1"] == FAILS
    assert statuses["f = 0 above the baseline at k = 1"] == FAILS
    assert statuses["ELR's loss falls strictly from k = 1 to K"] == FAILS
    assert statuses["replace update worse than adaptive delta at every k"] == MISSING
    # No specialist seed beats the baseline: the gain must be >= 1% of the k = 1 loss (0.008 < 0.0202).
    assert statuses["ELR's k = K gain >= 80% of the specialist's (best seed) gain over the baseline"] == FAILS


def test_a_difference_inside_the_seed_spread_is_marked_as_such():
    results = [
        _run("baseline", 0, k1=2.000),
        _run("baseline", 1, k1=2.020),
        _run("elr", 0, k1=2.000, k2=1.990),
        _run("elr", 1, k1=2.030, k2=2.032),
    ]
    statuses = {c.claim: c.status for c in paper_checks(summarise(results), 2)}
    # Falls by 0.010 with seed 0, rises by 0.002 with seed 1: mean -0.004, inside a spread of 0.042.
    assert statuses["ELR's loss falls strictly from k = 1 to K"] == NOISE
    summary = summarise(results)["elr"]
    assert summary.mean(1) == pytest.approx(2.015) and summary.spread(2) == pytest.approx(0.042)


def test_the_shipped_quickstart_arm_saves_checkpoints_once(tmp_path):
    with open(os.path.join(REPO_ROOT, "config", "quickstart.yaml")) as f:
        base = yaml.safe_load(f)
    config = arm_config(base, "elr", seed=0, out=str(tmp_path))
    checkpoints = [c for c in config["trainer"]["callbacks"] if "Checkpoint" in c["class_path"]]
    assert len(checkpoints) == 1
    assert checkpoints[0]["init_args"]["dirpath"] == str(tmp_path / "runs" / "elr-s0" / "checkpoints")


def test_checks_compare_arms_on_the_seeds_both_ran():
    def run(arm, seed, losses):
        return {"arm": arm, "seed": seed, "loss": dict(enumerate(losses, 1)), "bpb": dict(enumerate(losses, 1))}

    results = [
        run("baseline", 0, [1.40]), run("baseline", 1, [1.30]),
        run("elr", 0, [1.39, 1.38]), run("elr", 1, [1.31, 1.305]),
        run("replace", 0, [1.395, 1.39]),  # worse than ELR at seed 0, better than ELR's two-seed mean
        run("specialist", 0, [1.5, 1.37]), run("specialist", 1, [1.5, 1.29]),
    ]
    checks = {c.claim: c for c in paper_checks(summarise(results), 2)}
    assert checks["replace update worse than adaptive delta at every k"].figure == "k=1 +0.0050, k=2 +0.0100"
    # Best specialist seed against the baseline of its own seed: seed 0 gains 0.03, seed 1 0.01.
    assert "+0.0300" in checks["ELR's k = K gain >= 80% of the specialist's (best seed) gain over the baseline"].figure


@pytest.mark.parametrize("seed1, status", [([1.30, 1.299, 1.298], HOLDS), ([1.30, 1.301, 1.298], NOISE),
                                           ([1.30, 1.30, 1.298], NOISE)])
def test_falling_in_k_is_judged_per_seed(seed1, status):
    def run(seed, losses):
        return {"arm": "elr", "seed": seed, "loss": dict(enumerate(losses, 1)), "bpb": dict(enumerate(losses, 1))}

    checks = paper_checks(summarise([run(0, [1.40, 1.39, 1.38]), run(1, seed1)]), 3)
    assert [c.status for c in checks if c.claim.startswith("ELR's loss falls")] == [status]
    rising = paper_checks(summarise([run(0, [1.40, 1.41, 1.38]), run(1, [1.30, 1.31, 1.29])]), 3)
    assert [c.status for c in rising if c.claim.startswith("ELR's loss falls")] == [FAILS]


def test_several_configs_are_merged_as_elr_fit_merges_them(tmp_path):
    """``elr ablate --config base.yaml --config fragment.yaml``: the second file used to replace the first."""
    fragment = tmp_path / "fragment.yaml"
    fragment.write_text(yaml.safe_dump({"model": {"init_args": {"arch": {"d_model": 16}}}, "trainer": {"max_steps": 2}}))
    out = tmp_path / "out"
    main(["ablate", "--config", _tiny_config(tmp_path), "--config", str(fragment), "--out", str(out), "--arms", "elr"])
    with open(out / "configs" / "elr-s0.yaml") as f:
        config = yaml.safe_load(f)
    arch = config["model"]["init_args"]["arch"]
    assert arch["d_model"] == 16 and arch["max_loops"] == 2  # the fragment's width, the base's loop budget
    assert config["trainer"]["max_steps"] == 2
    assert (out / "ablate.md").exists()
