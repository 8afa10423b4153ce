"""``open_checkpoint``: the one way a command opens a checkpoint (trust, the path's check, load, tokenizer)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import FIXTURES
from elr_lightning.inference.open import open_checkpoint
from elr_lightning.tokenizers import ByteTokenizer

FIXTURE = FIXTURES / "pre_regroup.ckpt"


def test_it_returns_the_model_in_eval_mode_its_module_and_the_saved_tokenizer() -> None:
    opened = open_checkpoint(str(FIXTURE))
    assert not opened.model.training and opened.module.model is opened.model
    assert isinstance(opened.tokenizer, ByteTokenizer)


def test_a_missing_path_is_refused_naming_the_option(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="--ckpt_path"):
        open_checkpoint(str(tmp_path / "missing.ckpt"))


def test_a_damaged_file_is_refused_before_it_is_loaded(tmp_path: Path) -> None:
    damaged = tmp_path / "damaged.ckpt"
    damaged.write_bytes(FIXTURE.read_bytes()[:2000])
    with pytest.raises(ValueError, match="damaged.ckpt"):
        open_checkpoint(str(damaged), field="--from")
