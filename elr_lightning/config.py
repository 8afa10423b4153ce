"""The architecture numbers of a looped language model, validated in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class ModelConfig:
    """Architecture of a latent-recurrent LM: input block, shared recurrent block, output block.

    The effective depth at loop count k is ``n_in + k * n_rec + n_out`` (eq. 1). Every field is
    checked in ``__post_init__``; a bad value raises ``ValueError`` naming the field (as it is
    spelled under ``model.init_args.arch`` in YAML) and the fix.

    Args:
        vocab_size: Rows of the embedding table; at least the tokenizer's vocabulary.
        d_model: Hidden width d.
        n_heads: Query heads per attention layer; must divide ``d_model``.
        n_kv_heads: Key/value heads (grouped-query attention); must divide ``n_heads``.
            ``None`` means ``n_heads`` (plain multi-head attention).
        n_in: Layers in the input block (L_in).
        n_rec: Layers in the recurrent block (L_rec), applied k times with shared weights.
        n_out: Layers in the output block (L_out).
        d_ff: SwiGLU hidden width; ``None`` means 8/3 d rounded up to ``ff_multiple_of``.
        ff_multiple_of: Rounding for the default ``d_ff``.
        max_seq_len: Length of the RoPE table: the longest sequence the model accepts.
        rope_base: RoPE frequency base.
        max_loops: The loop budget K that budget conditioning (kappa = k / K, eq. 4) refers to,
            and the largest k a sampler may draw.
        tie_embeddings: Share the embedding matrix with the LM head.
        norm_eps: RMSNorm epsilon.
        init_std: Standard deviation of the normal init of every matrix (see ``LoopedLM.init_weights``).
    """

    vocab_size: int = 256
    d_model: int = 128
    n_heads: int = 4
    n_kv_heads: Optional[int] = None
    n_in: int = 1
    n_rec: int = 2
    n_out: int = 1
    d_ff: Optional[int] = None
    ff_multiple_of: int = 64
    max_seq_len: int = 2048
    rope_base: float = 10000.0
    max_loops: int = 4
    tie_embeddings: bool = True
    norm_eps: float = 1e-6
    init_std: float = 0.02

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"arch.{name}={value!r} must be an integer >= 1")

        for name in ("vocab_size", "d_model", "n_heads", "max_seq_len", "ff_multiple_of"):
            positive(name)
        if self.n_rec < 1:
            raise ValueError(
                f"arch.n_rec={self.n_rec} must be >= 1: a looped model needs at least one shared recurrent layer"
            )
        if self.max_loops < 1:
            raise ValueError(f"arch.max_loops={self.max_loops} must be >= 1 (it is the loop budget K)")
        for name in ("n_in", "n_out"):
            if getattr(self, name) < 0:
                raise ValueError(f"arch.{name}={getattr(self, name)} must be >= 0")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"arch.d_model={self.d_model} is not divisible by arch.n_heads={self.n_heads}; "
                "pick d_model as a multiple of n_heads"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"arch.d_model / arch.n_heads = {self.head_dim} must be even for rotary embeddings"
            )
        kv = self.kv_heads
        if kv < 1 or self.n_heads % kv:
            raise ValueError(f"arch.n_kv_heads={kv} must be >= 1 and divide arch.n_heads={self.n_heads}")
        if self.d_ff is not None and self.d_ff < 1:
            raise ValueError(f"arch.d_ff={self.d_ff} must be >= 1 (or null for the 8/3 d default)")
        if self.init_std <= 0 or self.norm_eps <= 0 or self.rope_base <= 1:
            raise ValueError("arch.init_std and arch.norm_eps must be > 0 and arch.rope_base > 1")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads after resolving the ``None`` default."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ff_dim(self) -> int:
        """SwiGLU hidden width after resolving the ``None`` default."""
        if self.d_ff is not None:
            return self.d_ff
        raw = int(8 * self.d_model / 3)
        return -(-raw // self.ff_multiple_of) * self.ff_multiple_of

    def effective_depth(self, loops: int) -> int:
        """D_eff(k) = L_in + k L_rec + L_out, eq. (1)."""
        return self.n_in + loops * self.n_rec + self.n_out
