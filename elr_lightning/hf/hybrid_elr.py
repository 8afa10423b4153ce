"""Hugging Face modeling of the hybrid and mixture-of-experts mixers of an ELR model.

Written by ``elr export`` beside ``modeling_elr.py``; self-contained (imports ``torch``,
``transformers`` and the shipped ``delta_rule.py``, the recurrence of ``elr_lightning``'s Gated
DeltaProduct). Parameter names are those of ``elr_lightning``'s mixers.

* :class:`ELRGatedDeltaProduct`: Gated DeltaProduct linear attention; fla's Triton kernels where
  fla imports and the activations are bf16 or fp16 on CUDA, the chunked PyTorch path otherwise.
  Its generation cache is a recurrent state and a convolution window per layer call
  (:class:`ELRStateLayer`, one per call as the attention caches: per-loop caching).
* :class:`ELRMoE`: top-k routed SwiGLU experts with route replay as trained: under ``replay`` and
  ``replay_inference`` loops 2..k reuse loop 1's experts and gate weights, under ``replay_experts``
  its experts with gate weights recomputed; under ``dynamic`` every loop routes.
"""

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.cache_utils import DynamicLayer

from .delta_rule import delta_product, l2_normalize


class ELRStateLayer(DynamicLayer):
    """A cache layer holding a recurrent mixer's state (``states``) and the tokens it has seen."""

    def __init__(self) -> None:
        super().__init__()
        self.states: dict[str, Tensor] = {}
        self.length = 0

    def get_seq_length(self) -> int:
        """Tokens cached so far."""
        return self.length

    def reset(self) -> None:
        """Forget every cached state and token."""
        self.states, self.length = {}, 0
        super().reset()


class ELRGatedDeltaProduct(nn.Module):
    """Gated DeltaProduct token mixer (``elr_lightning.mixers.GatedDeltaProduct``'s numbers).

    Args:
        d_model: Hidden width.
        norm_eps: Epsilon of the per-head output RMSNorm.
        num_householder: Householder steps per token.
        num_heads: Heads.
        head_dim: Key width per head.
        value_dim: Value width per head.
        conv_size: Width of the short causal convolution.
        allow_neg_eigval: beta in (0, 2) rather than (0, 1).
        chunk_size: Sub-steps per chunk of the PyTorch path.
    """

    def __init__(
        self,
        d_model: int,
        norm_eps: float,
        num_householder: int,
        num_heads: int,
        head_dim: int,
        value_dim: int,
        conv_size: int,
        allow_neg_eigval: bool,
        chunk_size: int,
    ) -> None:
        super().__init__()
        self.n, self.heads, self.dk, self.dv = num_householder, num_heads, head_dim, value_dim
        self.conv_size, self.chunk_size, self.allow_neg_eigval = conv_size, chunk_size, allow_neg_eigval
        h, n = num_heads, num_householder
        self.q_proj = nn.Linear(d_model, h * head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, n * h * head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, n * h * value_dim, bias=False)
        self.a_proj = nn.Linear(d_model, h, bias=False)
        self.b_proj = nn.Linear(d_model, n * h, bias=False)
        self.g_proj = nn.Linear(d_model, h * value_dim, bias=False)
        self.o_proj = nn.Linear(h * value_dim, d_model, bias=False)
        channels = h * head_dim + n * h * (head_dim + value_dim)
        self.conv_weight = nn.Parameter(torch.zeros(channels, 1, conv_size))
        self.o_norm = nn.RMSNorm(value_dim, eps=norm_eps)
        self.A_log = nn.Parameter(torch.zeros(h))
        self.dt_bias = nn.Parameter(torch.zeros(h))

    def forward(self, x: Tensor, keep: Optional[Tensor], store: Optional[ELRStateLayer]) -> Tensor:
        """``x`` ``[B, T, d]``; ``keep`` ``[B, T]`` True on real tokens (padding leaves the state alone)."""
        b, t, _ = x.shape
        h, n, dk, dv = self.heads, self.n, self.dk, self.dv
        qkv = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)
        if keep is not None:
            qkv = qkv * keep[..., None].to(qkv.dtype)
        window = store.states.get("conv") if store is not None else None
        if window is None:
            window = qkv.new_zeros(b, self.conv_size - 1, qkv.shape[-1])
        full = torch.cat((window.to(qkv.dtype), qkv), dim=1)
        conv = F.conv1d(full.transpose(1, 2), self.conv_weight.to(qkv.dtype), groups=qkv.shape[-1])
        q, k, v = F.silu(conv.transpose(1, 2)).split((h * dk, n * h * dk, n * h * dv), dim=-1)
        q = l2_normalize(q.view(b, t, h, dk)) * dk**-0.5
        k = l2_normalize(k.view(b, t, n, h, dk)).reshape(b, t * n, h, dk)
        v = v.reshape(b, t * n, h, dv)
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias.float())
        beta = torch.sigmoid(self.b_proj(x).float()) * (2.0 if self.allow_neg_eigval else 1.0)
        if keep is not None:
            g, beta = g * keep[..., None], beta * keep[..., None]
        o, state = delta_product(
            q, k, v, g, beta.view(b, t * n, h), num_householder=n,
            initial_state=store.states.get("S") if store is not None else None, chunk_size=self.chunk_size,
        )
        if store is not None:
            store.states.update(S=state, conv=full[:, full.shape[1] - (self.conv_size - 1) :].clone())
            store.length += t
        y = self.o_norm(o.to(x.dtype)) * F.silu(self.g_proj(x).view(b, t, h, dv))
        return self.o_proj(y.reshape(b, t, h * dv))


