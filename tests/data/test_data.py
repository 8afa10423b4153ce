"""Tests of the text data module: corpus resolution, token cache, split, resumable loader."""

import json
import os
import sysconfig
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning.pytorch.callbacks import ModelCheckpoint

from elr_lightning.data import (
    StepIndexedLoader,
    StepLoader,
    TextDataModule,
    TokenWindows,
    default_corpus_files,
    resolve_sources,
    token_dtype,
)
from elr_lightning.tokenizers import ByteTokenizer
from conftest import quiet_trainer

# No two windows of these documents are equal: every few bytes carry a distinct number.
DOCS = [
    "".join(f"a{i} b\n" for i in range(80)),
    "".join(f"r{i}=x+{i}\n" for i in range(60)),
    "".join(f"héllo ✓{i} " for i in range(50)),
]


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text(DOCS[0], encoding="utf-8")
    (root / "sub" / "b.py").write_text(DOCS[1], encoding="utf-8")
    (root / "sub" / "c.md").write_text(DOCS[2], encoding="utf-8")
    (root / "ignored.bin").write_bytes(b"\x00\x01")
    (root / ".hidden").mkdir()
    (root / ".hidden" / "d.txt").write_text("hidden", encoding="utf-8")
    return root


def make_dm(tmp_path: Path, **kwargs: Any) -> TextDataModule:
    kwargs.setdefault("cache_dir", str(tmp_path / "cache"))
    return TextDataModule(**kwargs)


def _train_bpe(path: Path) -> Path:
    hf = pytest.importorskip("tokenizers")
    tok = hf.Tokenizer(hf.models.BPE())
    tok.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = hf.decoders.ByteLevel()
    trainer = hf.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(DOCS, trainer=trainer)
    tok.save(str(path))
    return path


def test_arguments_validate_from_type_hints() -> None:
    from jsonargparse import ArgumentError, ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(TextDataModule, "data")
    cfg = parser.parse_args(["--data.sources", "[a.txt, 'b/*.py']", "--data.seq_len", "64", "--data.max_bytes", "9"])
    assert cfg.data.sources == ["a.txt", "b/*.py"] and cfg.data.seq_len == 64 and cfg.data.max_bytes == 9
    with pytest.raises(ArgumentError, match="data.seq_len"):
        parser.parse_args(["--data.seq_len", "abc"])


# --- corpus -----------------------------------------------------------------------------------


def test_default_corpus_is_stdlib_without_tests() -> None:
    files = default_corpus_files()
    root = os.path.realpath(sysconfig.get_paths()["stdlib"])
    assert len(files) > 100
    assert files == default_corpus_files()
    rel = [os.path.relpath(os.path.realpath(f), root).split(os.sep) for f in files]
    assert rel == sorted(rel)
    assert all(f.endswith(".py") for f in files)
    banned = {"test", "tests", "idle_test", "site-packages"}
    assert not any(banned & set(parts[:-1]) for parts in rel)
    assert ["os.py"] in rel and ["json", "decoder.py"] in rel


def test_directory_and_glob_sources(corpus: Path) -> None:
    files = resolve_sources([str(corpus)])
    expected = ["a.txt", os.path.join("sub", "b.py"), os.path.join("sub", "c.md")]
    assert [os.path.relpath(f, corpus) for f in files] == expected
    globbed = resolve_sources([str(corpus / "**" / "*.py"), str(corpus / "a.txt"), str(corpus / "a.txt")])
    assert globbed == [str(corpus / "sub" / "b.py"), str(corpus / "a.txt")]


