"""Tests of training from prepared folders: keyed permutations, the mixture draw, exact resume, validation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from lightning.pytorch.loggers import CSVLogger

from conftest import quiet_trainer, tiny_config
from elr_lightning.data import (
    FeistelPermutation,
    MixtureLoader,
    MixtureSchedule,
    PreparedDataModule,
    TokenStream,
    prepare_corpus,
)
from elr_lightning.data.prepare import held_out
from elr_lightning.module import ELRModule


@given(n=st.integers(1, 5000), key=st.integers(0, 2**62))
def test_feistel_is_a_permutation(n: int, key: int) -> None:
    values = FeistelPermutation(n, key)(np.arange(n))
    assert np.array_equal(np.sort(values), np.arange(n))


def test_feistel_keys_give_other_orders() -> None:
    a, b = FeistelPermutation(1000, 1)(np.arange(1000)), FeistelPermutation(1000, 2)(np.arange(1000))
    assert not np.array_equal(a, b) and not np.array_equal(a, np.arange(1000))


@given(
    weights=st.lists(st.floats(0.05, 1.0), min_size=1, max_size=4),
    global_batch=st.integers(8, 64),
    steps=st.integers(1, 300),
)
def test_the_schedule_fills_every_batch_and_tracks_the_weights(weights, global_batch, steps) -> None:
    share = np.asarray(weights) / sum(weights)
    assume(np.ceil(share * global_batch).sum() - np.ceil(share.max() * global_batch) <= global_batch)
    schedule = MixtureSchedule(weights, global_batch)
    counts = np.stack([schedule.consumed(s) for s in range(steps + 1)])
    assert (np.diff(counts, axis=0) >= 0).all()
    assert (counts.sum(axis=1) == global_batch * np.arange(steps + 1)).all()
    target = np.asarray(weights) / sum(weights) * global_batch * steps
    assert np.abs(counts[-1] - target).max() <= len(weights)


def test_a_batch_too_small_for_the_weights_is_refused() -> None:
    with pytest.raises(ValueError, match=r"data\.batch_size: a global batch of 1 window\(s\) cannot hold"):
        MixtureSchedule([0.4, 0.3, 0.3], 1)
    with pytest.raises(ValueError, match=r"data\.weights must be positive"):
        MixtureSchedule([1.0, 0.0], 8)


def _streams(tmp_path: Path, sizes: list[int]) -> list[TokenStream]:
    streams = []
    for i, size in enumerate(sizes):
        path = tmp_path / f"s{i}.bin"
        (np.arange(size, dtype=np.int64) % 250 + i).astype(np.uint8).tofile(path)
        streams.append(TokenStream([str(path)], [size], np.dtype(np.uint8)))
    return streams


def _loader(streams: list[TokenStream], batch_size: int, rank: int = 0, world_size: int = 1) -> MixtureLoader:
    return MixtureLoader(streams, ["a", "b"], [0.7, 0.3], ["fa", "fb"], 7, batch_size, 5, rank, world_size)


def test_the_global_batch_is_the_same_for_any_device_count_and_resumes_exactly(tmp_path: Path) -> None:
    streams = _streams(tmp_path, [400, 90])
    one = _loader(streams, 8)
    steps = [one.batch_at(e, p) for e in range(3) for p in range(len(one))]
    two = [_loader(streams, 4, r, 2) for r in range(2)]
    assert len(two[0]) == len(one)
    for i, step in enumerate(steps):
        e, p = divmod(i, len(one))
        assert torch.equal(torch.cat([loader.batch_at(e, p) for loader in two]), step)
    first = [b for _, b in zip(range(5), iter(one))]
    state = one.state_dict()
    resumed = _loader(streams, 4, 1, 2)
    resumed.load_state_dict(state)
    assert torch.equal(next(iter(resumed)), two[1].batch_at(0, 5))
    assert all(torch.equal(a, b) for a, b in zip(first, steps))
    # every window of the small source (12 of them) is drawn once before any repeats
    rows = [r for s in range(int(12 / (8 * 0.3)) - 1) for r in one.global_rows(s) if r[0] == 1]
    assert len(rows) == len(set(rows)) and len(rows) >= 9


def test_a_resume_under_another_global_batch_or_mixture_is_refused(tmp_path: Path) -> None:
    streams = _streams(tmp_path, [400, 90])
    state = _loader(streams, 8).state_dict()
    with pytest.raises(ValueError, match=r"checkpoint has global_batch_size=8, this run has 6; use the same data\.folders"):
        _loader(streams, 6).load_state_dict(state)
    other = MixtureLoader(streams, ["a", "b"], [0.5, 0.5], ["fa", "fb"], 7, 8, 5)
    with pytest.raises(ValueError, match=r"checkpoint has sources="):
        other.load_state_dict(state)


@pytest.fixture
def folders(tmp_path: Path) -> list[Path]:
    """Two prepared byte-level sources: 'web' (prose-like) and 'code' (held-out documents in each)."""
    out = []
    for name, make in (("web", lambda i: f"page {i}: " + "lorem ipsum " * (5 + i % 7)), ("code", lambda i: f"def f{i}(x):\n    return x + {i}\n")):
        src = tmp_path / f"{name}.jsonl"
        src.write_text("".join(json.dumps({"text": make(i)}) + "\n" for i in range(300)), encoding="utf-8")
        prepare_corpus([str(src)], str(tmp_path / name), val_fraction=0.1, shard_bytes=4000, progress=False)
        out.append(tmp_path / name)
    return out


def test_validation_reads_only_held_out_documents(folders: list[Path]) -> None:
    dm = PreparedDataModule([str(f) for f in folders], weights=[0.7, 0.3], seq_len=16, batch_size=4)
    dm.setup("fit")
    val_text = b"".join(bytes(w[:-1].tolist()) for w in dm.val_windows).decode()
    train_loader = dm.train_dataloader()
    train_text = b"".join(bytes(row[:-1].tolist()) for row in train_loader.batch_at(0, 0)).decode()
    assert "page" in val_text and "def f" in val_text
    held = [line for line in val_text.split("\n") if line.startswith("page") and line.endswith("ipsum ")]
    assert held and all(held_out(h, 0.1) for h in held)
    assert not any(h in train_text for h in held if len(h) > 20)
    separate = PreparedDataModule(str(folders[0]), validation=[str(folders[1])], seq_len=16, batch_size=4)
    separate.setup("fit")
    assert len(separate.val_windows) > len(dm.val_windows) / 2
    assert all("page" not in bytes(w.tolist()).decode(errors="ignore") for w in separate.val_windows)


def test_bad_arguments_are_refused(folders: list[Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"data\.weights has 1 value\(s\) for 2 folder\(s\)"):
        PreparedDataModule([str(f) for f in folders], weights=[1.0])
    with pytest.raises(FileNotFoundError, match=r"data\.folders: .*nowhere' does not exist; run elr prepare"):
        PreparedDataModule(str(tmp_path / "nowhere")).setup("fit")
    (tmp_path / "other").mkdir()
    twin = tmp_path / "other" / "web"
    prepare_corpus([str(tmp_path / "code.jsonl")], str(twin), val_fraction=0.0, progress=False)
    with pytest.raises(ValueError, match=r"data\.folders: two folders share a name \(\['web', 'web'\]\)"):
        PreparedDataModule([str(folders[0]), str(twin)]).setup("fit")
    no_val = PreparedDataModule(str(twin), seq_len=16, batch_size=2)
    no_val.setup("fit")
    with pytest.raises(ValueError, match=r"data\.validation: the folders hold no validation window; prepare with"):
        no_val.val_dataloader()
    with pytest.raises(ValueError, match=r"has no training window of seq_len \+ 1 = 100001 tokens"):
        dm = PreparedDataModule(str(folders[0]), seq_len=100000, batch_size=2)
        dm.setup("fit")
        dm.train_dataloader()


def test_training_logs_the_realised_share_of_each_source(folders: list[Path], tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = ELRModule(arch=tiny_config(vocab_size=256), lr=0.003, warmup_steps=2)
    dm = PreparedDataModule([str(f) for f in folders], weights=[0.7, 0.3], seq_len=16, batch_size=5, val_batches=1)
    logger = CSVLogger(str(tmp_path / "logs"), name="mix")
    trainer = quiet_trainer(max_steps=6, logger=logger, log_every_n_steps=1, limit_val_batches=1, val_check_interval=3)
    trainer.fit(module, dm)
    metrics = (tmp_path / "logs" / "mix" / "version_0" / "metrics.csv").read_text().splitlines()
    header = metrics[0].split(",")
    web = [float(row.split(",")[header.index("data/share/web")]) for row in metrics[1:] if row.split(",")[header.index("data/share/web")]]
    assert len(web) == 6
    assert web == pytest.approx([dm._train_loader.schedule.share(s)[0] for s in range(6)])
    assert abs(web[-1] - 0.7) <= 1 / 30
