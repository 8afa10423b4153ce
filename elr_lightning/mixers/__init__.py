"""Token mixers and channel mixers: the two seams of a layer, and their implementations."""

from elr_lightning.mixers.attention import Attention, Rotary, apply_rope
from elr_lightning.mixers.base import CacheBytes, ChannelMixer, TokenMixer
from elr_lightning.mixers.gdp import GatedDeltaProduct
from elr_lightning.mixers.moe import MoE
from elr_lightning.mixers.swiglu import SwiGLU

__all__ = [
    "Attention",
    "CacheBytes",
    "ChannelMixer",
    "GatedDeltaProduct",
    "MoE",
    "Rotary",
    "SwiGLU",
    "TokenMixer",
    "apply_rope",
]
