"""The training lifecycle in cases beyond the happy path: gradient accumulation's logged loss and
resuming with another loop schedule (another number of shards or loop seed)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.loggers import Logger

from elr_lightning.conditioning import LoopConditioner
from elr_lightning.config import ModelConfig
from elr_lightning.data import TextDataModule
from elr_lightning.module import ELRModule
from elr_lightning.sampling import OneLoopOverride

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n" * 40


class MemoryLogger(Logger):
    """Keeps every ``log_metrics`` call as ``(step, metrics)``."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((int(step or 0), dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def logged(self, tag: str) -> dict[int, float]:
        return {step: metrics[tag] for step, metrics in self.rows if tag in metrics}


class MicroBatchLosses(Callback):
    """The loss of every micro-batch with its optimizer step (Lightning hands back loss / accumulation)."""

    def __init__(self) -> None:
        self.losses: list[tuple[int, float]] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, idx: int) -> None:
        self.losses.append((idx, float(outputs["loss"]) * trainer.accumulate_grad_batches))


def module(virtual_ranks: int = 2, loop_seed: int = 7, **kwargs: Any) -> ELRModule:
    seed_everything(0)
    arch = ModelConfig(vocab_size=256, d_model=32, n_heads=2, n_in=1, n_rec=1, n_out=1, max_seq_len=32, max_loops=3)
    return ELRModule(
        arch=arch,
        sampler=OneLoopOverride(max_loops=3, override_fraction=0.5),
        conditioner=LoopConditioner(d_cond=8, rank=2, n_freqs=2),
        virtual_ranks=virtual_ranks,
        lr=1e-2,
        warmup_steps=0,
        loop_seed=loop_seed,
        **kwargs,
    )


def data(tmp_path: Path) -> TextDataModule:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    return TextDataModule(sources=[str(corpus)], seq_len=16, batch_size=4, cache_dir=str(tmp_path / "cache"))


def trainer(steps: int, **kwargs: Any) -> Trainer:
    settings: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        log_every_n_steps=1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    settings.update(kwargs)
    return Trainer(**settings)


def test_logged_train_loss_is_the_mean_over_accumulated_micro_batches(tmp_path: Path) -> None:
    logger, record = MemoryLogger(), MicroBatchLosses()
    trainer(3, accumulate_grad_batches=3, logger=logger, callbacks=[record]).fit(module(), datamodule=data(tmp_path))
    logged = logger.logged("train/loss")
    assert sorted(logged) == [0, 1, 2]
    for step, value in logged.items():
        # by position: on_train_batch_end of a step's last micro-batch already sees the next global step
        micro = [loss for i, (_, loss) in enumerate(record.losses) if i // 3 == step]
        assert len(micro) == 3 and len(set(micro)) == 3  # three different micro-batch losses
        assert value == pytest.approx(sum(micro) / 3, rel=1e-6)
        assert value != pytest.approx(micro[-1], rel=1e-6)  # not just the last micro-batch's


def fitted_checkpoint(tmp_path: Path, virtual_ranks: int = 2, loop_seed: int = 7) -> Path:
    run = trainer(2, logger=False)
    run.fit(module(virtual_ranks, loop_seed), datamodule=data(tmp_path))
    path = tmp_path / "step2.ckpt"
    run.save_checkpoint(path)
    return path


def test_resuming_with_another_number_of_shards_is_refused_naming_the_fix(tmp_path: Path) -> None:
    ckpt = fitted_checkpoint(tmp_path, virtual_ranks=2)
    assert torch.load(ckpt, weights_only=True)["elr"]["schedule"] == {"num_shards": 2, "seed": 7, "total_steps": 2}
    with pytest.raises(ValueError, match=r"trained with 2 shards per step, this run has 4 .*virtual_ranks: 2"):
        trainer(4, logger=False).fit(module(virtual_ranks=4), datamodule=data(tmp_path), ckpt_path=ckpt, weights_only=True)
    with pytest.raises(ValueError, match=r"loop seed 7, this run has 8; set model.init_args.loop_seed: 7"):
        trainer(4, logger=False).fit(module(loop_seed=8), datamodule=data(tmp_path), ckpt_path=ckpt, weights_only=True)
    # evaluating the checkpoint does not depend on the training schedule
    trainer(4, logger=False, limit_val_batches=1).validate(
        module(virtual_ranks=4), data(tmp_path), ckpt_path=ckpt, weights_only=True
    )
    # a longer run is refused before any step (the restored cosine would rise again after step 2) ...
    longer = trainer(3, logger=False)
    with pytest.raises(ValueError, match=r"planned 2 optimizer steps, this run plans 3; .*trainer.max_steps: 2"):
        longer.fit(module(), datamodule=data(tmp_path), ckpt_path=ckpt, weights_only=True)
    # ... and a shorter one warns that it stops before the restored cosine ends
    shorter = trainer(1, logger=False)
    with pytest.warns(UserWarning, match=r"planned 2 optimizer steps, this run plans 1: .*stops before its cosine ends"):
        shorter.fit(module(), datamodule=data(tmp_path), ckpt_path=ckpt, weights_only=True)


def test_resuming_a_sharded_folder_without_fsdp_names_the_strategy(tmp_path: Path) -> None:
    from elr_lightning.callbacks import AtomicModelCheckpoint

    folder = tmp_path / "epoch=0-step=3.ckpt"  # what OneLoopOverrideFSDPStrategy writes by default
    folder.mkdir()
    (folder / ".metadata").write_bytes(b"")
    (folder / "meta.pt").write_bytes(b"")
    run = trainer(4, logger=False, enable_checkpointing=True, callbacks=[AtomicModelCheckpoint(dirpath=tmp_path / "c")])
    with pytest.raises(ValueError, match=r"sharded checkpoint folder .*OneLoopOverrideFSDPStrategy"):
        run.fit(module(), datamodule=data(tmp_path), ckpt_path=folder, weights_only=True)


@pytest.fixture
def process_group() -> Iterator[None]:
    """Lightning's DDP in this process (one rank) leaves its default process group and its environment
    variables (``MASTER_PORT``, ...) behind: destroy the one, restore the other."""
    environ = dict(os.environ)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)


