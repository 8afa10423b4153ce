"""The SwiGLU feed-forward channel mixer."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

from elr_lightning.config import ModelConfig
from elr_lightning.context import LoopContext
from elr_lightning.mixers.base import ChannelMixer
from elr_lightning.roles import set_role


class SwiGLU(ChannelMixer):
    """SwiGLU MLP: ``W2 (silu(W1 x) * W3 x)`` of hidden width ``arch.d_ff``."""

    fold_inputs = ("up",)
    fold_outputs = ("down",)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.up = nn.Linear(config.d_model, 2 * config.ff_dim, bias=False)
        self.down = nn.Linear(config.ff_dim, config.d_model, bias=False)
        set_role(self.down.weight, init="scaled_normal")

    @override
    def forward(self, x: Tensor, ctx: LoopContext, layer: int) -> Tensor:
        gate, up = self.up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)
