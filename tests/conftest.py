"""Shared fixtures: tiny architectures that run in milliseconds on two CPU cores."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings

from elr_lightning.config import ModelConfig

settings.register_profile("elr", deadline=None, max_examples=25, derandomize=True)
settings.load_profile("elr")

torch.set_flush_denormal(True)


def tiny_config(**overrides) -> ModelConfig:
    """A 2-head, d = 32 model with one layer per block."""
    args = dict(vocab_size=64, d_model=32, n_heads=2, n_in=1, n_rec=1, n_out=1, max_seq_len=64, max_loops=4)
    args.update(overrides)
    return ModelConfig(**args)


@pytest.fixture
def tiny() -> ModelConfig:
    return tiny_config()
