"""Hugging Face modeling of an Elastic Latent Recurrence (ELR) looped language model.

Written by ``elr export``; self-contained (imports only ``torch`` and ``transformers``). Computes
what ``elr_lightning``'s ``LoopedLM`` computes, with the same parameter names under ``model.``:

    tokens - embed - input block (n_in layers) -> h_in;  s_0 = h_in
    for i in 1..k:  c_i = MLP([phi(i/k); phi(k/K)])            (eq. 4, when conditioned)
                    s~_i = s_{i-1} + h_in;  r_i = R(s~_i, c_i)  (n_rec shared layers)
                    s_i = s_{i-1} + beta_i (r_i - s_{i-1})      (eq. 2, adaptive delta)
    logits = head(norm(O(s_k, c_k)))                            (n_out output layers)

``forward(input_ids, loops=k)`` and ``generate(input_ids, loops=k)`` choose the loop count per call.
The KV cache is Hugging Face's ``DynamicCache`` with **per-loop caching**: one cache layer per
attention call, ``n_in + k n_rec + n_out`` of them (eq. 1). It reproduces the cache-free forward
exactly; ``elr_lightning``'s last-loop cache, which overwrites one cache per layer at every loop,
has no counterpart among the Hugging Face cache classes, which only append.
"""

import dataclasses
import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_elr import ELRConfig
from .hybrid_elr import ELRGatedDeltaProduct, ELRMoE, ELRStateLayer

#: The output field of the cache: ``cache`` in recent transformers, ``past_key_values`` before.
_CACHE_FIELD = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"


