"""Tests of ``elr prepare``: inputs, byte-identical shards for any worker count, resume, refusals."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import elr_lightning.data.prepare as prepare_module
from elr_lightning.cli import main
from elr_lightning.data import PreparedFolder, prepare_corpus
from elr_lightning.data.prepare import held_out, shard_paths
from elr_lightning.tokenizers import ByteTokenizer

#: Distinct documents (every line carries its number), so a document's tokens identify it.
DOCS = [f"doc {i}: " + "".join(f"w{i}.{j} " for j in range(40 + i)) for i in range(60)]


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` by relative path, with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def documents(stream: np.ndarray) -> list[str]:
    """A byte-tokenised stream cut at the newline written after each document."""
    text = bytes(stream.astype(np.uint8).tolist()).decode("utf-8")
    assert text.endswith("\n") or not text
    return text[:-1].split("\n") if text else []


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """The documents as plain files, a ``.jsonl`` and a ``.jsonl.gz`` (and a folder prepare ignores)."""
    root = tmp_path / "corpus"
    (root / "txt").mkdir(parents=True)
    for i, doc in enumerate(DOCS[:20]):
        (root / "txt" / f"{i:02d}.txt").write_text(doc, encoding="utf-8")
    (root / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[20:40]), encoding="utf-8")
    with gzip.open(root / "c.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": d, "id": 1}) + "\n" for d in DOCS[40:])
    (root / "notes.bin").write_bytes(b"\x00\x01")
    return root


def read_folder(path: Path) -> tuple[list[str], list[str]]:
    folder = PreparedFolder(str(path), ByteTokenizer())
    return documents(folder.train.read(0, len(folder.train))), documents(folder.val.read(0, len(folder.val)))


def test_every_document_lands_once_in_its_split_and_in_order(tmp_path: Path, corpus: Path) -> None:
    index = prepare_corpus([str(corpus)], str(tmp_path / "p"), val_fraction=0.2, shard_bytes=2000, progress=False)
    train, val = read_folder(tmp_path / "p")
    in_order = DOCS[20:] + DOCS[:20]  # b.jsonl, c.jsonl.gz, then txt/ (sorted paths)
    assert len(index["shards"]) > 3
    assert train == [d for d in in_order if not held_out(d, 0.2)]
    assert val == [d for d in in_order if held_out(d, 0.2)]
    assert 0 < len(val) < len(DOCS) / 2
    assert index["train_tokens"] + index["val_tokens"] == sum(len(d) + 1 for d in DOCS)


def test_shards_are_byte_identical_for_any_worker_count(tmp_path: Path, corpus: Path) -> None:
    for workers in (1, 2, 3):
        prepare_corpus([str(corpus)], str(tmp_path / f"w{workers}"), workers=workers, shard_bytes=1500, progress=False)
    one = tree(tmp_path / "w1")
    assert len([n for n in one if n.endswith(".train.bin")]) >= 4
    assert tree(tmp_path / "w2") == one
    assert tree(tmp_path / "w3") == one


def test_zstd_jsonl_and_parquet_with_a_named_column(tmp_path: Path) -> None:
    zstandard = pytest.importorskip("zstandard")
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    root = tmp_path / "in"
    root.mkdir()
    lines = "".join(json.dumps({"content": d}) + "\n" for d in DOCS[:10]).encode()
    (root / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    pq.write_table(pa.table({"content": DOCS[10:30], "n": list(range(20))}), root / "b.parquet", row_group_size=7)
    index = prepare_corpus([str(root)], str(tmp_path / "p"), text_field="content", val_fraction=0.0, progress=False)
    assert len(index["shards"]) == 1 + 3  # the zst file, then one shard per row group
    assert read_folder(tmp_path / "p") == (DOCS[:10] + DOCS[10:30], [])


def test_a_rerun_keeps_finished_shards_and_redoes_the_rest(tmp_path: Path, corpus: Path) -> None:
    out = tmp_path / "p"
    prepare_corpus([str(corpus)], str(out), shard_bytes=1500, progress=False)
    whole = tree(out)
    # What a kill -9 leaves: no index, one shard without its record, one cut short.
    os.remove(out / "index.json")
    os.remove(shard_paths(str(out), 1)["meta"])
    with open(shard_paths(str(out), 2)["train"], "r+b") as f:
        f.truncate(10)
    kept = os.stat(shard_paths(str(out), 0)["train"]).st_mtime_ns
    with pytest.raises(ValueError, match=r"data\.folders: the prepare of .* did not finish \(no index\.json\); rerun"):
        PreparedFolder(str(out), ByteTokenizer())
    prepare_corpus([str(corpus)], str(out), shard_bytes=1500, progress=False)
    assert tree(out) == whole
    assert os.stat(shard_paths(str(out), 0)["train"]).st_mtime_ns == kept


def _dies_on_shard_one(index: int, *args: Any) -> dict[str, Any]:
    if index == 1:
        os._exit(9)
    return _REAL_TOKENISE(index, *args)


_REAL_TOKENISE = prepare_module.tokenise_unit


def test_a_worker_that_dies_is_named_and_a_rerun_finishes(tmp_path: Path, corpus: Path, monkeypatch) -> None:
    out = tmp_path / "p"
    monkeypatch.setattr(prepare_module, "tokenise_unit", _dies_on_shard_one)
    with pytest.raises(RuntimeError, match=r"--workers: a worker process died .* rerun the same command to resume"):
        prepare_corpus([str(corpus)], str(out), workers=2, shard_bytes=1500, progress=False)
    assert not (out / "index.json").exists()
    monkeypatch.setattr(prepare_module, "tokenise_unit", _REAL_TOKENISE)
    prepare_corpus([str(corpus)], str(out), workers=2, shard_bytes=1500, progress=False)
    prepare_corpus([str(corpus)], str(tmp_path / "clean"), shard_bytes=1500, progress=False)
    assert tree(out) == tree(tmp_path / "clean")


def test_bad_inputs_are_refused_in_one_line(tmp_path: Path, corpus: Path) -> None:
    (tmp_path / "no_field.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"--text_field: record at .*no_field\.jsonl:2 has no 'text' field"):
        prepare_corpus([str(tmp_path / "no_field.jsonl")], str(tmp_path / "a"), progress=False)
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 this is no parquet file")
    with pytest.raises(ValueError, match=r"SOURCES: .*bad\.parquet' is not a readable parquet file"):
        prepare_corpus([str(tmp_path / "bad.parquet")], str(tmp_path / "b"), progress=False)
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(b'{"text": "abc"}\n' * 50)[:-12])
    with pytest.raises(ValueError, match=r"SOURCES: .*cut\.jsonl\.gz' cannot be read to its end"):
        prepare_corpus([str(tmp_path / "cut.jsonl.gz")], str(tmp_path / "c"), progress=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError, match=r"--out: cannot write to .*; choose a writable folder"):
        prepare_corpus([str(corpus)], str(tmp_path / "file" / "out"), progress=False)
    prepare_corpus([str(corpus / "b.jsonl")], str(tmp_path / "d"), progress=False)
    with pytest.raises(ValueError, match=r"--out: .* holds a prepare of other sources or options"):
        prepare_corpus([str(corpus)], str(tmp_path / "d"), progress=False)
    with pytest.raises(ValueError, match=r"--workers must be >= 1"):
        prepare_corpus([str(corpus)], str(tmp_path / "e"), workers=0)


def test_a_damaged_folder_is_refused_by_name(tmp_path: Path, corpus: Path) -> None:
    out = tmp_path / "p"
    prepare_corpus([str(corpus)], str(out), shard_bytes=1500, val_fraction=0.2, progress=False)
    hf = pytest.importorskip("tokenizers")
    bpe = hf.Tokenizer(hf.models.BPE())
    bpe.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(DOCS, hf.trainers.BpeTrainer(vocab_size=300, show_progress=False))
    bpe.save(str(tmp_path / "bpe.json"))
    from elr_lightning.tokenizers import load_tokenizer

    with pytest.raises(ValueError, match=r"data\.tokenizer: .* was prepared with another tokenizer"):
        PreparedFolder(str(out), load_tokenizer(str(tmp_path / "bpe.json")))
    train = shard_paths(str(out), 2)["train"]
    with open(train, "ab") as f:
        f.write(b"xx")
    with pytest.raises(ValueError, match=r"data\.folders: shard .*00002\.train\.bin' has \d+ bytes, its index says"):
        PreparedFolder(str(out), ByteTokenizer())
    os.remove(train)
    with pytest.raises(FileNotFoundError, match=r"data\.folders: shard .*00002\.train\.bin' listed in the index is missing"):
        PreparedFolder(str(out), ByteTokenizer())
    (out / "index.json").write_text("{")
    with pytest.raises(ValueError, match=r"data\.folders: .*index\.json' is damaged"):
        PreparedFolder(str(out), ByteTokenizer())
    with pytest.raises(ValueError, match=r"is not a prepared folder \(no index\.json\)"):
        PreparedFolder(str(corpus), ByteTokenizer())


@pytest.mark.parametrize("vocab_size", [300, 255, None])
def test_an_index_whose_vocab_size_is_not_the_tokenizers_is_refused(tmp_path: Path, corpus: Path, vocab_size) -> None:
    """The fingerprint matches but ``index.json`` says another vocabulary (an edited or stale index): its ids may
    not fit the model, so the folder is refused in one line naming the field, before any training step."""
    out = tmp_path / "p"
    prepare_corpus([str(corpus)], str(out), shard_bytes=1500, val_fraction=0.2, progress=False)
    index = json.loads((out / "index.json").read_text())
    index["vocab_size"] = vocab_size
    (out / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError) as info:
        PreparedFolder(str(out), ByteTokenizer())
    message = str(info.value)
    assert f"index.json' has vocab_size={vocab_size}" in message and "256" in message and "elr prepare" in message
    assert "\n" not in message


def test_the_command_line(tmp_path: Path, corpus: Path, capsys) -> None:
    main(["prepare", str(corpus / "b.jsonl"), "--out", str(tmp_path / "p"), "--val_fraction", "0"])
    tokens = sum(len(d) + 1 for d in DOCS[20:40])
    assert f"1 shard(s), {tokens} training and 0 validation tokens" in capsys.readouterr().out
    assert read_folder(tmp_path / "p") == (DOCS[20:40], [])
    with pytest.raises(SystemExit) as exit_info:
        main(["prepare", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "q")])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "SOURCES: " in err[0] and "missing.txt' does not exist" in err[0]
