"""The architecture numbers of a looped language model, validated in one place."""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator, Optional, TypedDict, Union

#: Mixer names every config knows; ``arch.mixers`` adds more or overrides these.
BUILTIN_MIXERS: dict[str, str] = {
    "attention": "elr_lightning.mixers.Attention",
    "gdp": "elr_lightning.mixers.GatedDeltaProduct",
    "moe": "elr_lightning.mixers.MoE",
    "swiglu": "elr_lightning.mixers.SwiGLU",
}

#: Route replay modes of routed channel mixers (table 4.3): (A) route at every loop, (B) replay loop 1's
#: expert assignments at inference only, (C) replay them in training and inference; and this library's
#: variant of C that replays loop 1's experts but recomputes the gate weights at every loop.
ROUTE_REPLAY = ("dynamic", "replay_inference", "replay", "replay_experts")

#: Keys of Llama 3's RoPE frequency scaling (``arch.rope_scaling`` with ``rope_type: llama3``).
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def check_rope_scaling(scaling: Optional[dict[str, Any]]) -> None:
    """Refuse an ``arch.rope_scaling`` other than ``None`` or Llama 3's (every key a positive number).

    Raises:
        ValueError: naming ``arch.rope_scaling`` and what it must hold.
    """
    if scaling is None:
        return
    if not isinstance(scaling, dict) or scaling.get("rope_type") != "llama3":
        raise ValueError(
            f"arch.rope_scaling={scaling!r}: only rope_type llama3 is implemented; give "
            f"{{rope_type: llama3, {', '.join(LLAMA3_ROPE_KEYS)}}} or null"
        )
    bad = [
        key for key in LLAMA3_ROPE_KEYS
        if isinstance(scaling.get(key), bool) or not isinstance(scaling.get(key), (int, float)) or not scaling[key] > 0
    ]
    extra = sorted(set(scaling) - {"rope_type", *LLAMA3_ROPE_KEYS})
    if bad or extra:
        raise ValueError(
            f"arch.rope_scaling={scaling!r}: "
            + (f"{bad} must be positive numbers" if bad else f"unknown keys {extra}")
            + f"; llama3 scaling takes {list(LLAMA3_ROPE_KEYS)}"
        )
    if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ValueError(f"arch.rope_scaling={scaling!r}: high_freq_factor must exceed low_freq_factor")


class MixerSpec(TypedDict, total=False):
    """A layer of one's own in ``arch.mixers``: its class and its constructor's arguments after the config.

    The arguments are plain data (``None``, booleans, numbers, strings or lists of them), so a
    checkpoint that records them builds nothing but the mixer (:mod:`elr_lightning.checkpoints.schema`).
    """

    class_path: str
    init_args: dict[str, Any]