def test_one_source_may_be_given_without_a_list(tmp_path: Path, corpus: Path) -> None:
    """``--data.init_args.sources corpus/`` used to fail in the parser with "Expected a <class 'list'>"."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(TextDataModule, "data")
    assert parser.parse_args(["--data.sources", str(corpus)]).data.sources == str(corpus)
    assert parser.parse_args(["--data.sources", f"[{corpus}]"]).data.sources == [str(corpus)]
    assert resolve_sources(str(corpus)) == resolve_sources([str(corpus)])
    assert resolve_sources(str(corpus / "*.txt")) == [str(corpus / "a.txt")]
    dm = make_dm(tmp_path, sources=str(corpus), seq_len=8, batch_size=2)
    dm.setup("fit")
    assert next(iter(dm.train_dataloader())).shape == (2, 9)


def test_default_corpus_module_reads_stdlib_in_order(tmp_path: Path) -> None:
    dm = make_dm(tmp_path, seq_len=64, max_bytes=30_000, batch_size=2)
    dm.prepare_data()
    dm.setup("fit")
    assert dm.tokens is not None and len(dm.tokens) >= 30_000
    first = Path(default_corpus_files()[0]).read_bytes()
    assert len(first) < 30_000
    assert bytes(dm.tokens[: len(first)]) == first  # the first document, then the newline separator
    assert dm.tokens[len(first)] == ord("\n")
    assert dm.vocab_size == 256 and bool((dm.token_bytes == 1).all())


# --- cache ------------------------------------------------------------------------------------


def test_cache_reused_and_keyed(tmp_path: Path, corpus: Path) -> None:
    dm = make_dm(tmp_path, sources=[str(corpus)], seq_len=16)
    dm.prepare_data()
    bin_path, json_path = dm.cache_paths()
    mtimes = (os.stat(bin_path).st_mtime_ns, os.stat(json_path).st_mtime_ns)
    make_dm(tmp_path, sources=[str(corpus)], seq_len=32).prepare_data()  # seq_len is not part of the key
    assert (os.stat(bin_path).st_mtime_ns, os.stat(json_path).st_mtime_ns) == mtimes
    assert sorted(os.listdir(tmp_path / "cache")) == sorted([os.path.basename(bin_path), os.path.basename(json_path)])

    meta = json.loads(Path(json_path).read_text())
    expected = "".join(DOCS[0] + "\n" + DOCS[1] + "\n" + DOCS[2]).encode()
    assert meta["tokenizer_fingerprint"] == ByteTokenizer().fingerprint()
    assert meta["dtype"] == "uint8" and meta["num_tokens"] == len(expected)
    assert meta["sources"] == resolve_sources([str(corpus)])
    assert os.path.basename(bin_path).startswith("tokens-" + meta["key"][:20])
    assert Path(bin_path).read_bytes() == expected

    hf_dm = make_dm(tmp_path, sources=[str(corpus)], tokenizer=str(_train_bpe(tmp_path / "tok.json")))
    hf_dm.prepare_data()
    hf_bin, hf_json = hf_dm.cache_paths()
    assert hf_bin != bin_path
    hf_meta = json.loads(Path(hf_json).read_text())
    assert hf_meta["dtype"] == "uint16" and hf_meta["num_tokens"] < meta["num_tokens"]
    assert hf_meta["separator"] == [hf_dm.tokenizer.eos_id]

    for changed in (make_dm(tmp_path, sources=[str(corpus)], max_bytes=100),
                    make_dm(tmp_path, sources=[str(corpus / "a.txt")])):
        assert changed.cache_paths()[0] != bin_path
    (corpus / "a.txt").write_text(DOCS[0] + "more", encoding="utf-8")
    assert dm.cache_paths()[0] != bin_path


def test_cache_rebuilt_when_incomplete(tmp_path: Path, corpus: Path) -> None:
    dm = make_dm(tmp_path, sources=[str(corpus)])
    dm.prepare_data()
    bin_path, json_path = dm.cache_paths()
    good = Path(bin_path).read_bytes()
    Path(bin_path).write_bytes(good[:10])  # a shard cut short: size no longer matches the sidecar
    dm.prepare_data()
    assert Path(bin_path).read_bytes() == good
    os.remove(json_path)  # shard without sidecar: a prepare killed between the two writes
    dm.prepare_data()
    assert os.path.exists(json_path) and Path(bin_path).read_bytes() == good


def test_failed_prepare_leaves_no_cache(tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dm = make_dm(tmp_path, sources=[str(corpus)])
    calls = []

    def flaky_encode(text: str) -> list[int]:
        calls.append(text)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return list(text.encode())

    monkeypatch.setattr(dm.tokenizer, "encode", flaky_encode)
    with pytest.raises(KeyboardInterrupt):
        dm.prepare_data()
    assert os.listdir(tmp_path / "cache") == []


# --- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"seq_len": 0}, ValueError, "data.seq_len"),
        ({"batch_size": 0}, ValueError, "data.batch_size"),
        ({"val_fraction": 0.0}, ValueError, "data.val_fraction.*trainer.limit_val_batches: 0"),
        ({"val_fraction": 1.0}, ValueError, "data.val_fraction"),
        ({"max_bytes": 0}, ValueError, "data.max_bytes"),
        ({"val_batches": 0}, ValueError, "data.val_batches"),
        ({"tokenizer": "no/such/tokenizer.json"}, FileNotFoundError, "data.tokenizer"),
    ],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        make_dm(tmp_path, **kwargs)


def test_bad_sources(tmp_path: Path, corpus: Path) -> None:
    with pytest.raises(FileNotFoundError, match="data.sources: '.*nope' does not exist"):
        make_dm(tmp_path, sources=[str(corpus / "nope")]).prepare_data()
    with pytest.raises(ValueError, match="data.sources: pattern .* matches no files"):
        make_dm(tmp_path, sources=[str(corpus / "*.rst")]).prepare_data()
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError, match="data.sources: directory .* holds no"):
        make_dm(tmp_path, sources=[str(tmp_path / "empty_dir")]).prepare_data()
    with pytest.raises(ValueError, match="data.sources is an empty list"):
        make_dm(tmp_path, sources=[]).prepare_data()
    (tmp_path / "e1.txt").write_text("")
    (tmp_path / "e2.txt").write_text("")
    with pytest.raises(ValueError, match="data.sources: .* contain no text"):
        make_dm(tmp_path, sources=[str(tmp_path / "e1.txt"), str(tmp_path / "e2.txt")]).prepare_data()
    assert [p for p in os.listdir(tmp_path / "cache") if p.endswith(".bin")] == []


def test_corpus_too_short(tmp_path: Path, corpus: Path) -> None:
    with pytest.raises(ValueError, match="data.seq_len.*data.val_fraction"):
        make_dm(tmp_path, sources=[str(corpus)], seq_len=100_000).setup("fit")
    dm = make_dm(tmp_path, sources=[str(corpus)], seq_len=64, batch_size=1000)
    dm.setup("fit")
    with pytest.raises(ValueError, match="data.batch_size"):
        dm.train_dataloader()


def test_tokenizer_ids_must_fit(tmp_path: Path, corpus: Path) -> None:
    assert [token_dtype(v).name for v in (2, 256, 257, 65536, 65537, 2**31)] == [
        "uint8", "uint8", "uint16", "uint16", "int32", "int32"]
    with pytest.raises(ValueError, match="data.tokenizer"):
        token_dtype(2**31 + 1)

    class Liar(ByteTokenizer):
        def encode(self, text: str) -> list[int]:
            return [300]

    dm = make_dm(tmp_path, sources=[str(corpus)])
    dm.tokenizer = Liar()
    with pytest.raises(ValueError, match="data.tokenizer: produced id 300"):
        dm.prepare_data()


# --- JSONL ------------------------------------------------------------------------------------


def test_jsonl_sources(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text('{"body": "first doc", "id": 1}\n\n{"body": "second"}\n', encoding="utf-8")
    dm = make_dm(tmp_path, sources=[str(path)], text_field="body", seq_len=2, val_fraction=0.2)
    dm.setup("fit")
    assert dm.tokens is not None and bytes(dm.tokens) == b"first doc\nsecond"

    path.write_text('{"body": "ok"}\n{"body": "ok"}\n{"text": "wrong key"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"data.text_field: record at .*docs.jsonl:3 has no 'body' field"):
        make_dm(tmp_path, sources=[str(path)], text_field="body").prepare_data()
    path.write_text('{"body": 5}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"data.text_field: 'body' at .*:1 is a int"):
        make_dm(tmp_path, sources=[str(path)], text_field="body").prepare_data()
    path.write_text('{"body": "x"}\nnot json\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"data.sources: .*docs.jsonl:2 is not valid JSON"):
        make_dm(tmp_path, sources=[str(path)], text_field="body").prepare_data()


# --- split and batches ------------------------------------------------------------------------


def test_split_and_batches(tmp_path: Path, corpus: Path) -> None:
    seq_len, batch_size = 16, 3
    dm = make_dm(tmp_path, sources=[str(corpus)], seq_len=seq_len, batch_size=batch_size, val_fraction=0.1)
    dm.setup("fit")
    assert dm.tokens is not None and dm.train_windows is not None and dm.val_windows is not None
    n_windows = (len(dm.tokens) - 1) // seq_len
    n_val = max(1, round(0.1 * n_windows))
    assert (len(dm.train_windows), len(dm.val_windows)) == (n_windows - n_val, n_val)
    train_ids = set(range(dm.train_windows.start, dm.train_windows.stop))
    val_ids = set(range(dm.val_windows.start, dm.val_windows.stop))
    assert not train_ids & val_ids and train_ids | val_ids == set(range(n_windows))

    stream = torch.from_numpy(np.asarray(dm.tokens, dtype=np.int64))
    by_content = {tuple(stream[w * seq_len : w * seq_len + seq_len + 1].tolist()): w for w in range(n_windows)}
    loader = dm.train_dataloader()
    seen = []
    for batch in loader:
        assert batch.dtype == torch.int64 and batch.shape == (batch_size, seq_len + 1)
        seen += [by_content[tuple(row.tolist())] for row in batch]
    assert len(seen) == len(set(seen)) == len(loader) * batch_size and set(seen) <= train_ids

    val = list(dm.val_dataloader())
    assert all(b.shape[1] == seq_len + 1 for b in val)
    assert [by_content[tuple(row.tolist())] for b in val for row in b] == sorted(val_ids)
    capped = make_dm(tmp_path, sources=[str(corpus)], seq_len=4, batch_size=2, val_fraction=0.5, val_batches=3)
    capped.setup("validate")
    assert [b.shape for b in capped.val_dataloader()] == [(2, 5)] * 3


def test_rank_slices(tmp_path: Path, corpus: Path) -> None:
    loaders = []
    for rank in (0, 1):
        dm = make_dm(tmp_path, sources=[str(corpus)], seq_len=8, batch_size=2, seed=3)
        dm.setup("fit")
        dm.trainer = SimpleNamespace(global_rank=rank, world_size=2)  # type: ignore[assignment]
        loaders.append(dm.train_dataloader())
    single = StepIndexedLoader(loaders[0].windows, batch_size=4, seed=3)
    assert len(loaders[0]) == len(loaders[1]) == len(single)
    for b0, b1, both in zip(loaders[0], loaders[1], single):
        assert torch.equal(torch.cat([b0, b1]), both)


# --- step-indexed loader ----------------------------------------------------------------------


def _windows(n_windows: int, seq_len: int = 3) -> TokenWindows:
    return TokenWindows(np.arange(n_windows * seq_len + 1, dtype=np.int64), seq_len, 0, n_windows)


def _take(loader: StepLoader, n: int) -> list[torch.Tensor]:
    """Take n batches, iterating again (next epoch) whenever an epoch ends."""
    out: list[torch.Tensor] = []
    while len(out) < n:
        for batch in loader:
            out.append(batch)
            if len(out) == n:
                break
    return out


@settings(max_examples=60, deadline=None)
@given(
    n_windows=st.integers(1, 30),
    batch_size=st.integers(1, 4),
    world_size=st.integers(1, 3),
    seed=st.integers(0, 2**32),
    data=st.data(),
)
def test_loader_resumes_exactly(n_windows: int, batch_size: int, world_size: int, seed: int, data: Any) -> None:
    windows = _windows(n_windows)
    rank = data.draw(st.integers(0, world_size - 1))

    def make() -> StepIndexedLoader:
        return StepIndexedLoader(windows, batch_size, seed=seed, rank=rank, world_size=world_size)

    per_epoch = len(make())
    if per_epoch == 0:
        assert n_windows < batch_size * world_size
        return
    n = data.draw(st.integers(0, 3 * per_epoch))
    more = data.draw(st.integers(1, 2 * per_epoch + 1))
    reference = _take(make(), n + more)
    assert all(torch.equal(a, b) for a, b in zip(reference, _take(make(), n + more)))
    for batch in reference:  # windows are consecutive slices of the stream, starting at multiples of T
        assert batch.shape == (batch_size, 4)
        assert bool((batch[:, 1:] - batch[:, :-1] == 1).all()) and bool((batch[:, 0] % 3 == 0).all())

    first = make()
    _take(first, n)
    state = first.state_dict()
    epoch = (n - 1) // per_epoch if n > 0 else 0  # a finished epoch stays current until iterated again
    assert (state["epoch"], state["position"]) == (epoch, n - epoch * per_epoch)
    resumed = make()
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert all(torch.equal(a, b) for a, b in zip(_take(resumed, more), reference[n:], strict=True))


@settings(max_examples=30, deadline=None)
@given(
    n_windows=st.integers(2, 40), batch_size=st.integers(1, 3), world_size=st.integers(1, 3), seed=st.integers(0, 99)
)
def test_loader_epochs_partition_windows(n_windows: int, batch_size: int, world_size: int, seed: int) -> None:
    windows = _windows(n_windows)
    ranks = [StepIndexedLoader(windows, batch_size, seed, rank, world_size) for rank in range(world_size)]
    for _epoch in range(2):
        starts = [int(b[i, 0]) // 3 for loader in ranks for b in loader for i in range(batch_size)]
        assert len(starts) == len(set(starts)) == len(ranks[0]) * batch_size * world_size
        assert len(starts) > n_windows - batch_size * world_size


def test_loader_rejects_foreign_state() -> None:
    loader = StepIndexedLoader(_windows(20), 2, seed=1)
    for key, value in (("seed", 2), ("global_batch_size", 4), ("num_windows", 19)):
        state = {**loader.state_dict(), key: value}
        with pytest.raises(ValueError, match=f"{key}="):
            StepIndexedLoader(_windows(20), 2, seed=1).load_state_dict(state)
    epochs = [[row for b in loader for row in b.tolist()] for _ in range(2)]
    assert epochs[0] != epochs[1] and sorted(epochs[0]) == sorted(epochs[1])  # same windows, new order


# --- a real Trainer: checkpoint and resume ------------------------------------------------------


class Recorder(pl.LightningModule):
    """Trains a single scalar on the batch mean; records the first column of every batch."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[tuple[int, ...]] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.seen.append(tuple(batch[:, 0].tolist()))
        return (self.weight - batch.float().mean() / 256) ** 2

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val", (self.weight - batch.float().mean() / 256) ** 2)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def resume_trainer(tmp_path: Path, max_steps: int, ckpt_dir: Optional[Path], **kwargs: Any) -> pl.Trainer:
    """A quiet one-device trainer that checkpoints every step into ``ckpt_dir`` (none if ``None``)."""
    callbacks = [] if ckpt_dir is None else [
        ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    ]
    return quiet_trainer(
        max_steps=max_steps, devices=1, enable_checkpointing=ckpt_dir is not None, callbacks=callbacks,
        num_sanity_val_steps=0, default_root_dir=tmp_path, **kwargs,
    )