class ELRMoE(nn.Module):
    """Top-k routed SwiGLU experts plus an optional shared expert (``elr_lightning.mixers.MoE``'s numbers).

    Args:
        d_model: Hidden width.
        num_experts: Routed experts E.
        top_k: Experts per token.
        expert_dim: Hidden width of each routed expert.
        shared_expert_dim: Hidden width of the shared expert; 0 for none.
        normalize_weights: Divide the chosen experts' probabilities by their sum (exports made before
            this field existed normalised at every ``top_k``, the default); ``False`` gates with the raw
            probabilities (top-1 models: Switch Transformer).
        replay: ``dynamic``, ``replay_inference``, ``replay`` or ``replay_experts``; all but ``dynamic``
            replay loop 1's experts at loops 2..k (this is inference), and all but ``replay_experts``
            its gate weights too.
    """

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        top_k: int,
        expert_dim: int,
        shared_expert_dim: int,
        replay: str,
        normalize_weights: bool = True,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.normalize_weights = num_experts, top_k, normalize_weights
        self.replay = replay
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.w_up = nn.Parameter(torch.zeros(num_experts, d_model, 2 * expert_dim))
        self.w_down = nn.Parameter(torch.zeros(num_experts, expert_dim, d_model))
        self.shared_up = nn.Linear(d_model, 2 * shared_expert_dim, bias=False) if shared_expert_dim else None
        self.shared_down = nn.Linear(shared_expert_dim, d_model, bias=False) if shared_expert_dim else None
        self.register_buffer("expert_bias", torch.zeros(num_experts))

    def forward(self, x: Tensor, loop: int, routes: dict[str, Any]) -> Tensor:
        """``x`` ``[B, T, d]`` at loop ``loop`` (0 outside the recurrent block); ``routes``: this layer's
        loop-1 routes of this forward pass, written at loop 1 and read at loops 2..k under replay."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router(x).float()
        if loop >= 2 and self.replay != "dynamic" and "experts" in routes:
            experts = routes["experts"]
            weights = routes["weights"] if self.replay != "replay_experts" else self._gates(logits.softmax(dim=-1), experts)
        else:
            probs = logits.softmax(dim=-1)
            experts = torch.topk(probs + self.expert_bias, self.top_k, dim=-1, sorted=False).indices
            weights = self._gates(probs, experts)
            if loop == 1:
                routes.update(experts=experts, weights=weights)
        y = x.new_zeros(x.shape)
        for e in range(self.num_experts):
            token, slot = (experts == e).nonzero(as_tuple=True)
            gate, up = (x[token] @ self.w_up[e]).chunk(2, dim=-1)
            y.index_add_(0, token, (F.silu(gate) * up) @ self.w_down[e] * weights[token, slot, None].to(x.dtype))
        if self.shared_up is not None and self.shared_down is not None:
            gate, up = self.shared_up(x).chunk(2, dim=-1)
            y = y + self.shared_down(F.silu(gate) * up)
        return y.reshape(shape)

    def _gates(self, probs: Tensor, experts: Tensor) -> Tensor:
        chosen = probs.gather(-1, experts)
        return chosen / chosen.sum(dim=-1, keepdim=True) if self.normalize_weights else chosen