def _is_plain_leaf(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(map(_is_plain_leaf, value))
    return value is None or isinstance(value, (bool, int, float, str))


#: The largest loop budget ``arch.max_loops`` (and loop count a module validates at): a module builds
#: two metrics per loop count, so a checkpoint's count is bounded before anything is built.
MAX_LOOPS = 1024

#: The longest RoPE table ``arch.max_seq_len``: no tensor of a checkpoint holds it, and the table
#: (``max_seq_len x head_dim`` floats, twice) is allocated when the model is built.
MAX_SEQ_LEN = 1 << 20

#: The three blocks of a looped LM, in stack order.
BLOCKS = ("in", "rec", "out")


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
        max_seq_len: Length of the RoPE table: the longest sequence the model accepts (at most
            :data:`MAX_SEQ_LEN`).
        rope_base: RoPE frequency base.
        max_loops: The loop budget K that budget conditioning (kappa = k / K, eq. 4) refers to,
            and the largest k a sampler may draw (at most :data:`MAX_LOOPS`).
        tie_embeddings: Share the embedding matrix with the LM head.
        norm_eps: RMSNorm epsilon.
        init_std: Standard deviation of the normal init of every matrix (see ``LoopedLM.init_weights``).
        token_pattern: Token mixer of each layer, repeated within every block: layer ``j`` of a block
            uses ``pattern[j % len(pattern)]``, so each block's layer count must be a multiple of the
            pattern's length. ``[gdp, gdp, gdp, attention]`` is a 3:1 GDP-Hybrid. A mapping
            ``{in: [...], rec: [...], out: [...]}`` gives each block its own pattern (a block left
            out uses ``[attention]``).
        channel_pattern: Channel mixer of each layer, as ``token_pattern`` (default ``[swiglu]``).
        head_size: Width of one attention head; ``None`` means ``d_model / n_heads``. Set it for models
            whose heads are wider or narrower than that (Qwen3: 16 heads of 128 at d = 1024).
        rope_scaling: RoPE frequency scaling, ``None`` for none, or Llama 3's
            ``{rope_type: llama3, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings}``.
        qk_norm: RMSNorm each query and key head before RoPE (Qwen3).
        qkv_bias: Biases on the query, key and value projections (Qwen2).
        mixers: Named mixers the patterns may use besides (or instead of) the built-in
            ``attention``, ``gdp`` and ``swiglu``: ``{name: class_path}`` or
            ``{name: {class_path: ..., init_args: {...}}}``. A pattern entry may also be a class
            path itself. Each mixer is built as ``cls(config, **init_args)``.
        route_replay: Route replay mode of every routed channel mixer (``moe``) that does not set
            its own ``replay``: ``dynamic``, ``replay_inference``, ``replay`` or ``replay_experts`` (see
            :mod:`elr_lightning.mixers.moe`); ``None`` leaves each mixer's own (default ``dynamic``).
            Refused on a model without a routed channel mixer.
    """

    #: Types that a checkpoint's ``arch`` is checked against where they are narrower than the field's
    #: annotation (which the command line parses by): a mixer entry is a class path or a :class:`MixerSpec`
    #: (see :mod:`elr_lightning.checkpoints.schema`).
    SCHEMA_HINTS: ClassVar[dict[str, Any]] = {"mixers": dict[str, Union[str, MixerSpec]]}

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
    token_pattern: Union[list[str], dict[str, list[str]]] = field(default_factory=lambda: ["attention"])
    channel_pattern: Union[list[str], dict[str, list[str]]] = field(default_factory=lambda: ["swiglu"])
    mixers: dict[str, Union[str, dict[str, Any]]] = field(default_factory=dict)
    route_replay: Optional[str] = None
    head_size: Optional[int] = None
    rope_scaling: Optional[dict[str, Any]] = None
    qk_norm: bool = False
    qkv_bias: bool = False

    def __post_init__(self) -> None:
        def integer(name: str, minimum: int, why: str = "", maximum: Optional[int] = None) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"arch.{name}={value!r} must be an integer >= {minimum}{why}")
            if maximum is not None and value > maximum:
                raise ValueError(f"arch.{name}={value!r} exceeds the maximum {maximum}{why}")

        for name in ("vocab_size", "d_model", "n_heads", "ff_multiple_of"):
            integer(name, 1)
        integer("max_seq_len", 1, " (the length of the RoPE table)", MAX_SEQ_LEN)
        integer("n_rec", 1, ": a looped model needs at least one shared recurrent layer")
        integer("max_loops", 1, " (it is the loop budget K)", MAX_LOOPS)
        for name in ("n_in", "n_out"):
            integer(name, 0)
        if self.n_kv_heads is not None:
            integer("n_kv_heads", 1, " dividing arch.n_heads, or null for arch.n_heads")
        if self.d_ff is not None:
            integer("d_ff", 1, " (or null for the 8/3 d default)")
        if self.head_size is not None:
            integer("head_size", 2, " (the width of one attention head), or null for d_model / n_heads")
        for name in ("tie_embeddings", "qk_norm", "qkv_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"arch.{name}={getattr(self, name)!r} must be true or false")
        check_rope_scaling(self.rope_scaling)
        for name in ("init_std", "norm_eps", "rope_base"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"arch.{name}={value!r} must be a finite number")
            if value <= (1 if name == "rope_base" else 0):
                raise ValueError(f"arch.{name}={value!r} must be > {1 if name == 'rope_base' else 0}")
        if self.head_size is None and self.d_model % self.n_heads:
            raise ValueError(
                f"arch.d_model={self.d_model} is not divisible by arch.n_heads={self.n_heads}; "
                "pick d_model as a multiple of n_heads"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"arch.d_model / arch.n_heads = {self.head_dim} must be even for rotary embeddings; "
                "pick d_model as a multiple of 2 * n_heads"
                if self.head_size is None
                else f"arch.head_size={self.head_size} must be even for rotary embeddings"
            )
        kv = self.kv_heads
        if kv < 1 or self.n_heads % kv:
            raise ValueError(f"arch.n_kv_heads={kv} must be >= 1 and divide arch.n_heads={self.n_heads}")
        self._check_patterns()
        self._check_route_replay()

    def _check_route_replay(self) -> None:
        if self.route_replay is None:
            return
        if self.route_replay not in ROUTE_REPLAY:
            raise ValueError(
                f"arch.route_replay={self.route_replay!r} is not a route replay mode; use one of {ROUTE_REPLAY}"
            )
        names = {p for block in BLOCKS for p in self._pattern("channel_pattern", block)}
        if not any(getattr(self.mixer_spec(name)[0], "routed", False) for name in names):
            raise ValueError(
                f"arch.route_replay={self.route_replay!r} needs a routed channel mixer, but arch.channel_pattern "
                f"uses {sorted(names)}; put moe in arch.channel_pattern or remove route_replay"
            )

    def _check_patterns(self) -> None:
        from elr_lightning.mixers.base import ChannelMixer, TokenMixer

        if not isinstance(self.mixers, dict):
            raise ValueError(
                f"arch.mixers={self.mixers!r} must be a mapping {{name: class_path or {{class_path, init_args}}}}"
            )
        for field_name, base in (("token_pattern", TokenMixer), ("channel_pattern", ChannelMixer)):
            value = getattr(self, field_name)
            if isinstance(value, dict) and set(value) - set(BLOCKS):
                raise ValueError(
                    f"arch.{field_name} has keys {sorted(set(value) - set(BLOCKS))}; "
                    f"a per-block pattern takes keys {list(BLOCKS)}"
                )
            for block, n in zip(BLOCKS, (self.n_in, self.n_rec, self.n_out)):
                where = f"arch.{field_name}.{block}" if isinstance(value, dict) else f"arch.{field_name}"
                pattern = self._pattern(field_name, block)
                if isinstance(pattern, str) or not pattern or not all(isinstance(p, str) for p in pattern):
                    raise ValueError(f"{where}={pattern!r} must be a non-empty list of mixer names")
                if n % len(pattern):
                    raise ValueError(
                        f"{where} has {len(pattern)} entries, which does not divide arch.n_{block}={n}; "
                        f"make the block's layer count a multiple of the pattern length"
                    )
            names = {p for block in BLOCKS for p in self._pattern(field_name, block)}
            for name in sorted(names):
                cls, _ = self.mixer_spec(name)
                if not (isinstance(cls, type) and issubclass(cls, base)):
                    raise ValueError(
                        f"arch.{field_name} entry {name!r} resolves to {cls!r}, which is not a {base.__name__}; "
                        f"name a {base.__name__} subclass there"
                    )

    @classmethod
    def schema_classes(cls, arch: dict[str, Any]) -> Iterator[tuple[str, Any, tuple[type, ...], dict[str, Any], int]]:
        """The classes an ``arch`` mapping names, for :mod:`elr_lightning.checkpoints.schema` to resolve as trusted.

        Every entry of ``mixers`` (used or not, a token or channel mixer) and every pattern entry
        (of its pattern's kind), as ``(field, class path, bases, init_args, leading)``: ``field``
        below ``arch``, and ``leading`` the constructor's positional arguments before ``init_args``
        (the config).
        """
        from elr_lightning.mixers.base import ChannelMixer, TokenMixer

        mixers = arch.get("mixers") or {}
        bases: dict[str, tuple[type, ...]] = {name: (TokenMixer, ChannelMixer) for name in mixers}
        for pattern_field, base in (("token_pattern", TokenMixer), ("channel_pattern", ChannelMixer)):
            pattern = arch.get(pattern_field) or []
            for block in pattern.values() if isinstance(pattern, dict) else [pattern]:
                bases.update((name, (base,)) for name in block)
        for name, base in sorted(bases.items()):
            spec = mixers.get(name, BUILTIN_MIXERS.get(name, name))
            where = f"mixers.{name}" if name in mixers else "token_pattern/channel_pattern"
            if isinstance(spec, dict):
                yield f"{where}.class_path", spec.get("class_path"), base, dict(spec.get("init_args") or {}), 2
            else:
                yield where, spec, base, {}, 2

    def mixer_spec(self, name: str) -> tuple[type, dict[str, Any]]:
        """The class and ``init_args`` a pattern entry ``name`` stands for.

        Raises:
            ValueError: ``name`` is neither a known mixer name nor an importable class path.
        """
        spec: Union[str, dict[str, Any]] = self.mixers.get(name, BUILTIN_MIXERS.get(name, name))
        if isinstance(spec, str):
            spec = {"class_path": spec}
        if isinstance(spec, dict) and any("." in str(key) for key in spec):
            raise ValueError(
                f"arch.mixers.{name}={spec!r}: a flag below one mixer (--model.init_args.arch.mixers.{name}.init_args.X) "
                f"replaces its whole entry, class_path included; give the entry whole: "
                f"--model.init_args.arch.mixers.{name} '{{class_path: ..., init_args: {{...}}}}'"
            )
        if not isinstance(spec, dict) or set(spec) - {"class_path", "init_args"} or "class_path" not in spec:
            raise ValueError(
                f"arch.mixers.{name}={spec!r} must be a class path or {{class_path: ..., init_args: {{...}}}}"
            )
        path, init_args = spec["class_path"], dict(spec.get("init_args") or {})
        bad = sorted(key for key, value in init_args.items() if not _is_plain_leaf(value))
        if bad:
            raise ValueError(
                f"arch.mixers.{name}.init_args.{bad[0]}={init_args[bad[0]]!r}: a mixer's arguments are plain data "
                "(null, booleans, numbers, strings or lists of them), so that a checkpoint can record them"
            )
        module_name, _, attr = str(path).rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), attr) if module_name else None
        except (ImportError, AttributeError):
            cls = None
        if cls is None:
            raise ValueError(
                f"unknown mixer {name!r} (class path {path!r}) in arch.token_pattern/channel_pattern; use one of "
                f"{sorted({**BUILTIN_MIXERS, **self.mixers})} or an importable class path, or declare it in arch.mixers"
            )
        return cls, init_args

    def build_mixer(self, name: str) -> Any:
        """Build the mixer a pattern entry names as ``cls(self, **init_args)``.

        Raises:
            ValueError: an ``init_args`` entry is unknown to the class or has a bad value; the
                message names ``arch.mixers.<name>.init_args``.
        """
        cls, init_args = self.mixer_spec(name)
        try:
            return cls(self, **init_args)
        except (TypeError, ValueError) as err:
            raise ValueError(f"arch.mixers.{name}.init_args={init_args}: {err}") from err

    def layer_index(self, block: str, j: int) -> int:
        """The number of layer ``j`` of ``block`` (``in``, ``rec``, ``out``) in the whole stack.

        The one numbering of layers: ``LoopContext`` stores and every cache policy key by it.
        """
        return {"in": 0, "rec": self.n_in, "out": self.n_in + self.n_rec}[block] + j

    def _pattern(self, field_name: str, block: str) -> list[str]:
        value = getattr(self, field_name)
        if isinstance(value, dict):
            return value.get(block, ["attention" if field_name == "token_pattern" else "swiglu"])
        return value

    def layer_mixers(self, block: str, j: int) -> tuple[str, str]:
        """``(token mixer, channel mixer)`` pattern entries of layer ``j`` of ``block``."""
        token, channel = self._pattern("token_pattern", block), self._pattern("channel_pattern", block)
        return token[j % len(token)], channel[j % len(channel)]

    def layer_calls(self, loops: int) -> Iterator[tuple[int, int, str]]:
        """``(layer, loop, token mixer)`` of every layer call of one forward pass at loop count ``loops``.

        Loop is ``1..k`` in the recurrent block and ``0`` in the input and output blocks.
        """
        for block, n in zip(BLOCKS, (self.n_in, self.n_rec, self.n_out)):
            for loop in range(1, loops + 1) if block == "rec" else (0,):
                for j in range(n):
                    yield self.layer_index(block, j), loop, self.layer_mixers(block, j)[0]

    @property
    def head_dim(self) -> int:
        """Width of one attention head: ``head_size``, else ``d_model / n_heads``."""
        return self.d_model // self.n_heads if self.head_size is None else self.head_size

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
