"""Inference commands read a sharded checkpoint folder (FSDP with ``save_distributed_checkpoint``) in one process."""

from __future__ import annotations

import pickle
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from _elr_ckpt import write_checkpoint
from elr_lightning.checkpoints.io import is_sharded_checkpoint, read_sharded_checkpoint
from elr_lightning.cli import main
from elr_lightning.inference.generate import load_model


def shard_like_fsdp(ckpt: Path, folder: Path) -> None:
    """Lay ``ckpt`` out as Lightning's ModelParallelStrategy does: tensors through DCP, the rest in meta.pt."""
    checkpoint = torch.load(ckpt, weights_only=True)
    tensors = {"state_dict": checkpoint.pop("state_dict"), "optimizer_0": checkpoint.pop("optimizer_states")[0]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(tensors, checkpoint_id=str(folder), no_dist=True)
    torch.save(checkpoint, folder / "meta.pt")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("sharded")
    write_checkpoint(root / "full.ckpt")
    (root / "last.ckpt").mkdir()
    shard_like_fsdp(root / "full.ckpt", root / "last.ckpt")
    return root / "full.ckpt", root / "last.ckpt"


def test_a_sharded_folder_loads_the_same_model_as_the_file(checkpoints: tuple[Path, Path]) -> None:
    full, folder = checkpoints
    assert is_sharded_checkpoint(str(folder)) and not is_sharded_checkpoint(str(full))
    reference, _ = load_model(str(full))
    model, _ = load_model(str(folder))
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for k in (1, 3):
            assert torch.equal(model(ids, k), reference(ids, k))
    meta = read_sharded_checkpoint(str(folder), weights=False)
    assert "state_dict" not in meta and meta["hyper_parameters"]["arch"]["d_model"] == 32


def test_elr_generate_reads_a_sharded_folder(checkpoints: tuple[Path, Path], capsys: pytest.CaptureFixture) -> None:
    full, folder = checkpoints
    outputs = []
    for path in (full, folder):
        main(["generate", "--ckpt_path", str(path), "--loops", "2", "--prompt", "ab", "--max_new_tokens", "6", "--seed", "3"])
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0].startswith("ab") and len(outputs[0]) > 3


def test_a_folder_that_is_not_a_sharded_checkpoint_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is a folder without .metadata and meta.pt, so not a sharded checkpoint"):
        read_sharded_checkpoint(str(tmp_path))


@pytest.mark.parametrize("damage, says", [
    ("empty meta.pt", r"its meta.pt \(0 bytes\) is empty"),
    ("cut meta.pt", r"its meta.pt \(\d+ bytes\) is damaged"),
    ("list meta.pt", r"its meta.pt holds a list, not a checkpoint's dictionary"),
    ("int index", r"its .metadata holds a int, not a torch.distributed.checkpoint index"),
    ("no index", r"is a folder without .metadata, so not a sharded checkpoint"),
    ("no meta.pt", r"is a folder without meta.pt, so not a sharded checkpoint"),
])  # fmt: skip
def test_a_damaged_sharded_folder_is_one_line_naming_the_file(
    checkpoints: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture, damage: str, says: str
) -> None:
    folder = tmp_path / "damaged"
    shutil.copytree(checkpoints[1], folder)
    meta, index = folder / "meta.pt", folder / ".metadata"
    if damage == "empty meta.pt":
        meta.write_bytes(b"")
    elif damage == "cut meta.pt":
        meta.write_bytes(meta.read_bytes()[:200])
    elif damage == "list meta.pt":
        torch.save([1, 2], meta)
    elif damage == "int index":
        index.write_bytes(pickle.dumps(5))
    else:
        (index if damage == "no index" else meta).unlink()
    with pytest.raises(SystemExit):
        main(["generate", "--ckpt_path", str(folder), "--prompt", "ab", "--max_new_tokens", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(says, err[0]) and "bug" not in err[0], err
