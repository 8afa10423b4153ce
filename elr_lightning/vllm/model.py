"""The ELR looped LM in vLLM's layers, with k per token: what ``elr_lightning/hf/modeling_elr.py`` computes.

Built from vLLM's own parts: its ``Attention`` (paged KV cache,
the block manager, every attention backend), the tensor-parallel linears, RoPE, RMSNorm, the
vocabulary-parallel embedding and head, the logits processor and the weight loaders. The eq. (2)
state update, the eq. (4) modulators and the loop conditioner are small replicated ``nn.Linear`` s.

**Cache policies** (:mod:`elr_lightning.vllm.config`). ``per_loop``: one ``Attention`` per
(loop, recurrent layer) call up to the served budget B, as vLLM's ``iquest_loopcoder.py`` keeps one
per loop; exact under chunked prefill. ``last_loop``: one ``Attention`` per recurrent layer, called
at every loop; each call overwrites the token's slot, so after its last loop the cache holds that
loop's keys and values (``elr_lightning.inference.cache.LastLoopCache``).

**k per token.** ``forward`` takes ``loops`` ``[T]`` (each token's request's k; the runner hook of
:mod:`elr_lightning.vllm.loops` builds it). Loop i runs while any row needs it; a row past its k
keeps its state (``s_i = s_{k}``), and under ``last_loop`` re-writes its last loop's keys and values
rather than loop i's, so its cache entry stays its own k's. Each row's output block runs under its
own c_k (eq. 4), so each row's logits are those of its k alone up to fp32 round-off. A step costs
``max(k) x rows`` loop-rows, not ``sum(k)`` as ``elr_lightning.inference.decode.Decoder``'s sorted prefixes do:
vLLM's attention metadata covers the whole batch, and running a loop on a subset of requests
would need metadata built per subset (see docs/lab-vllm.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.sequence import IntermediateTensors

from elr_lightning.hf.configuration_elr import ELRConfig
from elr_lightning.hf.modeling_elr import ELRModulator
from elr_lightning.vllm.config import ServedELR, served_elr
from elr_lightning.vllm.loops import elr_model_state


def _rope_parameters(config: ELRConfig) -> dict:
    """vLLM's ``rope_parameters`` for the export's RoPE: half-split (NeoX), optional Llama 3 scaling."""
    scaling = config.rope_freq_scaling
    if scaling is None:
        return {"rope_type": "default", "rope_theta": config.rope_base}
    return {"rope_type": "llama3", "rope_theta": config.rope_base, **scaling}


class ELRAttention(nn.Module):
    """Grouped-query attention with RoPE; one vLLM ``Attention`` (KV store) per cache slot it is called at.

    Args:
        config: The export's ``ELRConfig``.
        slots: The cache slot of each call (loop), in call order; the ``Attention`` layer names carry them.
        vllm_config: vLLM's config (cache and quantisation settings).
    """

    def __init__(self, config: ELRConfig, slots: list[int], vllm_config: VllmConfig) -> None:
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.hd = config.head_dim
        self.n_heads = config.n_heads // tp
        self.n_kv = max(1, config.n_kv_heads // tp)
        self.q_size, self.kv_size = self.n_heads * self.hd, self.n_kv * self.hd
        self.qkv = QKVParallelLinear(
            config.d_model, self.hd, config.n_heads, config.n_kv_heads, bias=config.qkv_bias
        )
        self.o = RowParallelLinear(config.n_heads * self.hd, config.d_model, bias=False)
        self.q_norm = RMSNorm(self.hd, eps=config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.hd, eps=config.norm_eps) if config.qk_norm else None
        self.rotary = get_rope(self.hd, config.max_seq_len, is_neox_style=True, rope_parameters=_rope_parameters(config))
        self.calls = nn.ModuleList(
            Attention(
                self.n_heads, self.hd, self.hd**-0.5, num_kv_heads=self.n_kv,
                cache_config=vllm_config.cache_config, quant_config=vllm_config.quant_config,
                prefix=f"elr.slots.{slot}.attn",
            )
            for slot in slots
        )  # fmt: skip

    def forward(self, positions: Tensor, x: Tensor, call: int, hold: Optional[list], active: Optional[Tensor]) -> Tensor:
        """Attend with the ``call``-th store; ``hold``/``active``: keep inactive rows' held keys and values."""
        q, k, v = self.qkv(x)[0].split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.hd)).view_as(q)
            k = self.k_norm(k.reshape(-1, self.hd)).view_as(k)
        q, k = self.rotary(positions, q, k)
        if hold is not None:
            if active is not None and hold[0] is not None:
                k, v = torch.where(active, k, hold[0]), torch.where(active, v, hold[1])
            hold[:] = [k, v]
        return self.o(self.calls[call](q, k, v))[0]


