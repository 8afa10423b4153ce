"""``elr prepare`` bounded by ``--shard_mb``: large files cut into spans that workers share, normalised hashing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elr_lightning.data import PreparedFolder, prepare_corpus
from elr_lightning.data.prepare import PREPARED_FORMAT, encode_pieces, held_out, normalised_pieces
from elr_lightning.data.readers import SpanReader, file_spans, plan_units, unit_documents
from elr_lightning.tokenizers import ByteTokenizer
from test_prepare import DOCS, read_folder, tree

TMP = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

LINE = st.text(st.characters(codec="utf-8", exclude_characters="\n\r\x00"), max_size=40)


@TMP
@given(lines=st.lists(LINE, max_size=30), span=st.integers(1, 200), tail=st.booleans())
def test_spans_of_plain_text_cover_the_file_and_end_after_a_line_break(tmp_path: Path, lines, span, tail) -> None:
    data = ("\n".join(lines) + ("\n" if tail else "")).encode("utf-8")
    path = tmp_path / "a.txt"
    path.write_bytes(data)
    spans = file_spans(str(path), span)
    if not data:
        assert spans == []
        return
    assert [s for s, _ in spans] == [0] + [e for _, e in spans[:-1]] and spans[-1][1] == len(data)
    text = b"".join(data[s:e] for s, e in spans).decode("utf-8")  # every cut is on a character boundary
    assert text == data.decode("utf-8")
    for start, end in spans[:-1]:
        at_break = data[end - 1 : end] == b"\n" and b"\n" not in data[start + span - 1 : end - 1]
        assert at_break or (end <= start + span + 3 and b"\n" not in data[start + span - 1 : start + 2 * span])
        assert span <= end - start <= 2 * span + 3


@TMP
@given(records=st.lists(LINE, min_size=1, max_size=25), span=st.integers(1, 300))
def test_a_compressed_file_is_cut_where_the_same_jsonl_uncompressed_is(tmp_path: Path, records, span) -> None:
    zstandard = pytest.importorskip("zstandard")
    data = "".join(json.dumps({"text": r}) + "\n" for r in records).encode()
    (tmp_path / "a.jsonl").write_bytes(data)
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
    spans = file_spans(str(tmp_path / "a.jsonl"), span)
    assert file_spans(str(tmp_path / "a.jsonl.zst"), span) == spans
    reader = SpanReader(str(tmp_path / "a.jsonl.zst"))
    assert b"".join(reader.read(s) for s in spans) == data
    reader.close()
    assert all(data[e - 1 : e] == b"\n" for _, e in spans)  # a record is never cut


@given(st.text(st.sampled_from("ab \t\n\u00a0\u3000é"), max_size=60), st.integers(1, 12))
def test_normalised_pieces_are_the_whitespace_normalised_text(text: str, chars: int) -> None:
    assert "".join(normalised_pieces(text, chars)) == " ".join(text.split())


@given(st.text(st.sampled_from("ab \n\u00e9\U0001f600"), max_size=80), st.integers(1, 9))
def test_pieces_tokenise_to_the_whole_text_under_a_byte_tokenizer(text: str, chars: int) -> None:
    tok = ByteTokenizer()
    pieces = list(encode_pieces(tok, text, chars))
    assert [i for p in pieces for i in p] == tok.encode(text)
    assert all(len(p) <= 4 * chars for p in pieces)


@given(st.lists(st.sampled_from([" ", "\n", "\t", "  ", "\r\n", "\n\n"]), min_size=8, max_size=8))
def test_copies_that_differ_only_in_whitespace_land_on_the_same_side(spaces: list[str]) -> None:
    words = ["def", "f(x):", "return", "x", "+", "1", "#", "done", "."]
    canonical = " ".join(words)
    variant = "".join(w + s for w, s in zip(words, spaces + [""])) + spaces[0]
    for fraction in (0.1, 0.3, 0.5, 0.7, 0.9):
        assert held_out(variant, fraction) == held_out(canonical, fraction)


def test_a_large_text_file_is_shared_by_the_workers_one_document_per_span(tmp_path: Path) -> None:
    text = "".join(d + "\n" for d in DOCS)  # about 20 KB of lines
    (tmp_path / "big.txt").write_text(text, encoding="utf-8")
    units = plan_units([str(tmp_path / "big.txt")], 2000)
    assert len(units) >= 8 and all(u.span is not None and u.size <= 4000 for u in units)
    docs = [d for u in units for d in unit_documents(u, "text")]
    assert "".join(docs) == text and len(docs) == len(units)
    for workers in (1, 2, 3):
        prepare_corpus([str(tmp_path / "big.txt")], str(tmp_path / f"w{workers}"), workers=workers, shard_bytes=2000,
                       val_fraction=0.2, progress=False)
    assert tree(tmp_path / "w2") == tree(tmp_path / "w1") == tree(tmp_path / "w3")
    folder = PreparedFolder(str(tmp_path / "w1"), ByteTokenizer())
    for stream, side in ((folder.train, False), (folder.val, True)):  # each span a document, then the separator
        assert stream.read(0, len(stream)).astype(np.uint8).tobytes().decode() == "".join(
            d + "\n" for d in docs if held_out(d, 0.2) == side
        )
    assert folder.index["train_tokens"] and folder.index["val_tokens"]


def test_a_compressed_file_is_shared_by_the_workers_and_resumes(tmp_path: Path) -> None:
    zstandard = pytest.importorskip("zstandard")
    data = "".join(json.dumps({"text": d}) + "\n" for d in DOCS).encode()
    (tmp_path / "big.jsonl.zst").write_bytes(zstandard.ZstdCompressor(level=1).compress(data))
    assert os.path.getsize(tmp_path / "big.jsonl.zst") > 1000
    for workers in (1, 2):
        prepare_corpus([str(tmp_path / "big.jsonl.zst")], str(tmp_path / f"w{workers}"), workers=workers,
                       shard_bytes=1000, val_fraction=0.2, progress=False)
    whole = tree(tmp_path / "w1")
    assert tree(tmp_path / "w2") == whole and len([n for n in whole if n.endswith(".train.bin")]) > 10
    train, val = read_folder(tmp_path / "w1")
    assert train == [d for d in DOCS if not held_out(d, 0.2)] and val == [d for d in DOCS if held_out(d, 0.2)]
    os.remove(tmp_path / "w2" / "index.json")  # what a kill -9 leaves: shards of every other span gone
    for shard in sorted((tmp_path / "w2" / "shards").glob("*.json"))[::2]:
        shard.unlink()
    prepare_corpus([str(tmp_path / "big.jsonl.zst")], str(tmp_path / "w2"), workers=2, shard_bytes=1000,
                   val_fraction=0.2, progress=False)
    assert tree(tmp_path / "w2") == whole


def test_folders_of_the_older_layout_train_and_their_unfinished_prepare_is_refused(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("".join(d + "\n" for d in DOCS[:5]), encoding="utf-8")
    out = tmp_path / "p"
    prepare_corpus([str(tmp_path / "a.txt")], str(out), val_fraction=0.0, progress=False)
    for name in ("index.json", "plan.json"):
        meta = json.loads((out / name).read_text())
        assert meta["format"] == PREPARED_FORMAT == 2
        (out / name).write_text(json.dumps({**meta, "format": 1}))
    folder = PreparedFolder(str(out), ByteTokenizer())  # an older folder still trains
    assert np.array_equal(folder.train.read(0, 5), np.frombuffer(b"doc 0", np.uint8))
    with pytest.raises(ValueError, match=r"holds a finished prepare of another version \(layout 1, this one writes 2\); "
                                         r"train on it as it is"):
        prepare_corpus([str(tmp_path / "a.txt")], str(out), val_fraction=0.0, progress=False)
    (out / "index.json").unlink()
    with pytest.raises(ValueError, match=r"holds an? unfinished prepare of another version .* finish it with that version"):
        prepare_corpus([str(tmp_path / "a.txt")], str(out), val_fraction=0.0, progress=False)
    meta = json.loads((out / "plan.json").read_text())
    (out / "plan.json").write_text(json.dumps({**meta, "format": 3}))
    (out / "index.json").write_text(json.dumps({"format": 3, "shards": [], "dtype": "uint16"}))
    with pytest.raises(ValueError, match=r"has layout 3, this version reads \[1, 2\]; prepare it again"):
        PreparedFolder(str(out), ByteTokenizer())
