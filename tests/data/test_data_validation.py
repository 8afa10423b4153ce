"""``data.validation`` folders are checked against the training folders: never the same data."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from elr_lightning.data import PreparedDataModule, prepare_corpus


@pytest.fixture
def sources(tmp_path: Path) -> dict[str, Path]:
    """Two JSONL files of distinct documents."""
    files = {}
    for name, make in (("web", lambda i: f"page {i}: " + "lorem ipsum " * (5 + i % 7)), ("code", lambda i: f"def f{i}(x):\n")):
        files[name] = tmp_path / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps({"text": make(i)}) + "\n" for i in range(200)), encoding="utf-8")
    return files


def module(train: Path, validation: Path) -> PreparedDataModule:
    dm = PreparedDataModule(str(train), validation=[str(validation)], seq_len=16, batch_size=2)
    dm.setup("fit")
    return dm


def test_a_validation_folder_holding_training_data_is_refused(tmp_path: Path, sources: dict[str, Path]) -> None:
    train = tmp_path / "train"
    prepare_corpus([str(sources["web"])], str(train), val_fraction=0.1, progress=False)
    with pytest.raises(ValueError, match=r"data\.validation\[0\]: .*train' is the same data as data\.folders\[0\] "
                                         r".*train' \(fingerprint [0-9a-f]{12}\); validate on a folder prepared from"):
        module(train, train)
    shutil.copytree(train, tmp_path / "copy")
    with pytest.raises(ValueError, match=r"validation\[0\]: .*copy' is the same data as data\.folders\[0\]"):
        module(train, tmp_path / "copy")
    prepare_corpus([str(sources["web"]), str(sources["code"])], str(tmp_path / "again"), val_fraction=0.5,
                   progress=False)  # the same file, prepared again with other options beside another
    with pytest.raises(ValueError, match=r"validation\[0\]: .*again' was prepared from .*web\.jsonl', which "
                                         r"data\.folders\[0\] .*train' trains on; .* drop data\.validation"):
        module(train, tmp_path / "again")


def test_a_validation_folder_of_other_documents_is_used(tmp_path: Path, sources: dict[str, Path]) -> None:
    prepare_corpus([str(sources["web"])], str(tmp_path / "train"), val_fraction=0.1, progress=False)
    prepare_corpus([str(sources["code"])], str(tmp_path / "held"), val_fraction=0.0, progress=False)
    dm = module(tmp_path / "train", tmp_path / "held")
    assert len(dm.val_windows) > 0
    (tmp_path / "held" / "plan.json").unlink()  # an older or copied folder without its plan still validates
    assert len(module(tmp_path / "train", tmp_path / "held").val_windows) == len(dm.val_windows)
