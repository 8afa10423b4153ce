"""Background prefetch of the training batches (``StepLoader(prefetch=n)``): the same batches in the
same order, the same resume position, exceptions where the batch is asked for, and no thread left behind."""

from __future__ import annotations

import gc
import threading
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elr_lightning.data import MixtureLoader, PreparedDataModule
from test_data import Recorder, _take, resume_trainer
from test_data_mixture import _streams, folders  # noqa: F401 (fixture)


def _loader(streams: list, prefetch: int, batch_size: int = 3, rank: int = 0, world_size: int = 1) -> MixtureLoader:
    return MixtureLoader(streams, ["a", "b"], [0.7, 0.3], ["fa", "fb"], 7, batch_size, 5, rank, world_size, prefetch)


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "elr-data-prefetch"]


@pytest.fixture(scope="module")
def streams(tmp_path_factory: pytest.TempPathFactory) -> list:
    return _streams(tmp_path_factory.mktemp("prefetch"), [400, 90])


@settings(max_examples=25, deadline=None)
@given(prefetch=st.integers(1, 5), done=st.integers(0, 40), more=st.integers(1, 30), rank=st.integers(0, 1))
def test_prefetched_batches_and_resume_positions_equal_reading_in_the_step(
    streams: list, prefetch: int, done: int, more: int, rank: int
) -> None:
    plain = _take(_loader(streams, 0, rank=rank, world_size=2), done + more)
    first = _loader(streams, prefetch, rank=rank, world_size=2)
    got = _take(first, done)
    state = first.state_dict()
    reference = _loader(streams, 0, rank=rank, world_size=2)
    _take(reference, done)
    assert state == reference.state_dict()  # batches built ahead are not counted as yielded
    resumed = _loader(streams, prefetch, rank=rank, world_size=2)
    resumed.load_state_dict(state)
    got += _take(resumed, more)
    assert len(got) == len(plain) and all(torch.equal(a, b) for a, b in zip(got, plain))


def test_a_cursor_moved_while_iterating_reads_from_the_new_position(streams: list) -> None:
    loader = _loader(streams, 3)
    plain = _loader(streams, 0)
    it = iter(loader)
    next(it)
    next(it)
    state = loader.state_dict()
    next(it)
    loader.load_state_dict({**state, "position": 0})
    assert torch.equal(next(it), plain.batch_at(0, 0))
    assert torch.equal(next(it), plain.batch_at(0, 1))


def test_the_thread_stops_at_the_epochs_end_and_when_the_iterator_is_dropped(streams: list) -> None:
    before = len(_prefetch_threads())
    loader = _loader(streams, 2)
    batches = list(loader)  # a whole epoch
    assert len(batches) == len(loader) and len(_prefetch_threads()) == before
    it = iter(loader)  # the next epoch, left after one batch (a run that stops at max_steps)
    next(it)
    assert len(_prefetch_threads()) == before + 1
    del it
    gc.collect()
    assert len(_prefetch_threads()) == before


class Broken(MixtureLoader):
    """Reading batch ``bad`` fails, as a damaged shard does."""

    bad = 2

    def batch_at(self, epoch: int, position: int) -> torch.Tensor:
        if position == self.bad:
            raise ValueError("data.folders: shard 's0.bin' ended early; the folder is damaged")
        return super().batch_at(epoch, position)


def test_an_error_reading_a_batch_is_raised_where_that_batch_is_asked_for(streams: list) -> None:
    before = len(_prefetch_threads())
    loader = Broken(streams, ["a", "b"], [0.7, 0.3], ["fa", "fb"], 7, 3, 5, prefetch=4)
    it = iter(loader)
    next(it)
    next(it)
    with pytest.raises(ValueError, match="the folder is damaged"):
        next(it)
    assert loader.state_dict()["position"] == 2  # the failed batch was not counted
    assert len(_prefetch_threads()) == before


@pytest.mark.parametrize("value", [-1, 1.5, True, "2"])
def test_a_bad_prefetch_is_refused_by_name(folders: list[Path], value: Any) -> None:  # noqa: F811
    with pytest.raises(ValueError, match=r"data\.prefetch must be an integer >= 0"):
        PreparedDataModule([str(f) for f in folders], prefetch=value)


def _fit(tmp_path: Path, folders: list[Path], ckpt_dir: Optional[Path], ckpt_path: Optional[str]) -> list:
    trainer = resume_trainer(tmp_path, 9, ckpt_dir, limit_val_batches=0)
    dm = PreparedDataModule([str(f) for f in folders], weights=[0.7, 0.3], seq_len=128, batch_size=64, prefetch=2)
    model = Recorder()
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    assert trainer.global_step == 9
    return model.seen


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_lightning_resume_with_prefetch_is_exact(tmp_path: Path, folders: list[Path]) -> None:  # noqa: F811
    before = len(_prefetch_threads())
    ckpts = tmp_path / "ckpts"
    full = _fit(tmp_path, folders, ckpts, None)
    dm = PreparedDataModule([str(f) for f in folders], weights=[0.7, 0.3], seq_len=128, batch_size=64, prefetch=0)
    dm.setup("fit")
    per_epoch = len(dm.train_dataloader())
    assert 2 < per_epoch < 9  # the run crosses an epoch
    plain: Iterator[torch.Tensor] = iter(_take(dm.train_dataloader(), 9))
    assert full == [tuple(next(plain)[:, 0].tolist()) for _ in range(9)]  # what reading in the step gives
    for step in (2, per_epoch, per_epoch + 1):  # mid-epoch, at the epoch's end, in the next epoch
        assert _fit(tmp_path, folders, None, str(ckpts / f"step={step}.ckpt")) == full[step:], step
    gc.collect()
    assert len(_prefetch_threads()) == before