def _frequencies(hd: int, base: float, scaling: Optional[dict], device: torch.device) -> Tensor:
    """RoPE frequencies ``base^(-2j / hd)``; with Llama 3 ``scaling``, long wavelengths divided by its factor.

    ``elr_lightning.mixers.attention.rope_frequencies``, repeated: this file imports only torch and transformers.
    """
    inv = 1.0 / base ** (torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd)
    if scaling is None:
        return inv
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > context / low, inv / factor, inv)
    smooth = (context / wavelen - low) / (high - low)
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def _rope(x: Tensor, start: int, base: float, scaling: Optional[dict] = None) -> Tensor:
    """Rotate ``x`` ``[B, H, T, hd]`` at positions ``start..start+T-1`` (half-split), in fp32."""
    hd, t = x.shape[-1], x.shape[-2]
    inv = _frequencies(hd, base, scaling, x.device)
    angles = torch.outer(torch.arange(start, start + t, dtype=torch.float32, device=x.device), inv)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class ELRAttention(nn.Module):
    """Causal grouped-query attention with RoPE through ``F.scaled_dot_product_attention``.

    Optional: biases on the query, key and value projections (``qkv_bias``), an RMSNorm per query
    and key head before RoPE (``qk_norm``), Llama 3 RoPE scaling (``rope_freq_scaling``).
    """

    def __init__(self, config: ELRConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.hd = config.n_heads, config.n_kv_heads, config.head_dim
        self.rope_base, self.rope_scaling = config.rope_base, config.rope_freq_scaling
        self.q = nn.Linear(config.d_model, self.n_heads * self.hd, bias=config.qkv_bias)
        self.kv = nn.Linear(config.d_model, 2 * self.n_kv * self.hd, bias=config.qkv_bias)
        self.o = nn.Linear(self.n_heads * self.hd, config.d_model, bias=False)
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = nn.RMSNorm(self.hd, eps=config.norm_eps)
            self.k_norm = nn.RMSNorm(self.hd, eps=config.norm_eps)

    def forward(self, x: Tensor, start: int, mask: Optional[Tensor], cache: Optional[Cache], idx: int) -> Tensor:
        """Attend over ``x`` (positions from ``start``), reading and updating layer ``idx``'s ``cache``."""
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.n_heads, self.hd)
        k, v = self.kv(x).view(b, t, 2, self.n_kv, self.hd).permute(2, 0, 3, 1, 4)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.transpose(1, 2)
        q, k = _rope(q, start, self.rope_base, self.rope_scaling), _rope(k, start, self.rope_base, self.rope_scaling)
        if cache is not None:
            k, v = cache.update(k, v, idx)
        if self.n_kv != self.n_heads:
            k = k.repeat_interleave(self.n_heads // self.n_kv, dim=1)
            v = v.repeat_interleave(self.n_heads // self.n_kv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and start == 0)
        return self.o(y.transpose(1, 2).reshape(b, t, self.n_heads * self.hd))


class ELRMLP(nn.Module):
    """SwiGLU: ``down(silu(gate) * up)`` with gate and up from one projection."""

    def __init__(self, config: ELRConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.d_model, 2 * config.d_ff, bias=False)
        self.down = nn.Linear(config.d_ff, config.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """The MLP of ``x``, as the class says."""
        gate, up = self.up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class ELRModulator(nn.Module):
    """Eq. (4) for one sublayer: FiLM ``(lambda, mu)``, low-rank adapter ``A diag(g) B``, exit gate ``omega``."""

    def __init__(self, d_model: int, d_cond: int, rank: int) -> None:
        super().__init__()
        self.film = nn.Linear(d_cond, 2 * d_model)
        self.g = nn.Linear(d_cond, rank)
        self.omega = nn.Linear(d_cond, d_model)
        self.down = nn.Linear(d_model, rank, bias=False)
        self.up = nn.Linear(rank, d_model, bias=False)

    def pre(self, h: Tensor, c: Tensor) -> Tensor:
        """Eq. 4 before the mixer: FiLM of the normalised input, then the gated low-rank adapter."""
        scale, shift = self.film(c).chunk(2, dim=-1)
        h = torch.addcmul(shift, h, 1 + scale)
        return h + self.up(self.g(c) * self.down(h))

    def post(self, y: Tensor, c: Tensor) -> Tensor:
        """Eq. 4 after the mixer: the output scaled by ``1 + omega(c)``."""
        return (1 + self.omega(c)) * y


class ELRBlock(nn.Module):
    """One pre-norm layer; recurrent and output layers carry two modulators when conditioned.

    The token mixer is attention or Gated DeltaProduct, the channel mixer SwiGLU or a mixture of
    experts, as ``config.layer_mixers(index)`` says.
    """

    def __init__(self, config: ELRConfig, modulated: bool, index: int) -> None:
        super().__init__()
        token, channel = config.layer_mixers(index)
        self.attn_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.attn = ELRAttention(config) if token["type"] == "attention" else ELRGatedDeltaProduct(
            config.d_model, config.norm_eps, **{k: v for k, v in token.items() if k != "type"}
        )
        self.mlp_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.mlp = ELRMLP(config) if channel["type"] == "swiglu" else ELRMoE(
            config.d_model, **{k: v for k, v in channel.items() if k != "type"}
        )
        cond = config.conditioning
        self.attn_mod = ELRModulator(config.d_model, cond["d_cond"], cond["rank"]) if modulated and cond else None
        self.mlp_mod = ELRModulator(config.d_model, cond["d_cond"], cond["rank"]) if modulated and cond else None

    def forward(self, x: Tensor, c: Optional[Tensor], call: "_Call", idx: int, loop: int) -> Tensor:
        """The layer at cache slot ``idx`` (per-loop caching) and loop ``loop`` (0 outside the core)."""
        if isinstance(self.attn, ELRAttention):
            def token(h: Tensor) -> Tensor:
                return self.attn(h, call.start, call.mask, call.cache, idx)
        else:
            def token(h: Tensor) -> Tensor:
                return self.attn(h, call.keep, None if call.cache is None else call.cache.layers[idx])
        if isinstance(self.mlp, ELRMoE):
            def channel(h: Tensor) -> Tensor:
                return self.mlp(h, loop, call.routes.setdefault(id(self), {}))
        else:
            channel = self.mlp
        x = x + self._sublayer(x, self.attn_norm, token, self.attn_mod, c)
        return x + self._sublayer(x, self.mlp_norm, channel, self.mlp_mod, c)

    @staticmethod
    def _sublayer(x: Tensor, norm: nn.RMSNorm, f: Any, mod: Optional[ELRModulator], c: Optional[Tensor]) -> Tensor:
        h = norm(x)
        if c is not None and mod is not None:
            return mod.post(f(mod.pre(h, c)), c)
        return f(h)


@dataclasses.dataclass
class _Call:
    """What every layer of one forward pass shares: positions, masks, cache and the MoE routes of loop 1."""

    start: int
    mask: Optional[Tensor]
    keep: Optional[Tensor]
    cache: Optional[Cache]
    routes: dict = dataclasses.field(default_factory=dict)


class ELRUpdate(nn.Module):
    """The state update s_i = Update(s_{i-1}, r_i, s~_i); eq. (2) for ``adaptive_delta``."""

    def __init__(self, config: ELRConfig) -> None:
        super().__init__()
        self.rule, self.beta, self.injection = config.state_update, config.fixed_delta_beta, config.injection
        if self.rule == "adaptive_delta":
            self.gate = nn.Linear(config.d_model, config.d_model)
            self.gamma = nn.Parameter(torch.zeros(config.d_model))

    def inject(self, s: Tensor, h_in: Tensor) -> Tensor:
        """The block's input ``s~_i``: the state plus the input block's output (none for ``non_recurrent``)."""
        if self.rule == "non_recurrent":
            return s
        return s + h_in if self.injection == "sum" else torch.lerp(s, h_in, 0.5)

    def forward(self, s: Tensor, r: Tensor, s_tilde: Tensor) -> Tensor:
        """The new state from the block's output ``r`` (eq. 2 for ``adaptive_delta``)."""
        if self.rule == "adaptive_delta":
            beta = torch.sigmoid(self.gate(s_tilde)) * F.softplus(self.gamma)
            return torch.lerp(s, r.to(s.dtype), beta.to(s.dtype))
        if self.rule == "fixed_delta":
            return s + self.beta * (r - s)
        if self.rule == "residual":
            return s + (r - s_tilde)
        return r


class ELRConditioner(nn.Module):
    """c_i = MLP([phi(tau_i); phi(kappa)]), tau_i = i / k, kappa = k / K; phi = [sin(f x), cos(f x)], f = 2^j pi.

    Past K, ``beyond_budget`` decides: ``ratio`` keeps the formula, ``clamp`` holds kappa at 1,
    ``replay`` runs loop i with loop min(i, K)'s context of a K-loop run.
    """

    def __init__(self, d_cond: int, n_freqs: int, beyond_budget: str = "clamp", **_: int) -> None:
        super().__init__()
        self.n_freqs, self.beyond_budget = n_freqs, beyond_budget
        self.mlp = nn.Sequential(nn.Linear(4 * n_freqs, d_cond), nn.SiLU(), nn.Linear(d_cond, d_cond))

    def forward(self, loop: int, loops: int, max_loops: int) -> Tensor:
        """The context ``c_i`` of loop ``loop`` of ``loops`` under the budget ``max_loops``."""
        device = self.mlp[0].weight.device
        freqs = math.pi * 2.0 ** torch.arange(self.n_freqs, dtype=torch.float32, device=device)

        def phi(x: float) -> Tensor:
            return torch.cat(((freqs * x).sin(), (freqs * x).cos()))

        tau, kappa = loop / loops, loops / max_loops
        if loops > max_loops and self.beyond_budget != "ratio":
            kappa = 1.0
            if self.beyond_budget == "replay":
                tau = min(loop, max_loops) / max_loops
        return self.mlp(torch.cat((phi(tau), phi(kappa))).to(self.mlp[0].weight.dtype))


class ELRCore(nn.Module):
    """The shared recurrent block with its state update and conditioner."""

    def __init__(self, config: ELRConfig) -> None:
        super().__init__()
        self.update = ELRUpdate(config)
        self.conditioner = ELRConditioner(**config.conditioning) if config.conditioning else None
        self.layers = nn.ModuleList(ELRBlock(config, True, config.n_in + j) for j in range(config.n_rec))


class ELRPreTrainedModel(PreTrainedModel):
    """Hugging Face plumbing shared by the trunk and the LM: the config class and weight init."""

    config_class = ELRConfig
    base_model_prefix = "model"
    _no_split_modules = ["ELRBlock"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Normal(0, init_std) matrices, zero biases, unit norms; the eq. 2 gate and eq. 4 heads at zero."""
        std = self.config.init_std
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.RMSNorm):
            nn.init.ones_(module.weight)
        if isinstance(module, ELRUpdate) and module.rule == "adaptive_delta":
            nn.init.zeros_(module.gate.weight)
            nn.init.zeros_(module.gate.bias)
            nn.init.zeros_(module.gamma)
        elif isinstance(module, ELRModulator):
            for head in (module.film, module.g, module.omega):
                nn.init.zeros_(head.weight)
                nn.init.zeros_(head.bias)


class ELRModel(ELRPreTrainedModel):
    """The looped trunk: embedding, input block, recurrent core, output block, final norm."""

    def __init__(self, config: ELRConfig) -> None:
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.input_layers = nn.ModuleList(ELRBlock(config, False, j) for j in range(config.n_in))
        self.core = ELRCore(config)
        first_out = config.n_in + config.n_rec
        self.output_layers = nn.ModuleList(ELRBlock(config, True, first_out + j) for j in range(config.n_out))
        self.norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding."""
        return self.embed

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        """Replace the token embedding."""
        self.embed = value

    def forward(
        self,
        input_ids: Tensor,
        loops: int,
        attention_mask: Optional[Tensor] = None,
        past_key_values: Optional[Cache] = None,
    ) -> Tensor:
        """The final hidden states ``[B, T, d]`` at loop count ``loops``."""
        cfg, cache = self.config, past_key_values
        b, t = input_ids.shape
        start = cache.get_seq_length() if cache is not None else 0
        if start + t > cfg.max_seq_len:
            raise ValueError(f"sequence of {start + t} tokens exceeds max_seq_len={cfg.max_seq_len}")
        if isinstance(cache, DynamicCache):
            while len(cache.layers) < cfg.effective_depth(loops):  # per-loop caching: one layer per call
                cache.layers.append(DynamicLayer())
            for idx, layer in enumerate(self._call_layers(loops)):  # recurrent mixers keep a state instead
                if isinstance(layer.attn, ELRGatedDeltaProduct) and not isinstance(cache.layers[idx], ELRStateLayer):
                    cache.layers[idx] = ELRStateLayer()
        mask = None
        if start > 0 or (attention_mask is not None and not bool(attention_mask.all())):
            q_pos = torch.arange(start, start + t, device=input_ids.device)[:, None]
            k_pos = torch.arange(start + t, device=input_ids.device)[None, :]
            mask = (k_pos <= q_pos)[None, None]
            if attention_mask is not None:
                mask = (mask & attention_mask.bool()[:, None, None, :]) | (k_pos == q_pos)[None, None]
        keep = None if attention_mask is None else attention_mask[:, -t:].bool()
        call = _Call(start, mask, keep, cache)
        x = self.embed(input_ids)
        for j, layer in enumerate(self.input_layers):
            x = layer(x, None, call, j, 0)
        core, h_in = self.core, x
        s, c = h_in, None
        for i in range(1, loops + 1):
            if core.conditioner is not None and cfg.conditioning_active:
                c = core.conditioner(i, loops, cfg.max_loops)
            s_tilde = core.update.inject(s, h_in)
            r = s_tilde
            for j, layer in enumerate(core.layers):
                r = layer(r, c, call, cfg.n_in + (i - 1) * cfg.n_rec + j, i)
            s = core.update(s, r, s_tilde)
        first_out = cfg.n_in + loops * cfg.n_rec
        for j, layer in enumerate(self.output_layers):
            s = layer(s, c, call, first_out + j, 0)
        return self.norm(s)

    def _call_layers(self, loops: int) -> list[ELRBlock]:
        """The layer of every call at loop count ``loops``, in cache-slot order (eq. 1)."""
        return [*self.input_layers, *list(self.core.layers) * loops, *self.output_layers]


class ELRForCausalLM(ELRPreTrainedModel, GenerationMixin):
    """ELR looped LM with a language-model head; ``loops`` picks the loop count k per call."""

    _tied_weights_keys = {"lm_head.weight": "model.embed.weight"}

    def __init__(self, config: ELRConfig) -> None:
        super().__init__(config)
        self.model = ELRModel(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding."""
        return self.model.embed

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        """Replace the token embedding."""
        self.model.embed = value

    def get_output_embeddings(self) -> nn.Linear:
        """The LM head."""
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        """Replace the LM head."""
        self.lm_head = value

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Optional[Tensor] = None,
        cache: Optional[Cache] = None,
        loops: Optional[int] = None,
        labels: Optional[Tensor] = None,
        use_cache: Optional[bool] = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Logits at loop count ``loops`` (default ``config.default_loops``); any k >= 1.

        Args:
            input_ids: ``[B, T]`` token ids.
            attention_mask: ``[B, past + T]``, 1 on tokens and 0 on (left) padding.
            cache: A ``DynamicCache`` (per-loop caching), or ``None``; older transformers pass it
                as ``past_key_values``.
            loops: The loop count k.
            labels: Targets for the shifted next-token cross-entropy, -100 ignored.
            use_cache: Create a ``DynamicCache`` when none is given.
            logits_to_keep: Compute logits for the last this-many positions only (0: all).
        """
        loops = self.config.default_loops if loops is None else int(loops)
        if loops < 1:
            raise ValueError(f"loops={loops} must be >= 1")
        cache = kwargs.pop("past_key_values", None) if cache is None else cache
        if use_cache and cache is None:
            cache = DynamicCache()
        hidden = self.model(input_ids, loops, attention_mask, cache)
        logits = self.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache})
