"""Causal softmax attention: RoPE, grouped-query attention, torch SDPA."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

from elr_lightning.config import ModelConfig
from elr_lightning.context import LoopContext
from elr_lightning.mixers.base import CacheBytes, TokenMixer
from elr_lightning.roles import set_role


class Rotary(nn.Module):
    """Rotary position tables, derived from the config (not saved in checkpoints)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim, self.rope_base, self.rope_scaling = config.head_dim, config.rope_base, config.rope_scaling
        shape = (config.max_seq_len, config.head_dim // 2)
        self.register_buffer("cos", torch.empty(shape), persistent=False)
        self.register_buffer("sin", torch.empty(shape), persistent=False)
        self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Compute the tables in place, on their device (also after ``to_empty`` from the meta device)."""
        inv = rope_frequencies(self.head_dim, self.rope_base, self.rope_scaling, self.cos.device)
        device = self.cos.device
        angles = torch.outer(torch.arange(self.cos.shape[0], dtype=torch.float32, device=device), inv)
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    @override
    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> "Rotary":
        """``nn.Module``'s, with the tables kept in fp32 where ``fn`` casts them to half precision.

        ``.to(torch.bfloat16)``, and so Lightning's ``bf16-true`` and ``16-true``, cast every floating
        buffer: in bf16 the tables were up to 2e-3 off (fp16: 2.4e-4) the fp32 tables that
        ``bf16-mixed``, inference and the Hugging Face export rotate with (:func:`apply_rope` computes
        in fp32 anyway, so the fp32 tables cost no extra pass; they are ``max_seq_len x head_dim``
        floats).
        """
        super()._apply(fn, recurse)
        if self.cos.dtype.is_floating_point and torch.finfo(self.cos.dtype).bits < 32:
            device = self.cos.device
            self.cos = torch.empty(self.cos.shape, dtype=torch.float32, device=device)
            self.sin = torch.empty(self.sin.shape, dtype=torch.float32, device=device)
            self.reset_buffers()
        return self

    @override
    def forward(self, start: int, length: int) -> tuple[Tensor, Tensor]:
        """Tables for positions ``start .. start + length - 1``."""
        return self.cos[start : start + length], self.sin[start : start + length]


def rope_frequencies(
    head_dim: int, base: float, scaling: Optional[dict[str, Any]] = None, device: Optional[torch.device] = None
) -> Tensor:
    """The ``head_dim / 2`` rotary frequencies ``base^(-2j / head_dim)``, fp32.

    With Llama 3's ``scaling`` (``arch.rope_scaling``), wavelengths longer than
    ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, those shorter
    than ``... / high_freq_factor`` kept, and those between interpolated smoothly (as Llama 3 and
    ``transformers`` compute them).
    """
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    if scaling is None:
        return inv
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > context / low, inv / factor, inv)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` of shape ``[B, H, T, hd]`` (half-split convention), computed in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


class Attention(TokenMixer):
    """Causal grouped-query attention with RoPE through ``F.scaled_dot_product_attention``.

    Heads and widths come from ``arch`` (``n_heads``, ``n_kv_heads``, ``d_model``, ``head_size``);
    ``arch.qkv_bias`` adds biases to the query, key and value projections (Qwen2) and
    ``arch.qk_norm`` an RMSNorm over each query and key head before RoPE (Qwen3). Caches its
    rotated keys and values: ``2 n_kv_heads head_dim`` elements per token.
    """

    fold_inputs = ("q", "kv")
    fold_outputs = ("o",)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.n_heads, self.n_kv, self.hd = config.n_heads, config.kv_heads, config.head_dim
        self.q = nn.Linear(config.d_model, self.n_heads * self.hd, bias=config.qkv_bias)
        self.kv = nn.Linear(config.d_model, 2 * self.n_kv * self.hd, bias=config.qkv_bias)
        self.o = nn.Linear(self.n_heads * self.hd, config.d_model, bias=False)
        set_role(self.o.weight, init="scaled_normal")
        if config.qk_norm:
            self.q_norm = nn.RMSNorm(self.hd, eps=config.norm_eps)
            self.k_norm = nn.RMSNorm(self.hd, eps=config.norm_eps)

    @override
    def forward(self, x: Tensor, ctx: LoopContext, layer: int) -> Tensor:
        b, t, _ = x.shape
        pos = ctx.positions
        q = self.q(x).view(b, t, self.n_heads, self.hd)
        k, v = self.kv(x).view(b, t, 2, self.n_kv, self.hd).permute(2, 0, 3, 1, 4)
        if self.config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.transpose(1, 2)
        q, k = apply_rope(q, pos.cos, pos.sin), apply_rope(k, pos.cos, pos.sin)
        store = ctx.cached(layer)
        if store is not None:
            k, v = store.update(k, v)
        if self.n_kv != self.n_heads:
            k = k.repeat_interleave(self.n_heads // self.n_kv, dim=1)
            v = v.repeat_interleave(self.n_heads // self.n_kv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=pos.mask, is_causal=pos.is_causal)
        return self.o(y.transpose(1, 2).reshape(b, t, self.n_heads * self.hd))

    @override
    def cache_bytes(self, dtype: torch.dtype) -> CacheBytes:
        size = torch.empty((), dtype=dtype).element_size()
        return CacheBytes(per_token=2 * self.n_kv * self.hd * size)

    @override
    def flops_per_token(self, context: float) -> float:
        """The projections plus ``4 n_heads head_dim context`` for the scores and weighted values."""
        return super().flops_per_token(context) + 4.0 * self.n_heads * self.hd * context
