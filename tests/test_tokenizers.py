"""Tests of the tokenizer seam: byte tokenizer, HF tokenizer files, load_tokenizer."""

import json
import os
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elr_lightning.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

hf = pytest.importorskip("tokenizers")


def _stdlib_text(limit: int = 12_000) -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts = [(stdlib / name).read_text(encoding="utf-8") for name in ("textwrap.py", "json/decoder.py", "bisect.py")]
    return "\n".join(parts)[:limit]


def _train_bpe(path: Path, *, specials: list[str], vocab_size: int = 400) -> Path:
    tok = hf.Tokenizer(hf.models.BPE())
    tok.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = hf.decoders.ByteLevel()
    trainer = hf.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_stdlib_text(), "héllo wörld ✓ 日本語 🙂"], trainer=trainer)
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _train_bpe(tmp_path_factory.mktemp("bpe") / "tokenizer.json", specials=["<pad>", "<|endoftext|>"])


@pytest.fixture(scope="module")
def bpe(bpe_path: Path) -> Tokenizer:
    return load_tokenizer(str(bpe_path))


@given(st.text())
def test_byte_roundtrip_and_token_bytes(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert int(tok.token_bytes()[torch.tensor(ids, dtype=torch.long)].sum()) == len(text.encode("utf-8"))


@given(st.text(), st.lists(st.integers(256, 2**20), min_size=1, max_size=4), st.integers(0, 10**6))
def test_byte_decode_turns_ids_beyond_the_bytes_into_replacement_characters(
    text: str, extra: list[int], at: int
) -> None:
    """A model with more than 256 ids can sample a non-byte; decoding shows U+FFFD instead of failing."""
    tok = ByteTokenizer()
    ids = tok.encode(text)
    cut = at % (len(ids) + 1)
    decoded = tok.decode(ids[:cut] + extra + ids[cut:])
    assert decoded == tok.decode(ids[:cut]) + "\ufffd" * len(extra) + tok.decode(ids[cut:])


def test_byte_tokenizer_contract() -> None:
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer)
    assert tok.vocab_size == 256
    assert tok.eos_id is None
    tb = tok.token_bytes()
    assert tb.dtype == torch.int64 and tb.shape == (256,) and bool((tb == 1).all())
    assert tok.decode([0xFF, 0x41]) == "\ufffdA"
    assert tok.fingerprint() == ByteTokenizer().fingerprint()


def test_hf_contract(bpe: Tokenizer, bpe_path: Path) -> None:
    assert isinstance(bpe, HFTokenizer)
    vocab = json.loads(bpe_path.read_text())["model"]["vocab"]
    assert bpe.vocab_size == max(vocab.values()) + 1
    assert bpe.eos_id == vocab["<|endoftext|>"]
    tb = bpe.token_bytes()
    assert tb.dtype == torch.int64 and tb.shape == (bpe.vocab_size,)
    assert int(tb[bpe.eos_id]) == 0 and int(tb[vocab["<pad>"]]) == 0
    assert int(tb.max()) > 1  # merges stand for several bytes
    assert bpe.fingerprint() == load_tokenizer(str(bpe_path)).fingerprint()
    assert bpe.fingerprint() != ByteTokenizer().fingerprint()
    assert isinstance(load_tokenizer(str(bpe_path.parent)), HFTokenizer)


@settings(max_examples=60, deadline=None)
@given(st.text())
def test_hf_roundtrip_and_token_bytes(bpe: Tokenizer, text: str) -> None:
    ids = bpe.encode(text)
    assert bpe.decode(ids) == text
    assert int(bpe.token_bytes()[torch.tensor(ids, dtype=torch.long)].sum()) == len(text.encode("utf-8"))


def test_hf_token_bytes_match_pieces(bpe: Tokenizer) -> None:
    text = _stdlib_text(3000) + " héllo wörld ✓ 🙂"
    ids = bpe.encode(text)
    tb = bpe.token_bytes()
    assert len(ids) < len(text.encode("utf-8"))  # the BPE actually merged
    for i in set(ids):
        piece = bpe.decode([i])
        if "\ufffd" not in piece:  # whole characters: the decoded piece has exactly that many bytes
            assert int(tb[i]) == len(piece.encode("utf-8"))


def test_hf_without_eos(tmp_path: Path) -> None:
    tok = load_tokenizer(str(_train_bpe(tmp_path / "tokenizer.json", specials=[])))
    assert tok.eos_id is None
    assert tok.decode(tok.encode("def f(x):\n    return x")) == "def f(x):\n    return x"


def test_hf_fingerprint_tracks_vocabulary(tmp_path: Path, bpe: Tokenizer) -> None:
    other = load_tokenizer(str(_train_bpe(tmp_path / "tokenizer.json", specials=["</s>"], vocab_size=350)))
    assert other.fingerprint() != bpe.fingerprint()
    assert other.eos_id is not None and other.decode([other.eos_id]) == "</s>"


def test_load_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="data.tokenizer.*does not exist"):
        load_tokenizer(str(tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        HFTokenizer(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="data.tokenizer"):
        load_tokenizer("")
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a tokenizer"}')
    with pytest.raises(ValueError, match="data.tokenizer.*not a valid"):
        load_tokenizer(str(bad))
    with pytest.raises(FileNotFoundError, match="data.tokenizer"):
        load_tokenizer(str(tmp_path))  # a directory without tokenizer.json


def test_missing_tokenizers_package(monkeypatch: pytest.MonkeyPatch, bpe_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match=r'pip install "elr-lightning\[hf\]"'):
        HFTokenizer(os.fspath(bpe_path))
