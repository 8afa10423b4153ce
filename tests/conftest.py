"""Shared fixtures: tiny architectures that run in milliseconds on two CPU cores."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator

import lightning.pytorch as pl
import pytest
import torch
from hypothesis import settings

from elr_lightning.conditioning import LoopConditioner
from elr_lightning.layers import Modulator
from elr_lightning.config import ModelConfig
from elr_lightning.model import LoopedLM
from elr_lightning.module import ELRModule
from elr_lightning.sampling import OneLoopOverride

#: The repository's root folder (tests sit one or two folders below it).
REPO_ROOT = Path(__file__).resolve().parents[1]
#: Files the tests read: a checkpoint written before the package regroup and what it computes.
FIXTURES = Path(__file__).resolve().parent / "fixtures"

settings.register_profile("elr", deadline=None, max_examples=25, derandomize=True)
settings.load_profile("elr")

torch.set_flush_denormal(True)

#: Under pytest-xdist (``.ci/run``: ``-n 2``), each worker's share of the cores: its own torch threads and those of
#: the processes its tests start (``OMP_NUM_THREADS``), so that two workers never run more threads than there are
#: cores (two tiny models each spinning two threads on two cores run several times slower than on one each).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // WORKERS)))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

#: The files that take longest (minutes each on a 2-core machine), first in the order pytest-xdist hands out
#: files (``--dist loadfile --no-loadscope-reorder``: a file's tests, and its module fixtures such as a vLLM server,
#: stay on one worker): started last, one of them would leave the other worker idle for its whole length.
LONGEST_FIRST = (
    "estimate/test_shipped_gpu_configs.py",
    "test_readme_fresh.py",
    "vllm/test_vllm.py",
    "estimate/test_estimate.py",
    "estimate/test_fast.py",
    "estimate/test_shipped_configs.py",
    "strategies/test_strategies.py",
    "checkpoints/test_resume.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist, moves the tests of :data:`LONGEST_FIRST` to the front, in that order (a stable sort)."""
    missing = [name for name in LONGEST_FIRST if not (REPO_ROOT / "tests" / name).is_file()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py: LONGEST_FIRST names files that are not there: {missing}")
    if WORKERS > 1:
        rank = {REPO_ROOT / "tests" / name: i for i, name in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(item.path, len(rank)))


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    """Each test starts and ends with empty torch.compile caches.

    Every ``Block`` shares one code object, so graphs compiled for one test's model stay cached for
    the next; a checkpointed backward's recomputation could then run another test's graph and save
    tensors of other shapes (torch's LRU reordering of cached graphs, pytorch/pytorch#166926).
    """
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def private_estimate_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's ``elr estimate`` and ``elr fit`` (and their subprocesses) keep traced steps in a folder of their own.

    Never the user's ``~/.cache``, and no test reads a step another test traced.
    """
    monkeypatch.setenv("ELR_ESTIMATE_CACHE", str(tmp_path_factory.mktemp("estimate-cache")))


def load_bench(name: str) -> ModuleType:
    """``bench/<name>.py`` as a module (the benches are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO_ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_config(**overrides) -> ModelConfig:
    """A 2-head, d = 32 model with one layer per block."""
    args = dict(vocab_size=64, d_model=32, n_heads=2, n_in=1, n_rec=1, n_out=1, max_seq_len=64, max_loops=4)
    args.update(overrides)
    return ModelConfig(**args)


@pytest.fixture
def tiny() -> ModelConfig:
    return tiny_config()


#: Grouped-query, two recurrent layers: the generation and cache tests' model.
GQA_CONFIG = ModelConfig(
    vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_in=1, n_rec=2, n_out=1, max_loops=4, max_seq_len=64
)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models are bound by per-op latency; one thread keeps them fast when other jobs share the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Identity(Modulator):
    """A modulator that leaves every sublayer as it is and offers neither ``affine`` nor ``modulation``."""

    def pre(self, h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return h

    def post(self, y: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return y


class PlainConditioner(LoopConditioner):
    """A conditioner whose modulators are :class:`Identity`: a plug-in that cannot be folded."""

    def make_modulator(self, d_model: int) -> Modulator:
        return Identity()


def perturbed_model(config: ModelConfig = GQA_CONFIG, seed: int = 0) -> LoopedLM:
    """A conditioned looped LM whose zero-initialised gates and heads are perturbed, so every part acts."""
    torch.manual_seed(seed)
    model = LoopedLM(config, conditioner=LoopConditioner(d_cond=8, rank=2))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


#: The switch and resume tests' architecture.
SWITCH_ARCH = dict(vocab_size=256, d_model=32, n_heads=2, n_in=1, n_rec=1, n_out=1, max_seq_len=32, max_loops=3)


def switch_module(conditioner: bool = True, lr: float = 3e-3, **arch: Any) -> ELRModule:
    """A seeded module with one-loop overrides over 2 virtual ranks, for switch and resume tests."""
    pl.seed_everything(0)
    return ELRModule(
        ModelConfig(**{**SWITCH_ARCH, **arch}),
        sampler=OneLoopOverride(3, 0.5),
        conditioner=LoopConditioner(d_cond=8, rank=2, n_freqs=2) if conditioner else None,
        virtual_ranks=2,
        warmup_steps=2,
        lr=lr,
    )


def quiet_trainer(**overrides: Any) -> pl.Trainer:
    """A CPU ``pl.Trainer`` that writes and prints nothing of its own: no logger, checkpointing, progress bar
    or model summary; ``overrides`` set any of those and every other argument (a checkpoint callback needs
    ``enable_checkpointing=True``)."""
    quiet = dict(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                 enable_model_summary=False)  # fmt: skip
    return pl.Trainer(**{**quiet, **overrides})


def fit_two_steps(module: pl.LightningModule, data: pl.LightningDataModule, path: Path) -> Path:
    """Train ``module`` 2 steps on ``data`` on the CPU, quietly and without validation, and save it at ``path``."""
    trainer = quiet_trainer(max_steps=2, limit_val_batches=0)
    trainer.fit(module, datamodule=data)
    trainer.save_checkpoint(path)
    return path
