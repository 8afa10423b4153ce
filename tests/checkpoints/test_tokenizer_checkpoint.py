"""The training tokenizer travels with the checkpoint: saved on fit, rebuilt on load, used by ``elr generate``."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from _bpe import stdlib_text, train_bpe
from conftest import fit_two_steps
from elr_lightning.cli import main, run
from elr_lightning.config import ModelConfig
from elr_lightning.data import TextDataModule
from elr_lightning.inference.generate import generate, load_model
from elr_lightning.module import ELRModule
from elr_lightning.checkpoints.tokenizer import checkpoint_tokenizer, choose_tokenizer, tokenizer_from_state, tokenizer_state
from elr_lightning.tokenizers import ByteTokenizer, HFTokenizer, load_tokenizer

pytest.importorskip("tokenizers")
pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 400
ARCH = ModelConfig(vocab_size=VOCAB, d_model=32, n_heads=2, n_in=1, n_rec=1, n_out=1, max_seq_len=64, max_loops=3)


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_bpe(tmp_path_factory.mktemp("bpe") / "tokenizer.json", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def bpe_checkpoint(tmp_path_factory: pytest.TempPathFactory, bpe_path: Path) -> tuple[Path, str]:
    """A checkpoint trained 2 steps with the BPE data module; the tokenizer file is deleted afterwards."""
    root = tmp_path_factory.mktemp("bpe_fit")
    tok_path = root / "tokenizer.json"
    tok_path.write_bytes(bpe_path.read_bytes())
    corpus = root / "corpus.txt"
    corpus.write_text(stdlib_text(20_000), encoding="utf-8")
    data = TextDataModule(sources=[str(corpus)], tokenizer=str(tok_path), seq_len=16, batch_size=4,
                          cache_dir=str(root / "cache"), val_batches=1)  # fmt: skip
    torch.manual_seed(0)
    module = ELRModule(arch=ARCH, warmup_steps=0)
    path = fit_two_steps(module, data, root / "bpe.ckpt")
    fingerprint = data.tokenizer.fingerprint()
    tok_path.unlink()  # the checkpoint must not need the file
    return path, fingerprint


@given(st.text(max_size=200))
def test_state_round_trip_is_json_and_encodes_alike(text: str) -> None:
    for tok in (ByteTokenizer(), _BPE[0]):
        state = json.loads(json.dumps(tokenizer_state(tok)))
        rebuilt = tokenizer_from_state(state)
        assert type(rebuilt) is type(tok) and rebuilt.fingerprint() == tok.fingerprint()
        assert rebuilt.vocab_size == tok.vocab_size and rebuilt.eos_id == tok.eos_id
        assert rebuilt.encode(text) == tok.encode(text)
        assert torch.equal(rebuilt.token_bytes(), tok.token_bytes())


_BPE: list[HFTokenizer] = []


@pytest.fixture(scope="module", autouse=True)
def _bpe_for_hypothesis(bpe_path: Path) -> None:
    _BPE[:] = [load_tokenizer(str(bpe_path))]


def test_state_holds_the_file_contents_not_its_path(bpe_path: Path) -> None:
    state = tokenizer_state(load_tokenizer(str(bpe_path)))
    assert state["kind"] == "hf" and state["tokenizer_json"] == bpe_path.read_text(encoding="utf-8")
    assert str(bpe_path) not in json.dumps({k: v for k, v in state.items() if k != "tokenizer_json"})


def test_bad_states_are_refused() -> None:
    state = tokenizer_state(ByteTokenizer())
    with pytest.raises(ValueError, match="unknown kind 'sentencepiece'"):
        tokenizer_from_state({**state, "kind": "sentencepiece"})
    with pytest.raises(ValueError, match="fingerprint"):
        tokenizer_from_state({**state, "fingerprint": "0" * 64})
    with pytest.raises(ValueError, match="format"):
        tokenizer_from_state({**state, "format": 99})


def test_fit_saves_the_tokenizer_and_load_restores_it(bpe_checkpoint: tuple[Path, str]) -> None:
    path, fingerprint = bpe_checkpoint
    raw = torch.load(path, weights_only=True)
    saved = checkpoint_tokenizer(raw)
    assert isinstance(saved, HFTokenizer) and saved.fingerprint() == fingerprint and saved.vocab_size == VOCAB
    _, module = load_model(str(path))
    assert module.tokenizer is not None and module.tokenizer.fingerprint() == fingerprint


def test_old_checkpoint_has_no_tokenizer_and_generate_falls_back_to_bytes(
    bpe_checkpoint: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    raw = torch.load(bpe_checkpoint[0], weights_only=True)
    del raw["elr"]["tokenizer"]
    assert checkpoint_tokenizer(raw) is None and checkpoint_tokenizer({"state_dict": {}}) is None
    old = tmp_path / "old.ckpt"
    torch.save(raw, old)
    main(["generate", "--ckpt_path", str(old), "--prompt", "def ", "--max_new_tokens", "5", "--temperature", "0"])
    model, module = load_model(str(old))
    assert module.tokenizer is None
    expected = generate(model, [list(b"def ")], max_new_tokens=5, greedy=True).new_tokens[0].tolist()
    assert capsys.readouterr().out == "def " + ByteTokenizer().decode(expected) + "\n"


def test_generate_decodes_with_the_saved_tokenizer(
    bpe_checkpoint: tuple[Path, str], bpe_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path = str(bpe_checkpoint[0])
    main(["generate", "--ckpt_path", path, "--prompt", "def __init__(self", "--max_new_tokens", "6",
          "--temperature", "0", "--loops", "2"])  # fmt: skip
    bpe = load_tokenizer(str(bpe_path))
    model, _ = load_model(path)
    prompt = bpe.encode("def __init__(self")
    assert len(prompt) < len("def __init__(self")  # merges happened: bytes would be a different prompt
    new = generate(model, [prompt], loops=2, max_new_tokens=6, greedy=True, eos_id=bpe.eos_id).new_tokens[0]
    ids = [int(t) for t in new]
    if bpe.eos_id in ids:
        ids = ids[: ids.index(bpe.eos_id)]
    assert capsys.readouterr().out == "def __init__(self" + bpe.decode(ids) + "\n"


def test_tokenizer_override_must_fit_the_embedding(bpe_checkpoint: tuple[Path, str], tmp_path: Path) -> None:
    big = train_bpe(tmp_path / "big.json", vocab_size=VOCAB + 50)
    with pytest.raises(ValueError, match=rf"--tokenizer .* has {VOCAB + 50} ids .* arch.vocab_size is {VOCAB}"):
        run(["generate", "--ckpt_path", str(bpe_checkpoint[0]), "--prompt", "x", "--tokenizer", str(big)])
    saved = load_tokenizer(str(big))
    with pytest.warns(UserWarning, match="not the tokenizer this checkpoint was trained with"):
        assert isinstance(choose_tokenizer(saved, "byte", VOCAB), ByteTokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choose_tokenizer(saved, None, VOCAB + 50) is saved
        assert isinstance(choose_tokenizer(None, None, 256), ByteTokenizer)
