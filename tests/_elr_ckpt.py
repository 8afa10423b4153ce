"""A tiny perturbed ELR checkpoint on disk, for the serving and export tests."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from elr_lightning.conditioning import LoopConditioner
from elr_lightning.config import ModelConfig
from elr_lightning.module import ELRModule
from elr_lightning.tokenizers import Tokenizer
from elr_lightning.updates import StateUpdate

#: A byte-vocabulary model with GQA, two shared layers and the eq. 4 conditioning.
SERVE_ARCH = ModelConfig(
    vocab_size=256, d_model=32, n_heads=4, n_kv_heads=2, n_in=1, n_rec=2, n_out=1, max_loops=3, max_seq_len=64
)


def write_checkpoint(
    path: Path,
    arch: ModelConfig = SERVE_ARCH,
    update: Optional[StateUpdate] = None,
    conditioned: bool = True,
    tokenizer: Optional[Tokenizer] = None,
) -> ELRModule:
    """Train one step, perturb every parameter (so gates and heads act and k matters), save with a Trainer.

    ``tokenizer`` is saved in the checkpoint as the training tokenizer.
    """
    torch.manual_seed(0)
    module = ELRModule(
        arch=arch, update=update, conditioner=LoopConditioner(d_cond=8, rank=2, n_freqs=2) if conditioned else None
    )
    trainer = Trainer(
        max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(torch.randint(0, arch.vocab_size, (4, 17)), batch_size=4))
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.2 * torch.randn_like(p))
    module.tokenizer = tokenizer
    trainer.save_checkpoint(path)
    return module.eval()