@pytest.mark.usefixtures("process_group")
def test_lightning_ddp_with_a_parameter_sitting_out_names_the_elr_strategy(tmp_path: Path) -> None:
    from lightning.pytorch.strategies import DDPStrategy

    heads_off = module()
    heads_off.model.conditioner.set_active(False)  # as before the delayed switch
    with pytest.raises(ValueError, match=r"take no part at k=1 with the conditioner off.*OneLoopOverrideDDPStrategy"):
        trainer(1, logger=False, strategy=DDPStrategy()).fit(heads_off, datamodule=data(tmp_path))
    heads_off = module()
    heads_off.model.conditioner.set_active(False)
    allowed = trainer(1, logger=False, strategy=DDPStrategy(find_unused_parameters=True))
    allowed.fit(heads_off, datamodule=data(tmp_path))
    assert allowed.global_step == 1


@pytest.mark.usefixtures("process_group")
def test_validation_under_ddp_logs_every_k_without_rank_local_warnings(tmp_path: Path) -> None:
    import warnings

    from lightning.pytorch.strategies import DDPStrategy

    logger = MemoryLogger()
    run = trainer(1, logger=logger, strategy=DDPStrategy(), limit_val_batches=1, val_check_interval=1)
    mod = module(val_loops=[1, 2, 3, 5])  # k = 5 beyond the budget K = 3: extrapolation
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.fit(mod, datamodule=data(tmp_path))
    assert not [w for w in caught if "sync_dist=True" in str(w.message)]
    for tag in ("loss_k1", "loss_k5", "bpb_k3", "bpb_k5", "gain_kK", "gain_frac_k2", "gain_frac_k5"):
        assert list(logger.logged(f"val/{tag}")) == [0], tag


@pytest.mark.parametrize("val_batches", [2, None])
def test_validation_windows_depend_on_the_global_batch_not_the_device_count(tmp_path: Path, val_batches) -> None:
    from types import SimpleNamespace

    def windows(batch_size: int, world_size: int) -> tuple[int, int]:
        corpus = tmp_path / "corpus.txt"
        corpus.write_text(TEXT)
        dm = TextDataModule(
            sources=[str(corpus)],
            seq_len=16,
            batch_size=batch_size,
            val_batches=val_batches,
            val_fraction=0.2,
            cache_dir=str(tmp_path / "c"),
        )
        dm.trainer = SimpleNamespace(global_rank=0, world_size=world_size)
        dm.prepare_data()
        dm.setup("fit")
        val = dm.val_dataloader().dataset
        return val.start, val.stop

    if val_batches is not None:  # 2 global batches of 4 windows, however they are split over devices
        one = windows(batch_size=4, world_size=1)
        assert one[1] - one[0] == 8
        assert windows(batch_size=2, world_size=2) == one == windows(batch_size=1, world_size=4)
    for world_size in (3, 4):  # no window twice: a multiple of the device count
        start, stop = windows(batch_size=1, world_size=world_size)
        assert (stop - start) % world_size == 0 and stop > start