def _fit(tmp_path: Path, corpus: Path, max_steps: int, ckpt_dir: Optional[Path], ckpt_path: Optional[str]) -> list:
    trainer = resume_trainer(tmp_path, max_steps, ckpt_dir)
    # 18 train windows of 8 + 1 tokens, 2 validation windows: 4 batches of 4 per epoch
    dm = make_dm(tmp_path, sources=[str(corpus)], seq_len=8, batch_size=4, val_fraction=0.1, max_bytes=8 * 20 + 1)
    model = Recorder()
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    assert trainer.global_step == max_steps
    return model.seen


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_lightning_resume_is_exact(tmp_path: Path, corpus: Path) -> None:
    ckpts = tmp_path / "ckpts"
    full = _fit(tmp_path, corpus, 10, ckpts, None)
    assert len(full) == 10 and len(set(full[:4])) == 4 and full[:4] != full[4:8]  # epochs differ
    for step in (3, 4, 6):  # mid-epoch, at the epoch boundary, mid-way through the second epoch
        resumed = _fit(tmp_path, corpus, 10, None, str(ckpts / f"step={step}.ckpt"))
        assert resumed == full[step:], f"resume from step {step}"


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"\x7fELF\x02\x01\x01\x00\x00\x00 an executable", r"'.*prog' is not a text file \(NUL byte at offset 7\)"),
        (b"caf\xe9 au lait", r"'.*prog' is not UTF-8 text \(byte 3"),
    ],
)
def test_binary_or_non_utf8_sources_are_refused_by_name(
    tmp_path: Path, corpus: Path, content: bytes, match: str
) -> None:
    (tmp_path / "prog").write_bytes(content)
    dm = make_dm(tmp_path, sources=[str(corpus / "a.txt"), str(tmp_path / "prog")])
    with pytest.raises(ValueError, match=match):
        dm.prepare_data()
    assert [p for p in os.listdir(tmp_path / "cache") if p.endswith((".bin", ".json"))] == []


def test_an_edit_that_keeps_size_and_mtime_is_not_served_from_the_cache(tmp_path: Path) -> None:
    source = tmp_path / "doc.txt"
    source.write_text("".join(f"old line {i}\n" for i in range(200)))
    stat = source.stat()
    dm = make_dm(tmp_path, sources=[str(source)], seq_len=16, batch_size=2)
    dm.setup()
    before = ByteTokenizer().decode(np.asarray(dm.tokens).tolist())
    source.write_text(before.replace("old", "new"))  # same size
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same mtime, as `cp -p` or a restore leaves it
    dm = make_dm(tmp_path, sources=[str(source)], seq_len=16, batch_size=2)
    dm.setup()
    after = ByteTokenizer().decode(np.asarray(dm.tokens).tolist())
    assert "old" in before and "old" not in after and "new line 199" in after