class ELRMLP(nn.Module):
    """SwiGLU, gate and up in one column-parallel projection (the export's ``up`` is ``[gate; up]``)."""

    def __init__(self, config: ELRConfig) -> None:
        super().__init__()
        self.up = MergedColumnParallelLinear(config.d_model, [config.d_ff, config.d_ff], bias=False)
        self.down = RowParallelLinear(config.d_ff, config.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """``down(silu(gate) * up)``."""
        gate, up = self.up(x)[0].chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)[0]


class ELRBlock(nn.Module):
    """One pre-norm attention + SwiGLU layer; recurrent and output layers carry modulators when conditioned."""

    def __init__(self, config: ELRConfig, slots: list[int], modulated: bool, vllm_config: VllmConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.attn = ELRAttention(config, slots, vllm_config)
        self.mlp_norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.mlp = ELRMLP(config)
        cond = config.conditioning if modulated else None
        self.attn_mod = ELRModulator(config.d_model, cond["d_cond"], cond["rank"]) if cond else None
        self.mlp_mod = ELRModulator(config.d_model, cond["d_cond"], cond["rank"]) if cond else None

    def forward(
        self, positions: Tensor, x: Tensor, c: Optional[Tensor], call: int,
        hold: Optional[list] = None, active: Optional[Tensor] = None,
    ) -> Tensor:  # fmt: skip
        """The layer with its ``call``-th KV store, under the per-row context ``c`` (or none)."""
        h = self.attn_norm(x)
        if c is not None and self.attn_mod is not None:
            h = self.attn_mod.post(self.attn(positions, self.attn_mod.pre(h, c), call, hold, active), c)
        else:
            h = self.attn(positions, h, call, hold, active)
        x = x + h
        h = self.mlp_norm(x)
        if c is not None and self.mlp_mod is not None:
            return x + self.mlp_mod.post(self.mlp(self.mlp_mod.pre(h, c)), c)
        return x + self.mlp(h)


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
            return torch.lerp(s, r, beta)
        if self.rule == "fixed_delta":
            return s + self.beta * (r - s)
        if self.rule == "residual":
            return s + (r - s_tilde)
        return r


class ELRConditioner(nn.Module):
    """c_i = MLP([phi(i / k); phi(k / K)]) for many (i, k) at once (eq. 4; ``beyond_budget`` past K)."""

    def __init__(self, d_cond: int, n_freqs: int, beyond_budget: str = "clamp", **_: int) -> None:
        super().__init__()
        self.n_freqs, self.beyond_budget = n_freqs, beyond_budget
        self.mlp = nn.Sequential(nn.Linear(4 * n_freqs, d_cond), nn.SiLU(), nn.Linear(d_cond, d_cond))

    def forward(self, pairs: list[tuple[int, int]], max_loops: int) -> Tensor:
        """The contexts ``[len(pairs), d_cond]`` of loop i of k for each ``(i, k)`` of ``pairs``."""
        device = self.mlp[0].weight.device
        freqs = math.pi * 2.0 ** torch.arange(self.n_freqs, dtype=torch.float32, device=device)
        rows = []
        for loop, loops in pairs:
            tau, kappa = loop / loops, loops / max_loops
            if loops > max_loops and self.beyond_budget != "ratio":
                kappa = 1.0
                if self.beyond_budget == "replay":
                    tau = min(loop, max_loops) / max_loops
            rows.append(torch.cat(((freqs * tau).sin(), (freqs * tau).cos(), (freqs * kappa).sin(), (freqs * kappa).cos())))
        return self.mlp(torch.stack(rows).to(self.mlp[0].weight.dtype))


class ELRCore(nn.Module):
    """The shared recurrent block with its state update and conditioner."""

    def __init__(self, config: ELRConfig, served: ServedELR, vllm_config: VllmConfig) -> None:
        super().__init__()
        self.update = ELRUpdate(config)
        self.conditioner = ELRConditioner(**config.conditioning) if config.conditioning else None
        self.layers = nn.ModuleList(
            ELRBlock(config, served.rec_slots(j), True, vllm_config) for j in range(config.n_rec)
        )


class ELRModel(nn.Module):
    """The looped trunk: embedding, input block, recurrent core at each row's k, output block, final norm."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config, self.served = config, served_elr(config)
        self.embed = VocabParallelEmbedding(config.vocab_size, config.d_model)
        self.input_layers = nn.ModuleList(
            ELRBlock(config, [j], False, vllm_config) for j in range(config.n_in)
        )
        self.core = ELRCore(config, self.served, vllm_config)
        self.output_layers = nn.ModuleList(
            ELRBlock(config, [self.served.out_slot(j)], True, vllm_config) for j in range(config.n_out)
        )
        self.norm = RMSNorm(config.d_model, eps=config.norm_eps)

    def contexts(self, ks: list[int]) -> dict[tuple[int, int], Tensor]:
        """c_i of every loop i of every k in ``ks`` (eq. 4), or an empty dict without conditioning."""
        conditioner = self.core.conditioner
        if conditioner is None or not self.config.conditioning_active:
            return {}
        pairs = [(i, k) for k in ks for i in range(1, k + 1)]
        return dict(zip(pairs, conditioner(pairs, self.config.max_loops)))

    def forward(self, input_ids: Tensor, positions: Tensor, loops: Tensor) -> Tensor:
        """Final hidden states ``[T, d]``; ``loops`` ``[T]`` is each token's k."""
        served = self.served
        ks = sorted(set(loops.tolist()))  # one host sync per step: the loop count is a Python-level choice
        mixed = len(ks) > 1
        table = self.contexts(ks)
        index = loops.new_zeros(loops.shape)  # each token's position in ks
        for n, k in enumerate(ks):
            index[loops == k] = n

        def context(i: int) -> Optional[Tensor]:
            """The per-row context of loop i (a row past its k: its last loop's, unused)."""
            if not table:
                return None
            if not mixed:
                return table[(i, ks[0])][None]
            return torch.stack([table[(min(i, k), k)] for k in ks])[index]

        x = self.embed(input_ids)
        for layer in self.input_layers:
            x = layer(positions, x, None, 0)
        update, h_in = self.core.update, x
        s = h_in
        holds = [[None, None] for _ in self.core.layers] if served.last_loop and mixed else [None] * len(self.core.layers)
        for i in range(1, ks[-1] + 1):
            active = (loops >= i)[:, None] if mixed else None
            c = context(i)
            s_tilde = update.inject(s, h_in)
            r = s_tilde
            for j, layer in enumerate(self.core.layers):
                r = layer(positions, r, c, served.rec_call(i), holds[j], active)
            new = update(s, r, s_tilde)
            s = torch.where(active, new, s) if active is not None and i > ks[0] else new
        c = None
        if table:
            c = table[(ks[0], ks[0])][None] if not mixed else torch.stack([table[(k, k)] for k in ks])[index]
        for layer in self.output_layers:
            s = layer(positions, s, c, 0)
        return self.norm(s)


class ELRForCausalLM(nn.Module):
    """vLLM's face of an ``elr export`` folder (architecture ``ELRForCausalLM``), k per request.

    The runner hook of :mod:`elr_lightning.vllm.loops` passes ``loops`` (each token's request's k);
    without it (profiling runs, a runner without the hook) every token runs the folder's default k.
    """

    #: Tells :mod:`elr_lightning.vllm.loops`'s runner hook to pass per-token loop counts.
    elr_loops_per_token = True

    @staticmethod
    def get_model_state_cls() -> type:
        """Model Runner V2's per-request state (CUDA builds): :func:`~elr_lightning.vllm.loops.elr_model_state`."""
        return elr_model_state()

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = ELRModel(vllm_config=vllm_config, prefix=prefix)
        self.lm_head = ParallelLMHead(config.vocab_size, config.d_model)
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        """The token embedding."""
        return self.model.embed(input_ids)

    def forward(
        self,
        input_ids: Optional[Tensor],
        positions: Tensor,
        intermediate_tensors: Optional[IntermediateTensors] = None,
        inputs_embeds: Optional[Tensor] = None,
        loops: Optional[Tensor] = None,
        **_: object,
    ) -> Tensor:
        """Final hidden states of every scheduled token, each at its request's k."""
        if inputs_embeds is not None:
            raise ValueError("elr_lightning's vLLM model takes token ids, not prompt embeddings")
        n = input_ids.shape[0]
        default = self.model.served.default_loops
        if loops is None:
            loops = torch.full((n,), default, dtype=torch.long, device=input_ids.device)
        elif loops.shape[0] < n:  # padded batch: the padding rows run at the default k
            loops = F.pad(loops.to(input_ids.device, torch.long), (0, n - loops.shape[0]), value=default)
        return self.model(input_ids, positions, loops[:n].to(input_ids.device, torch.long))

    def compute_logits(self, hidden_states: Tensor) -> Optional[Tensor]:
        """Logits of the head (vocabulary-parallel, gathered)."""
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Load the export's ``model.safetensors``: q and kv into the fused QKV, gate-and-up into the merged MLP."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        kv = self.config.n_kv_heads * self.config.head_dim
        for name, tensor in weights:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if ".attn.q." in name:
                target = name.replace(".attn.q.", ".attn.qkv.")
                params[target].weight_loader(params[target], tensor, "q")
            elif ".attn.kv." in name:
                target = name.replace(".attn.kv.", ".attn.qkv.")
                params[target].weight_loader(params[target], tensor[:kv], "k")
                params[target].weight_loader(params[target], tensor[kv:], "v")
            elif ".mlp.up." in name:
                target = name
                gate, up = tensor.chunk(2, dim=0)
                params[target].weight_loader(params[target], gate, 0)
                params[target].weight_loader(params[target], up, 1)
            else:
                target = name
                getattr(params[target], "weight_loader", default_weight_loader)(params[target], tensor)
            loaded.add(target)
        if self.config.tie_word_embeddings:
            loaded.add("lm_head.weight")
        return loaded
