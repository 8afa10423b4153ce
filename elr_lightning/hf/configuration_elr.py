"""Hugging Face configuration of an Elastic Latent Recurrence (ELR) looped language model.

Written by ``elr export`` beside ``modeling_elr.py``; self-contained (imports only ``transformers``),
so an export loads with ``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`` where
``elr_lightning`` is not installed.
"""

from typing import Optional

from transformers import PretrainedConfig

#: State-update rules the modeling file implements (eq. 2 and the paper's ablation rules).
STATE_UPDATES = ("adaptive_delta", "fixed_delta", "residual", "replace", "non_recurrent")

#: Token mixers the modeling file implements (``type`` of each ``token_mixers`` entry; ``channel_mixers``
#: entries take :data:`CHANNEL_MIXERS`): softmax attention and Gated DeltaProduct.
TOKEN_MIXERS = ("attention", "gdp")
#: Channel mixers the modeling file implements: SwiGLU and mixture of experts.
CHANNEL_MIXERS = ("swiglu", "moe")


class ELRConfig(PretrainedConfig):
    """Architecture of a looped LM: input block, shared recurrent block applied k times, output block.

    The field names are those of ``elr_lightning``'s ``ModelConfig`` (``d_model``, ``n_heads``, ...),
    with the usual Hugging Face names as aliases. The effective depth at loop count k is
    ``n_in + k * n_rec + n_out`` (eq. 1).

    Args:
        vocab_size: Rows of the embedding table.
        d_model: Hidden width d.
        n_heads: Query heads per attention layer.
        n_kv_heads: Key/value heads (grouped-query attention); ``None`` means ``n_heads``.
        n_in: Layers in the input block.
        n_rec: Layers in the recurrent block, applied k times with shared weights.
        n_out: Layers in the output block.
        d_ff: SwiGLU hidden width (resolved, never ``None`` in an export).
        max_seq_len: Longest sequence (RoPE table length).
        rope_base: RoPE frequency base.
        max_loops: The loop budget K of budget conditioning (kappa = k / K, eq. 4).
        norm_eps: RMSNorm epsilon.
        init_std: Standard deviation of the normal init.
        state_update: One of :data:`STATE_UPDATES`.
        fixed_delta_beta: Step size of the ``fixed_delta`` rule.
        conditioning: ``{"d_cond", "rank", "n_freqs", "beyond_budget"}`` of the eq. 4 loop conditioning, or ``None``.
        conditioning_active: Whether the conditioning takes part in the forward pass.
        default_loops: k used when ``forward`` or ``generate`` gets no ``loops``.
        tie_word_embeddings: The LM head shares the embedding matrix.
        head_dim: Width of one attention head; ``None`` means ``d_model / n_heads``.
        rope_freq_scaling: Llama 3 RoPE scaling (``rope_type: llama3``), or ``None`` (``transformers`` reserves
            the name ``rope_scaling``).
        qk_norm: RMSNorm each query and key head before RoPE.
        qkv_bias: Biases on the query, key and value projections.
        injection: The recurrent block's input, ``sum`` (s~_i = s_{i-1} + h_in, eq. 2) or ``mean``
            (their mean).
        token_mixers: The token mixer of each layer in stack order (input, recurrent, output
            layers, each unique layer once): ``{"type": "attention"}`` or ``{"type": "gdp", ...}``
            with the Gated DeltaProduct's widths; ``None`` means attention everywhere.
        channel_mixers: The channel mixer of each layer, as ``token_mixers``: ``{"type": "swiglu"}``
            or ``{"type": "moe", ...}`` with the experts' sizes and route replay mode; ``None``
            means SwiGLU everywhere.
    """

    model_type = "elr"
    attribute_map = {
        "hidden_size": "d_model",
        "num_attention_heads": "n_heads",
        "num_key_value_heads": "n_kv_heads",
        "intermediate_size": "d_ff",
        "max_position_embeddings": "max_seq_len",
        "rope_theta": "rope_base",
        "rms_norm_eps": "norm_eps",
        "initializer_range": "init_std",
    }

    def __init__(
        self,
        vocab_size: int = 256,
        d_model: int = 128,
        n_heads: int = 4,
        n_kv_heads: Optional[int] = None,
        n_in: int = 1,
        n_rec: int = 2,
        n_out: int = 1,
        d_ff: int = 384,
        max_seq_len: int = 2048,
        rope_base: float = 10000.0,
        max_loops: int = 4,
        norm_eps: float = 1e-6,
        init_std: float = 0.02,
        state_update: str = "adaptive_delta",
        fixed_delta_beta: float = 0.5,
        conditioning: Optional[dict] = None,
        conditioning_active: bool = True,
        default_loops: int = 1,
        tie_word_embeddings: bool = True,
        head_dim: Optional[int] = None,
        rope_freq_scaling: Optional[dict] = None,
        qk_norm: bool = False,
        qkv_bias: bool = False,
        injection: str = "sum",
        token_mixers: Optional[list[dict]] = None,
        channel_mixers: Optional[list[dict]] = None,
        **kwargs,
    ) -> None:
        if state_update not in STATE_UPDATES:
            raise ValueError(f"state_update={state_update!r} must be one of {STATE_UPDATES}")
        if injection not in ("sum", "mean"):
            raise ValueError(f"injection={injection!r} must be 'sum' or 'mean'")
        if (head_dim is None and d_model % n_heads) or (n_kv_heads is not None and n_heads % n_kv_heads):
            raise ValueError(f"n_heads={n_heads} must divide d_model={d_model} and be divisible by n_kv_heads")
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.n_heads = n_heads
        self.n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        self.n_in, self.n_rec, self.n_out = n_in, n_rec, n_out
        self.d_ff = d_ff
        self.max_seq_len = max_seq_len
        self.rope_base = rope_base
        self.max_loops = max_loops
        self.norm_eps = norm_eps
        self.init_std = init_std
        self.state_update = state_update
        self.fixed_delta_beta = fixed_delta_beta
        self.conditioning = conditioning
        self.conditioning_active = conditioning_active
        self.default_loops = default_loops
        self.head_dim = d_model // n_heads if head_dim is None else head_dim
        self.rope_freq_scaling = rope_freq_scaling
        self.qk_norm, self.qkv_bias, self.injection = qk_norm, qkv_bias, injection
        layers = n_in + n_rec + n_out
        for name, mixers, types in (
            ("token_mixers", token_mixers, TOKEN_MIXERS), ("channel_mixers", channel_mixers, CHANNEL_MIXERS)
        ):
            if mixers is not None and (len(mixers) != layers or any(m.get("type") not in types for m in mixers)):
                raise ValueError(f"{name} must hold one mixer of {types} per layer ({layers}), not {mixers!r}")
        self.token_mixers = token_mixers
        self.channel_mixers = channel_mixers
        # One cache layer per attention call at k = max_loops (per-loop caching, eq. 1).
        self.num_hidden_layers = n_in + max_loops * n_rec + n_out
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    def layer_mixers(self, index: int) -> tuple[dict, dict]:
        """``(token mixer, channel mixer)`` of layer ``index`` in stack order (input, recurrent, output)."""
        token = self.token_mixers[index] if self.token_mixers is not None else {"type": "attention"}
        channel = self.channel_mixers[index] if self.channel_mixers is not None else {"type": "swiglu"}
        return token, channel

    def effective_depth(self, loops: int) -> int:
        """D_eff(k) = n_in + k n_rec + n_out, eq. (1)."""
        return self.n_in + loops * self.n_rec + self.n_out
