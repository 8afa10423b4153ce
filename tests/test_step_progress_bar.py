"""The training progress bar of a run limited by steps reads its step limit, not ``Epoch 0/-2``."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("rich")

from lightning.pytorch import Trainer  # noqa: E402
from lightning.pytorch.callbacks import TQDMProgressBar  # noqa: E402

from elr_lightning.callbacks import StepProgressBar  # noqa: E402
from elr_lightning.lightning_cli import ELRCLI, make_cli  # noqa: E402

CONFIG = """\
trainer: {accelerator: cpu, devices: 1, max_steps: 7, logger: false, default_root_dir: run}
model:
  class_path: elr_lightning.ELRModule
  init_args:
    arch: {vocab_size: 256, d_model: 16, n_heads: 2, n_in: 1, n_rec: 1, n_out: 0, max_seq_len: 32, max_loops: 2}
data:
  class_path: elr_lightning.depth.DepthDataModule
  init_args: {task: root, difficulty: 2, batch_size: 2}
"""


def _description(trainer: Trainer) -> str:
    bar = trainer.progress_bar_callback
    assert isinstance(bar, StepProgressBar)
    bar._trainer = trainer  # set by the bar's setup() when a run starts
    return bar._get_train_description(0).rstrip()


@pytest.mark.parametrize(("limits", "expected"), [
    ({"max_steps": 1000}, "Epoch 0 · step limit 1000"),
    ({"max_epochs": 10}, "Epoch 0/9"),
    ({"max_steps": 5, "max_epochs": 3}, "Epoch 0/2"),
])  # fmt: skip
def test_description_names_the_limit_the_run_stops_at(limits, expected):
    trainer = Trainer(callbacks=[StepProgressBar()], logger=False, enable_checkpointing=False, **limits)
    if "max_epochs" not in limits:
        trainer.fit_loop.max_epochs = -1  # Lightning's value for a run limited by steps only
    assert _description(trainer) == expected


def _trainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> Trainer:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(CONFIG)
    return make_cli(ELRCLI, ["--config", "c.yaml", *args], run=False).trainer


def test_elr_fit_uses_it_unless_a_bar_is_configured_or_disabled(tmp_path, monkeypatch):
    assert "step limit 7" in _description(_trainer(tmp_path, monkeypatch))
    tqdm = "--trainer.callbacks+=lightning.pytorch.callbacks.TQDMProgressBar"
    assert isinstance(_trainer(tmp_path, monkeypatch, tqdm).progress_bar_callback, TQDMProgressBar)
    assert _trainer(tmp_path, monkeypatch, "--trainer.enable_progress_bar=false").progress_bar_callback is None
