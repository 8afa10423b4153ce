"""Gated DeltaProduct linear attention (Gated DeltaNet when ``num_householder = 1``).

The layer as the field builds it (fla's ``GatedDeltaProduct``): q/k/v projections, a short causal
depthwise convolution with SiLU on each, L2-normalised q and k, a per-head decay
``g = -exp(A_log) softplus(W_a x + dt_bias)``, per-step ``beta = sigmoid(W_b x)`` (times 2 with
negative eigenvalues allowed, so each step may reflect), ``num_householder`` key/value/beta steps per
token, then a per-head RMSNorm gated by ``silu(W_g x)`` and the output projection. The recurrence is
in :mod:`elr_lightning.mixers.delta_rule`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

from elr_lightning.config import ModelConfig
from elr_lightning.context import LoopContext
from elr_lightning.errors import is_integer
from elr_lightning.mixers.base import CacheBytes, TokenMixer
from elr_lightning.mixers.delta_rule import KERNELS, delta_product, l2_normalize
from elr_lightning.roles import set_role


class GatedDeltaProduct(TokenMixer):
    """Gated DeltaProduct token mixer; caches its recurrent state and convolution window.

    Args:
        config: The architecture (``d_model``; heads default to ``n_heads`` of width ``head_dim``).
        num_householder: Householder steps per token (>= 1); 1 is Gated DeltaNet.
        num_heads: Heads; ``None`` means ``arch.n_heads``.
        head_dim: Key width per head; ``None`` means ``arch.head_dim``.
        expand_v: Value width per head as a multiple of ``head_dim``.
        conv_size: Width of the short causal convolution (>= 1; 1 is a per-channel scale).
        allow_neg_eigval: Let beta range over (0, 2) instead of (0, 1).
        chunk_size: Sub-steps per chunk of the PyTorch path.
        kernels: ``auto`` (fla where it can run: CUDA, bf16 or fp16 activations, fla installed; see
            :func:`~elr_lightning.mixers.delta_rule.fla_unsupported`), ``fla`` (ask for fla; warns once
            per reason and falls back where it cannot run) or ``torch``.
    """

    fold_inputs = ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj")
    fold_outputs = ("o_proj",)

    def __init__(
        self,
        config: ModelConfig,
        num_householder: int = 2,
        num_heads: int | None = None,
        head_dim: int | None = None,
        expand_v: float = 1.0,
        conv_size: int = 4,
        allow_neg_eigval: bool = True,
        chunk_size: int = 64,
        kernels: str = "auto",
    ) -> None:
        super().__init__(config)
        sizes = {"num_householder": num_householder, "conv_size": conv_size, "chunk_size": chunk_size}
        sizes.update((k, v) for k, v in (("num_heads", num_heads), ("head_dim", head_dim)) if v is not None)
        for name, value in sizes.items():
            if not is_integer(value):
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if kernels not in KERNELS:
            raise ValueError(f"kernels={kernels!r} must be one of {KERNELS}")
        self.n = num_householder
        self.heads = config.n_heads if num_heads is None else num_heads
        self.dk = config.head_dim if head_dim is None else head_dim
        self.dv = int(self.dk * expand_v)
        if self.heads < 1 or self.dk < 1 or self.dv < 1:
            raise ValueError(f"num_heads={num_heads}, head_dim={head_dim}, expand_v={expand_v} must give widths >= 1")
        self.conv_size, self.chunk_size, self.kernels = conv_size, chunk_size, kernels
        self.allow_neg_eigval = allow_neg_eigval
        d, h, n = config.d_model, self.heads, self.n
        self.q_proj = nn.Linear(d, h * self.dk, bias=False)
        self.k_proj = nn.Linear(d, n * h * self.dk, bias=False)
        self.v_proj = nn.Linear(d, n * h * self.dv, bias=False)
        self.a_proj = nn.Linear(d, h, bias=False)
        self.b_proj = nn.Linear(d, n * h, bias=False)
        self.g_proj = nn.Linear(d, h * self.dv, bias=False)
        self.o_proj = nn.Linear(h * self.dv, d, bias=False)
        channels = h * self.dk + n * h * (self.dk + self.dv)
        self.conv_weight = nn.Parameter(torch.empty(channels, 1, conv_size))
        self.o_norm = nn.RMSNorm(self.dv, eps=config.norm_eps)
        self.A_log = nn.Parameter(torch.empty(h))
        self.dt_bias = nn.Parameter(torch.empty(h))
        set_role(self.o_proj.weight, init="scaled_normal")
        set_role(self.A_log, init="module", group="no_decay")
        set_role(self.dt_bias, init="module", group="no_decay")
        set_role(self.conv_weight, init="module", group="no_decay")

    @torch.no_grad()
    def init_parameter(self, name: str, param: Tensor) -> None:
        """Mamba-2's spread of decay rates and a conv kernel of fan-in scale (``init="module"``).

        ``A`` uniform in [1, 16], ``dt`` log-uniform in [1e-3, 0.1] (``dt_bias = softplus^-1(dt)``),
        conv weights uniform in ``+-1/sqrt(conv_size)`` (PyTorch's default for this fan-in).
        """
        if name == "A_log":
            nn.init.uniform_(param, 1.0, 16.0)
            param.log_()
        elif name == "dt_bias":
            nn.init.uniform_(param, math.log(1e-3), math.log(0.1))
            param.exp_().clamp_(min=1e-4)
            param.add_(torch.log(-torch.expm1(-param)))
        else:
            bound = 1.0 / math.sqrt(self.conv_size)
            nn.init.uniform_(param, -bound, bound)

    def _conv(self, x: Tensor, window: Tensor | None) -> tuple[Tensor, Tensor]:
        """Causal depthwise conv with SiLU over ``[B, T, C]``, continuing from ``window`` ``[B, conv_size - 1, C]``."""
        b, t, ch = x.shape
        if window is None:
            window = x.new_zeros(b, self.conv_size - 1, ch)
        full = torch.cat((window.to(x.dtype), x), dim=1)
        y = F.conv1d(full.transpose(1, 2), self.conv_weight.to(x.dtype), groups=ch).transpose(1, 2)
        return F.silu(y), full[:, full.shape[1] - (self.conv_size - 1) :].clone()

    @override
    def forward(self, x: Tensor, ctx: LoopContext, layer: int) -> Tensor:
        b, t, _ = x.shape
        h, n, dk, dv = self.heads, self.n, self.dk, self.dv
        keep = ctx.positions.padding
        store = ctx.cached(layer)
        qkv = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)
        if keep is not None:
            qkv = qkv * keep[..., None].to(qkv.dtype)
        qkv, window = self._conv(qkv, None if store is None else store.state("conv"))
        q, k, v = qkv.split((h * dk, n * h * dk, n * h * dv), dim=-1)
        q = l2_normalize(q.view(b, t, h, dk)) * dk**-0.5
        k = l2_normalize(k.view(b, t, n, h, dk)).reshape(b, t * n, h, dk)
        v = v.reshape(b, t * n, h, dv)
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias.float())
        beta = torch.sigmoid(self.b_proj(x).float()) * (2.0 if self.allow_neg_eigval else 1.0)
        if keep is not None:  # padding neither decays nor writes the state (Positions contract)
            g = g * keep[..., None]
            beta = beta * keep[..., None]
        o, state = delta_product(
            q,
            k,
            v,
            g,
            beta.view(b, t * n, h),
            num_householder=n,
            initial_state=None if store is None else store.state("S"),
            chunk_size=self.chunk_size,
            kernels=self.kernels,
        )
        if store is not None:
            store.set_state("S", state)
            store.set_state("conv", window)
        gate = self.g_proj(x).view(b, t, h, dv)
        y = self.o_norm(o.to(x.dtype)) * F.silu(gate)
        return self.o_proj(y.reshape(b, t, h * dv))

    @override
    def cache_bytes(self, dtype: torch.dtype) -> CacheBytes:
        """Float32 state ``[H, d_k, d_v]`` plus the ``conv_size - 1`` last conv inputs in ``dtype``."""
        size = torch.empty((), dtype=dtype).element_size()
        channels = self.conv_weight.shape[0]
        return CacheBytes(fixed=self.heads * self.dk * self.dv * 4 + (self.conv_size - 1) * channels * size)

    @override
    def flops_per_token(self, context: float) -> float:
        """The projections and conv, plus the recurrence: per head, ``n`` steps of ``k^T S`` and a rank-one
        update (``4 d_k d_v`` each) and the read-out ``S^T q`` (``2 d_k d_v``); independent of ``context``."""
        return super().flops_per_token(context) + 2.0 * self.heads * self.dk * self.dv * (2 * self.n + 1)
