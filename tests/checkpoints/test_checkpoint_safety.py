"""Nothing lost, nothing silently wrong: checkpoints of non-finite weights, unwritable folders,
damaged files given to ``fit``, orphan temporary files and concurrent runs."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import yaml

from conftest import REPO_ROOT, quiet_trainer, switch_module
from elr_lightning.callbacks import AtomicModelCheckpoint
from elr_lightning.data import TextDataModule
from elr_lightning.module import ELRModule


class PoisonAfterStep(pl.Callback):
    """Makes one weight NaN after optimizer step ``step``, as a diverging update does (the loss of that
    step was finite; only the next forward pass would see the NaN)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                pl_module.model.embed.weight[0, 0] = float("nan")


def _trainer(tmp_path: Path, max_steps: int, *callbacks: pl.Callback) -> pl.Trainer:
    return quiet_trainer(max_steps=max_steps, limit_val_batches=0, callbacks=list(callbacks), enable_checkpointing=True)


def _data(tmp_path: Path) -> TextDataModule:
    return TextDataModule(seq_len=16, batch_size=4, max_bytes=20000, cache_dir=str(tmp_path / "cache"))


def test_non_finite_weights_never_replace_the_last_good_checkpoint(tmp_path: Path) -> None:
    ckpt = AtomicModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_top_k=1, monitor="step", mode="max",
                                 every_n_train_steps=1, save_last=True)  # fmt: skip
    trainer = _trainer(tmp_path, 5, PoisonAfterStep(step=2), ckpt)
    with pytest.raises(FloatingPointError, match=r"not saving the checkpoint of step 2: non-finite values in .*embed"):
        trainer.fit(switch_module(conditioner=False), _data(tmp_path))
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert files == ["epoch=0-step=1.ckpt", "last.ckpt"]
    for name in files:
        saved = torch.load(tmp_path / "ckpt" / name, weights_only=True)
        assert saved["global_step"] == 1
        assert all(torch.isfinite(v).all() for v in saved["state_dict"].values() if v.is_floating_point())
    ELRModule.load_from_checkpoint(tmp_path / "ckpt" / "last.ckpt", weights_only=True)


def test_every_shipped_config_writes_checkpoints_atomically() -> None:
    root = REPO_ROOT
    found = {}
    for path in [*(root / "config").glob("*.yaml"), *(root / "callbacks").glob("*.yaml")]:
        config = yaml.safe_load(path.read_text()) or {}
        trainer = config.get("trainer", {}) or {}
        for callback in [*(trainer.get("callbacks") or []), *(trainer.get("callbacks+") or [])]:
            if callback["class_path"].endswith("ModelCheckpoint"):
                found[path.name] = callback["class_path"]
    assert {"quickstart.yaml", "gpt_0.5b.yaml", "4b.yaml"} <= set(found)
    assert set(found.values()) == {"elr_lightning.callbacks.AtomicModelCheckpoint"}, found


def test_orphan_temporary_files_of_a_killed_save_are_removed_on_the_next_start(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    orphan = folder / f".last.ckpt.{uuid.uuid4().hex}.tmp"
    orphan.write_bytes(b"half a checkpoint")
    kept = [folder / ".notes.tmp", folder / "mine.tmp"]  # not the writer's names: left alone
    for path in kept:
        path.write_text("x")
    ckpt = AtomicModelCheckpoint(dirpath=str(folder), every_n_train_steps=1)
    _trainer(tmp_path, 1, ckpt).fit(switch_module(conditioner=False), _data(tmp_path))
    assert not orphan.exists()
    assert all(path.exists() for path in kept)
    assert (folder / "epoch=0-step=1.ckpt").is_file()


class BlockFolderAfterStep(pl.Callback):
    """Puts a file where the checkpoint folder was, after step ``step``: the folder can no longer be
    written (``chmod`` does not stop the root user these tests may run as; this does)."""

    def __init__(self, folder: Path, step: int) -> None:
        self.folder, self.step = folder, step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if trainer.global_step == self.step:
            shutil.rmtree(self.folder)
            self.folder.write_text("not a folder")


def test_an_unwritable_checkpoint_folder_fails_loudly_naming_it(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    ckpt = AtomicModelCheckpoint(dirpath=str(folder), save_top_k=-1, every_n_train_steps=1)
    trainer = _trainer(tmp_path, 4, BlockFolderAfterStep(folder, 2), ckpt)
    with pytest.raises(OSError, match=rf"cannot write 'epoch=0-step=2.ckpt' into the folder '{folder}'") as err:
        trainer.fit(switch_module(conditioner=False), _data(tmp_path))
    assert ".tmp" not in str(err.value)
