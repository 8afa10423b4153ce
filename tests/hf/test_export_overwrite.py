"""``elr export`` and ``elr import`` never replace what a user owns unless told to, and then never mix."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from _elr_ckpt import write_checkpoint  # noqa: E402
from elr_lightning.cli import main  # noqa: E402
from elr_lightning.config import ModelConfig  # noqa: E402
from elr_lightning.hf import export  # noqa: E402
from elr_lightning.hf.export import EXPORT_FILES, export_hf  # noqa: E402
from elr_lightning.model import LoopedLM  # noqa: E402
from elr_lightning.tokenizers import ByteTokenizer  # noqa: E402
from elr_lightning.updates import FixedDelta  # noqa: E402

ARCH = ModelConfig(vocab_size=256, d_model=16, n_heads=2, n_in=1, n_rec=1, n_out=0, max_seq_len=32, max_loops=2)


def _tree(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    write_checkpoint(root / "a.ckpt", ARCH)
    write_checkpoint(root / "b.ckpt", ARCH, update=FixedDelta(0.25))
    return root / "a.ckpt", root / "b.ckpt"


def _one_line_refusal(args: list[str], capsys: pytest.CaptureFixture, says: str) -> None:
    with pytest.raises(SystemExit) as info:
        main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 1 and len(err) == 1 and says in err[0], err


def test_export_into_a_folder_that_is_not_empty_is_refused_and_leaves_it_alone(
    checkpoints: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    a, b = checkpoints
    out = tmp_path / "out"
    main(["export", "--ckpt_path", str(a), "--out", str(out)])
    (out / "README.md").write_text("my model card")
    before = _tree(out)
    _one_line_refusal(["export", "--ckpt_path", str(b), "--out", str(out)], capsys, f"--out {str(out)!r} is not empty")
    assert _tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folder left beside it


def test_export_overwrite_replaces_every_export_file_and_keeps_the_users(
    checkpoints: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    a, b = checkpoints
    out, fresh = tmp_path / "out", tmp_path / "fresh"
    main(["export", "--ckpt_path", str(a), "--out", str(out)])
    (out / "README.md").write_text("my model card")
    (out / "special_tokens_map.json").write_text("{}")  # an export file this version does not write
    main(["export", "--ckpt_path", str(b), "--out", str(out), "--overwrite"])
    main(["export", "--ckpt_path", str(b), "--out", str(fresh)])
    capsys.readouterr()
    new, reference = _tree(out), _tree(fresh)
    assert new.pop("README.md") == hashlib.sha256(b"my model card").hexdigest()
    assert new == reference  # every export file is b's, none of a's is left
    assert set(reference) <= EXPORT_FILES


def test_a_failed_export_leaves_the_folder_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails midway (the disk fills while the tokenizer, written last, is saved) changes nothing:
    before, the new weights and config were left beside the old tokenizer files."""
    out = tmp_path / "out"
    torch.manual_seed(0)
    export_hf(LoopedLM(ARCH), ByteTokenizer(), out)
    before = _tree(out)

    def full_disk(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "_write_tokenizer", full_disk)
    with pytest.raises(OSError, match="No space left"):
        export_hf(LoopedLM(ARCH), ByteTokenizer(), out, overwrite=True)
    assert _tree(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_import_never_replaces_a_checkpoint_unless_told(
    checkpoints: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    a, b = checkpoints
    main(["export", "--ckpt_path", str(a), "--out", str(tmp_path / "a")])
    main(["export", "--ckpt_path", str(b), "--out", str(tmp_path / "b")])
    target = tmp_path / "mine.ckpt"
    main(["import", "--hf", str(tmp_path / "a"), "--out", str(target)])
    before = target.read_bytes()
    _one_line_refusal(["import", "--hf", str(tmp_path / "b"), "--out", str(target)], capsys, f"--out {str(target)!r} exists")
    assert target.read_bytes() == before
    main(["import", "--hf", str(tmp_path / "b"), "--out", str(target), "--overwrite"])
    assert torch.load(target, weights_only=True)["hyper_parameters"]["update"]["init_args"]["beta"] == 0.25


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_export_and_import_files_follow_the_users_umask(checkpoints: tuple[Path, Path], tmp_path: Path, umask: int) -> None:
    """safetensors creates its file 0600; the export gives every file the mode ``open`` gives under the umask."""
    a, _ = checkpoints
    previous = os.umask(umask)
    try:
        main(["export", "--ckpt_path", str(a), "--out", str(tmp_path / "out")])
        main(["import", "--hf", str(tmp_path / "out"), "--out", str(tmp_path / "back.ckpt")])
    finally:
        os.umask(previous)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [*(tmp_path / "out").iterdir(), tmp_path / "back.ckpt"]}
    assert modes["model.safetensors"] == 0o666 & ~umask
    assert set(modes.values()) == {0o666 & ~umask}, modes
