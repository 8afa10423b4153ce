"""`elr validate` / `elr test` on a checkpoint just trained log into that run's folder, quietly."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import yaml

from elr_lightning.cli import run

ROOT = Path(__file__).resolve().parent.parent


def _config(tmp_path: Path) -> Path:
    """The shipped depth quickstart, shrunk, logging as it does: runs/<name>/version_N, checkpoints inside."""
    config = yaml.safe_load((ROOT / "config" / "quickstart_depth.yaml").read_text())
    config["trainer"].update(max_steps=2, val_check_interval=2, enable_progress_bar=False, enable_model_summary=False,
                             default_root_dir="runs/tiny")  # fmt: skip
    config["trainer"]["logger"]["init_args"].update(save_dir="runs", name="tiny")
    config["trainer"]["callbacks"] = [c for c in config["trainer"]["callbacks"] if c["class_path"].endswith("Checkpoint")]
    config["model"]["init_args"]["arch"].update(d_model=16, n_heads=2, max_loops=2)
    config["model"]["init_args"]["sampler"]["init_args"]["max_loops"] = 2
    config["model"]["init_args"]["warmup_steps"] = 0
    config["data"]["init_args"].update(difficulty=2, batch_size=4, val_batches=1, eval_difficulties=[1, 2])
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.slow
def test_validate_and_test_log_into_the_checkpoints_run_without_a_false_warning(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = str(_config(tmp_path))
    run(["fit", "--config", config])
    ckpt = "runs/tiny/version_0/checkpoints/last.ckpt"
    assert Path(ckpt).is_file()
    for _ in range(2):  # again: the same folder, no new one (the depth task has no test split: `elr test`
        # takes the same path, log_into_checkpoint_run, with "test" for "validate")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run(["validate", "--config", config, "--ckpt_path", ckpt])
        assert not [w for w in caught if "outside the run's checkpoint folder" in str(w.message)]
    assert len(list((tmp_path / "runs/tiny/version_0/validate").glob("events.out.tfevents.*"))) == 2
    assert sorted(p.name for p in (tmp_path / "runs/tiny").iterdir()) == ["version_0"]
    # the next fit takes the next version, as after any earlier fit
    run(["fit", "--config", config])
    assert sorted(p.name for p in (tmp_path / "runs/tiny").iterdir()) == ["version_0", "version_1"]
