"""The transformer layer the three blocks are made of: pre-norm RoPE attention (GQA, SDPA) and SwiGLU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from elr_lightning.config import ModelConfig
from elr_lightning.roles import set_role


class KVSlot(Protocol):
    """What an attention layer needs from a KV cache: one place to store and read its keys and values."""

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store the new ``[B, H_kv, T, hd]`` keys/values; return the keys/values to attend to."""
        ...


class Modulator(nn.Module):
    """Seam contract for the per-sublayer modulation of eq. (4), built by a :class:`Conditioner`.

    A pre-norm sublayer ``y = x + f(RMSNorm(x))`` becomes, with a context ``c``::

        h = RMSNorm(x); h = modulator.pre(h, c); y = x + modulator.post(f(h), c)

    With all heads at their zero init, ``pre`` and ``post`` must return their input bit for bit,
    so inserting a modulator never changes a trained model's function.
    """

    def pre(self, h: Tensor, c: Tensor) -> Tensor:
        """Modulate the normalised sublayer input (FiLM and low-rank adapter in eq. 4)."""
        raise NotImplementedError

    def post(self, y: Tensor, c: Tensor) -> Tensor:
        """Modulate the sublayer output before the residual add (exit gate in eq. 4)."""
        raise NotImplementedError

    def affine(self, c: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The modulation under a fixed context as ``(M, m, gate)``, computed in ``c``'s dtype.

        ``pre(h, c) = h @ M.T + m`` and ``post(y, c) = gate * y``. Optional: a modulator that is
        affine in ``h`` implements it so :func:`elr_lightning.fold.fold_conditioning` can fold it
        into the sublayer's linear maps for serving at a fixed k.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement affine(); it cannot be folded")


@dataclass
class AttentionInputs:
    """Per-forward attention inputs shared by every layer: RoPE tables and the mask."""

    cos: Tensor
    sin: Tensor
    mask: Optional[Tensor]
    is_causal: bool


class Rotary(nn.Module):
    """Rotary position tables, derived from the config (not saved in checkpoints)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim, self.rope_base = config.head_dim, config.rope_base
        shape = (config.max_seq_len, config.head_dim // 2)
        self.register_buffer("cos", torch.empty(shape), persistent=False)
        self.register_buffer("sin", torch.empty(shape), persistent=False)
        self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Compute the tables in place, on their device (also after ``to_empty`` from the meta device)."""
        hd, device = self.head_dim, self.cos.device
        inv = 1.0 / self.rope_base ** (torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd)
        angles = torch.outer(torch.arange(self.cos.shape[0], dtype=torch.float32, device=device), inv)
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def forward(self, start: int, length: int) -> tuple[Tensor, Tensor]:
        """Tables for positions ``start .. start + length - 1``."""
        return self.cos[start : start + length], self.sin[start : start + length]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` of shape ``[B, H, T, hd]`` (half-split convention), computed in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query attention with RoPE through ``F.scaled_dot_product_attention``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.hd = config.n_heads, config.kv_heads, config.head_dim
        self.q = nn.Linear(config.d_model, self.n_heads * self.hd, bias=False)
        self.kv = nn.Linear(config.d_model, 2 * self.n_kv * self.hd, bias=False)
        self.o = nn.Linear(self.n_heads * self.hd, config.d_model, bias=False)
        set_role(self.o.weight, init="scaled_normal")

    def forward(self, x: Tensor, attn: AttentionInputs, kv: Optional[KVSlot] = None) -> Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.n_heads, self.hd).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, self.n_kv, self.hd).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, attn.cos, attn.sin), apply_rope(k, attn.cos, attn.sin)
        if kv is not None:
            k, v = kv.update(k, v)
        if self.n_kv != self.n_heads:
            k = k.repeat_interleave(self.n_heads // self.n_kv, dim=1)
            v = v.repeat_interleave(self.n_heads // self.n_kv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn.mask, is_causal=attn.is_causal)
        return self.o(y.transpose(1, 2).reshape(b, t, self.n_heads * self.hd))


class SwiGLU(nn.Module):
    """SwiGLU MLP: ``W2 (silu(W1 x) * W3 x)``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.d_model, 2 * config.ff_dim, bias=False)
        self.down = nn.Linear(config.ff_dim, config.d_model, bias=False)
        set_role(self.down.weight, init="scaled_normal")

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """One pre-norm layer. Recurrent and output layers carry two :class:`Modulator` s (eq. 4)."""

    def __init__(self, config: ModelConfig, modulators: Optional[tuple[Modulator, Modulator]] = None) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.mlp = SwiGLU(config)
        self.attn_mod, self.mlp_mod = modulators if modulators is not None else (None, None)

    def forward(
        self, x: Tensor, attn: AttentionInputs, c: Optional[Tensor] = None, kv: Optional[KVSlot] = None
    ) -> Tensor:
        """Apply the layer; ``c`` is the loop context, or ``None`` for the plain layer."""
        h = self.attn_norm(x)
        if c is not None and self.attn_mod is not None:
            h = self.attn_mod.pre(h, c)
            x = x + self.attn_mod.post(self.attn(h, attn, kv), c)
        else:
            x = x + self.attn(h, attn, kv)
        h = self.mlp_norm(x)
        if c is not None and self.mlp_mod is not None:
            h = self.mlp_mod.pre(h, c)
            return x + self.mlp_mod.post(self.mlp(h), c)
        return x + self.mlp(h)
