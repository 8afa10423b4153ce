"""``elr retrofit``: a local Hugging Face Llama-family model becomes an ELR checkpoint and an ``elr fit`` YAML.

Reads a folder as ``save_pretrained`` or a hub download leaves it (``config.json``, ``*.safetensors``,
``tokenizer.json``) of a ``LlamaForCausalLM`` (Llama 2/3, SmolLM), ``MistralForCausalLM``,
``Qwen2ForCausalLM`` or ``Qwen3ForCausalLM``, and splits its L layers into input block, shared
block and output block by layer ranges (half-open ``start:end``):

* ``input`` and ``output`` layers are copied; layers in no range are dropped;
* the shared block is initialised from the ``shared`` range: ``span`` takes those layers as the
  block (McLeish et al., 2025), ``average`` averages each position of its ``n_rec``-layer groups
  (Bae et al., 2024), shared layer j = mean of range layers j, j + n_rec, ...

Function preserved at k = 1: with every layer kept (``span``), the model is built with
``AdaptiveDelta(initial_step=1, injection="mean")``. Loop 1 then computes exactly the original
stack: s_0 = h_in, the block input s~_1 = (s_0 + h_in) / 2 = h_in, and beta_1 = sigmoid(0) *
softplus(softplus^-1(2)) = 1 makes s_1 = s_0 + 1 (r_1 - s_0) = r_1. The paper's eq. 2 defaults
(summed injection, beta = 0.3466) cannot: they feed the block 2 h_in and keep 65% of h_in in s_1,
whatever the weights. Later loops start as "replace" (s_i = R((s_{i-1} + h_in) / 2)), and the gate
learns its step from there. The conditioning heads (eq. 4) start at zero, so they change nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

import torch
from torch import Tensor

from elr_lightning.arguments import CommandParser, add_switch, command_parser
from elr_lightning.files import refuse_to_replace, write_file
from elr_lightning.config import ModelConfig
from elr_lightning.hf.config_json import read_json_object
from elr_lightning.hf.source_weights import SafetensorsWeights
from elr_lightning.tokenizers import HFTokenizer

#: ``architectures`` entries of ``config.json`` that retrofit reads, and their family.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

#: beta at init that makes loop 1 return the block's output, s_1 = r_1 (with mean injection, s~_1 = h_in).
RETROFIT_STEP = 1.0

#: Extra embedding rows a checkpoint may carry beyond its tokenizer's vocabulary (padding to a round size).
VOCAB_PADDING = 1024


@dataclass(frozen=True)
class Split:
    """Which source layers make the input, shared and output blocks (half-open ranges).

    Args:
        input: Layers copied into the input block.
        shared: Layers the shared block is initialised from.
        output: Layers copied into the output block.
        n_rec: Layers of the shared block; the length of ``shared`` for ``span``.
        init: ``span`` (the range is the block) or ``average`` (mean of its ``n_rec``-layer groups).
    """

    input: tuple[int, int]
    shared: tuple[int, int]
    output: tuple[int, int]
    n_rec: int
    init: str = "span"

    def keeps_every_layer(self, n_layers: int) -> bool:
        """True when the blocks are the source's layers in order, none dropped or averaged."""
        return self.init == "span" and self.input == (0, self.shared[0]) and self.output == (self.shared[1], n_layers)

    def source_layers(self, block: str, j: int) -> list[int]:
        """The source layers whose mean is layer ``j`` of ``block`` (one layer except for ``average``)."""
        if block == "in":
            return [self.input[0] + j]
        if block == "out":
            return [self.output[0] + j]
        return list(range(self.shared[0] + j, self.shared[1], self.n_rec))


def parse_range(text: str, field: str) -> tuple[int, int]:
    """``"a:b"`` as ``(a, b)``.

    Raises:
        ValueError: naming ``field`` when ``text`` is not two integers ``a <= b``.
    """
    try:
        start, end = (int(part) for part in str(text).split(":"))
    except ValueError:
        raise ValueError(f"--{field}={text!r} must be a layer range START:END (half-open), e.g. 2:6") from None
    if not 0 <= start <= end:
        raise ValueError(f"--{field}={text!r} must have 0 <= START <= END")
    return start, end


def default_split(n_layers: int) -> Split:
    """Every layer kept: the first and last quarter (rounded down, at least one when L >= 3) as input and
    output blocks, the middle as the shared block (the span that looped retrofits recur over)."""
    edge = max(1, n_layers // 4) if n_layers >= 3 else 0
    return Split((0, edge), (edge, n_layers - edge), (n_layers - edge, n_layers), n_layers - 2 * edge)


def make_split(
    n_layers: int,
    input: Optional[str] = None,
    shared: Optional[str] = None,
    output: Optional[str] = None,
    n_rec: Optional[int] = None,
    init: str = "span",
) -> Split:
    """The split the command line asks for; ranges left out follow :func:`default_split`.

    Raises:
        ValueError: naming the flag when the ranges overlap, run past the model's layers, are out of
            order, leave the shared block empty, or (``average``) do not divide into ``n_rec`` groups.
    """
    if init not in ("span", "average"):
        raise ValueError(f"--shared_init={init!r} must be span or average")
    base = default_split(n_layers)
    ranges = {
        "input": parse_range(input, "input") if input is not None else base.input,
        "shared": parse_range(shared, "shared") if shared is not None else base.shared,
        "output": parse_range(output, "output") if output is not None else base.output,
    }
    for name, (start, end) in ranges.items():
        if end > n_layers:
            raise ValueError(f"--{name}={start}:{end} runs past the model's {n_layers} layers (num_hidden_layers)")
    (a0, a1), (s0, s1), (o0, o1) = ranges["input"], ranges["shared"], ranges["output"]
    if not (a1 <= s0 and s1 <= o0):
        raise ValueError(
            f"the split does not add up: --input={a0}:{a1} --shared={s0}:{s1} --output={o0}:{o1} must be in order "
            "without overlap (input before shared before output)"
        )
    length = s1 - s0
    if length == 0:
        raise ValueError(f"--shared={s0}:{s1} is empty; the shared block needs at least one layer")
    if n_rec is None:
        n_rec = length
    if init == "span" and n_rec != length:
        raise ValueError(f"--n_rec={n_rec} differs from the {length} layers of --shared={s0}:{s1}; with span they agree")
    if n_rec < 1 or length % n_rec:
        raise ValueError(
            f"--n_rec={n_rec} must divide the {length} layers of --shared={s0}:{s1} (average of equal groups)"
        )
    return Split((a0, a1), (s0, s1), (o0, o1), n_rec, init)


def read_hf_config(directory: Path) -> Any:
    """The model's ``transformers`` config, checked to be a supported architecture.

    A folder whose ``config.json`` asks for code of its own (``auto_map``) is refused: retrofit
    never runs or asks to run a model's remote code, and reads only the architectures it knows.

    Raises:
        FileNotFoundError: No ``config.json``.
        ValueError: An architecture or option ELR does not implement, or custom code, naming the field.
    """
    from transformers import AutoConfig

    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"--hf {str(directory)!r} has no config.json; give a Hugging Face model folder")
    raw = read_json_object(directory / "config.json", "give a Hugging Face model folder")
    if "auto_map" in raw:
        raise ValueError(
            f"--hf {str(directory)!r}: config.json has auto_map, which asks to run the model's own Python code; "
            f"elr retrofit never runs remote code and reads {sorted(ARCHITECTURES)}: remove auto_map if the model is one"
        )
    archs = raw.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise ValueError(
            f"config.json: architectures={archs} is not supported; elr retrofit reads {sorted(ARCHITECTURES)}"
        )
    config = AutoConfig.from_pretrained(str(directory), trust_remote_code=False)
    family = ARCHITECTURES[archs[0]]
    refusals = {
        "hidden_act": (getattr(config, "hidden_act", "silu") != "silu", "ELR's MLP is SwiGLU (silu)"),
        "mlp_bias": (bool(getattr(config, "mlp_bias", False)), "ELR's MLP has no biases"),
        "attention_bias": (
            family != "qwen2" and bool(getattr(config, "attention_bias", False)),
            "ELR's attention has no output-projection bias",
        ),
        "use_sliding_window": (
            bool(getattr(config, "use_sliding_window", False)),
            "ELR's attention is full causal attention",
        ),
    }
    for name, (refused, why) in refusals.items():
        if refused:
            raise ValueError(f"config.json: {name}={getattr(config, name)!r} is not supported: {why}")
    return config


def rope_settings(config: Any) -> tuple[float, Optional[dict[str, Any]]]:
    """``(rope_base, rope_scaling)`` of the config, in either ``rope_parameters`` or ``rope_theta``/``rope_scaling`` form.

    Raises:
        ValueError: A RoPE type other than the default and Llama 3's.
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None)
    if legacy and not params.get("rope_type"):
        params.update(legacy)
    base = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return base, None
    if kind != "llama3":
        raise ValueError(f"config.json: rope_scaling type {kind!r} is not supported; ELR implements default and llama3")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return base, {"rope_type": "llama3", **{key: params[key] for key in keys}}


def arch_from_hf(config: Any, split: Split, max_loops: int, max_seq_len: Optional[int] = None) -> ModelConfig:
    """The ``ModelConfig`` of the retrofitted model (GQA, RoPE, qk-norm, biases, tied head, eps from ``config``)."""
    family = ARCHITECTURES[config.architectures[0]]
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope_base, rope_scaling = rope_settings(config)
    context = int(config.max_position_embeddings)
    if getattr(config, "sliding_window", None):  # Mistral: full attention is exact up to the window
        context = min(context, int(config.sliding_window))
    return ModelConfig(
        vocab_size=config.vocab_size,
        d_model=config.hidden_size,
        n_heads=heads,
        n_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        n_in=split.input[1] - split.input[0],
        n_rec=split.n_rec,
        n_out=split.output[1] - split.output[0],
        d_ff=config.intermediate_size,
        max_seq_len=min(context, max_seq_len) if max_seq_len else context,
        rope_base=rope_base,
        max_loops=max_loops,
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        norm_eps=float(config.rms_norm_eps),
        init_std=float(getattr(config, "initializer_range", 0.02)),
        head_size=None if head_dim * heads == config.hidden_size else head_dim,
        rope_scaling=rope_scaling,
        qk_norm=family == "qwen3",
        qkv_bias=family == "qwen2",
    )


#: ``--dtype`` values and what they load the source weights as (``None``: the file's own dtype).
DTYPES: dict[str, Optional[torch.dtype]] = {
    "source": None,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def _layer_sources(i: int, arch: ModelConfig) -> dict[str, tuple[str, ...]]:
    """The source tensors of layer ``i`` behind each ELR name inside a :class:`~elr_lightning.layers.Block`
    (two sources are concatenated along the rows, in order)."""
    names = {
        "attn_norm.weight": ("input_layernorm.weight",),
        "attn.q.weight": ("self_attn.q_proj.weight",),
        "attn.kv.weight": ("self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "attn.o.weight": ("self_attn.o_proj.weight",),
        "mlp_norm.weight": ("post_attention_layernorm.weight",),
        # SwiGLU computes gate, up = up(x).chunk(2): the gate's rows first
        "mlp.up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
        "mlp.down.weight": ("mlp.down_proj.weight",),
    }
    if arch.qkv_bias:
        names["attn.q.bias"] = ("self_attn.q_proj.bias",)
        names["attn.kv.bias"] = ("self_attn.k_proj.bias", "self_attn.v_proj.bias")
    if arch.qk_norm:
        names["attn.q_norm.weight"] = ("self_attn.q_norm.weight",)
        names["attn.k_norm.weight"] = ("self_attn.k_norm.weight",)
    return {ours: tuple(f"model.layers.{i}.{theirs}" for theirs in sources) for ours, sources in names.items()}


def _layer_tensor(weights: SafetensorsWeights, i: int, arch: ModelConfig, name: str) -> Tensor:
    """ELR tensor ``name`` of source layer ``i``."""
    parts = [weights[key] for key in _layer_sources(i, arch)[name]]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def elr_state_dict(weights: SafetensorsWeights, arch: ModelConfig, split: Split) -> dict[str, Tensor]:
    """The retrofitted model's weights under :class:`~elr_lightning.model.LoopedLM` names (gate and heads absent).

    Built one tensor at a time, so memory holds the result and one tensor's sources; an averaged
    shared layer (``average``) is summed in fp32 and stored in the weights' dtype.

    Raises:
        ValueError: A tensor the mapping needs is missing, naming it.
    """
    state: dict[str, Tensor] = {}
    for block, prefix, n in (("in", "input_layers", arch.n_in), ("rec", "core.layers", arch.n_rec), ("out", "output_layers", arch.n_out)):
        for j in range(n):
            layers = split.source_layers(block, j)
            for name in _layer_sources(layers[0], arch):
                tensor = _layer_tensor(weights, layers[0], arch, name)
                if len(layers) > 1:
                    total = tensor.float()
                    for i in layers[1:]:
                        total += _layer_tensor(weights, i, arch, name).float()
                    tensor = (total / len(layers)).to(tensor.dtype)
                state[f"{prefix}.{j}.{name}"] = tensor
    state["embed.weight"] = weights["model.embed_tokens.weight"]
    state["norm.weight"] = weights["model.norm.weight"]
    if arch.tie_embeddings:
        state["head.weight"] = state["embed.weight"]
    elif "lm_head.weight" in weights:
        state["head.weight"] = weights["lm_head.weight"]
    else:
        raise ValueError(
            "weights: lm_head.weight is missing and config.json has tie_word_embeddings=false; give the complete checkpoint"
        )
    return state


def read_tokenizer(path: Path, vocab_size: int) -> HFTokenizer:
    """The model's ``tokenizer.json``, checked against the embedding table's ``vocab_size``.

    Raises:
        FileNotFoundError: No file at ``path``.
        ValueError: The tokenizer has ids beyond the table, or the table has over :data:`VOCAB_PADDING`
            rows no token reaches (another model's tokenizer).
    """
    if not path.is_file():
        raise FileNotFoundError(f"--tokenizer {str(path)!r} does not exist; give the model's tokenizer.json")
    tokenizer = HFTokenizer(str(path))
    n = tokenizer.vocab_size
    if n > vocab_size or vocab_size - n > VOCAB_PADDING:
        raise ValueError(
            f"tokenizer.json: vocabulary of {n} ids does not match config.json vocab_size={vocab_size}; "
            "give the model's own tokenizer (--tokenizer)"
        )
    return tokenizer


def retrofit_update_args() -> dict[str, Any]:
    """``AdaptiveDelta`` arguments under which loop 1 is the source stack exactly (see the module docstring)."""
    return {"initial_step": RETROFIT_STEP, "injection": "mean"}


def build_module(
    directory: Path,
    split: Split,
    max_loops: int,
    max_seq_len: Optional[int],
    tokenizer: Optional[Path],
    conditioner: dict[str, int],
    dtype: Optional[torch.dtype] = None,
) -> Any:
    """The retrofitted :class:`~elr_lightning.module.ELRModule`, with its tokenizer.

    The model is built on the meta device and takes the source tensors as they are read (in
    ``dtype``, default the files' own), so memory holds one copy of the weights. The parameters the
    source does not have, the adaptive-delta gate and the conditioning heads, get their init in fp32
    (``LoopedLM.init_weights``): gate and heads at zero, beta at :data:`RETROFIT_STEP`.
    """
    from elr_lightning.conditioning import LoopConditioner
    from elr_lightning.module import ELRModule
    from elr_lightning.updates import AdaptiveDelta

    config = read_hf_config(directory)
    arch = arch_from_hf(config, split, max_loops, max_seq_len)
    tok = read_tokenizer(tokenizer if tokenizer is not None else directory / "tokenizer.json", arch.vocab_size)
    state = elr_state_dict(SafetensorsWeights(directory, dtype), arch, split)
    module = ELRModule(
        arch=arch, update=AdaptiveDelta(**retrofit_update_args()), conditioner=LoopConditioner(**conditioner),
        meta_init=True,
    )
    module.hparams["meta_init"] = False  # the checkpoint holds every weight: it loads as a plain module
    own = module.model.state_dict()
    mismatched = [f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in state.items() if v.shape != own[k].shape]
    if mismatched:
        raise ValueError(f"weights: shapes differ from config.json (file vs model): {mismatched[:3]}")
    module.model.assign_weights(state)
    module.tokenizer = tok
    return module


@torch.no_grad()
def source_logit_gap(directory: Path, module: Any, tokens: int = 32) -> float:
    """Max |logit difference| at k = 1 between the source model (``transformers``, fp32) and ``module``.

    The input is ``tokens`` ids spread over the vocabulary, one sequence. Both models run in fp32
    (``module`` is converted in place): two fp32 copies of the model, the most memory retrofit takes.
    """
    from transformers import AutoModelForCausalLM

    # safetensors only: a pytorch_model.bin beside them is a pickle, never read
    source = AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=torch.float32, use_safetensors=True, trust_remote_code=False
    ).eval()
    n = min(tokens, module.arch.max_seq_len)
    ids = (torch.arange(n) * 7919 % module.arch.vocab_size)[None]
    ours = module.model.float().eval()(ids, loops=1)
    return float((source(ids).logits.float() - ours.float()).abs().max())


def fit_config(
    arch: ModelConfig, ckpt: Path, tokenizer: Path, steps: int, switch_fraction: float, lr: float, seq_len: int,
    conditioner: dict[str, int],
) -> dict[str, Any]:
    """The ``elr fit`` config that continues the retrofitted checkpoint.

    k = 1 for ``switch_fraction`` of the steps (the LR warms up on the unchanged model while it adapts to
    the new data), then one-loop overrides (eq. 3, f = 0.15) with the conditioning heads brought in
    at zero. Continued-training schedule: warm-up over 5% of the steps to ``lr``, cosine to 0.1 lr;
    the new parameters (gate, conditioning) at 10x ``lr``, as they start from zero in a short run.
    """
    import dataclasses

    return {
        "seed_everything": 0,
        "trainer": {
            "max_steps": steps,
            "precision": "bf16-mixed",
            "val_check_interval": max(1, steps // 10),
            "check_val_every_n_epoch": None,
            "log_every_n_steps": 10,
            "default_root_dir": "runs/retrofit",
            "callbacks": [
                {
                    "class_path": "elr_lightning.callbacks.AtomicModelCheckpoint",
                    "init_args": {"save_last": True, "every_n_train_steps": max(1, steps // 10)},
                },
                {
                    "class_path": "elr_lightning.callbacks.DelayedMixedDepth",
                    "init_args": {"init_from": str(ckpt), "switch_fraction": switch_fraction},
                },
                {"class_path": "elr_lightning.callbacks.ZeroInitConditioning"},
                {"class_path": "lightning.pytorch.callbacks.LearningRateMonitor", "init_args": {"logging_interval": "step"}},
            ],
        },
        "model": {
            "class_path": "elr_lightning.ELRModule",
            "init_args": {
                "arch": dataclasses.asdict(arch),
                "update": {"class_path": "elr_lightning.updates.AdaptiveDelta", "init_args": retrofit_update_args()},
                "sampler": {
                    "class_path": "elr_lightning.sampling.OneLoopOverride",
                    "init_args": {"max_loops": arch.max_loops, "override_fraction": 0.15},
                },
                "conditioner": {"class_path": "elr_lightning.conditioning.LoopConditioner", "init_args": conditioner},
                "virtual_ranks": 4,
                "lr": lr,
                "lr_scale": {"gate": 10.0, "conditioning": 10.0},
                "warmup_steps": max(1, math.ceil(0.05 * steps)),
                "min_lr_ratio": 0.1,
                "weight_decay": 0.1,
            },
        },
        "data": {
            "class_path": "elr_lightning.data.TextDataModule",
            "init_args": {"sources": None, "tokenizer": str(tokenizer), "seq_len": seq_len, "batch_size": 16},
        },
    }


def retrofit_parser() -> CommandParser:
    """The parser of ``elr retrofit``."""
    parser = command_parser(
        "retrofit",
        "Turn a local Hugging Face Llama, Mistral, Qwen2 or Qwen3 model into an ELR checkpoint and an `elr fit` YAML.",
    )
    parser.add_argument("--hf", type=str, required=True, help="Model folder: config.json, *.safetensors, tokenizer.json.")
    parser.add_argument("--out", type=str, required=True, help="Folder to write retrofit.ckpt, retrofit.yaml and tokenizer.json.")
    add_switch(
        parser, "--overwrite", False,
        "Replace those files in --out (each by a new file: a symbolic link is replaced, never followed).",
    )  # fmt: skip
    parser.add_argument("--input", type=Optional[str], default=None, help="Input-block layers START:END (default: first quarter).")
    parser.add_argument("--shared", type=Optional[str], default=None, help="Layers the shared block starts from (default: the middle).")
    parser.add_argument("--output", type=Optional[str], default=None, help="Output-block layers (default: last quarter).")
    parser.add_argument("--shared_init", type=str, default="span", help="span: the range is the block; average: mean of its n_rec groups.")
    parser.add_argument("--n_rec", type=Optional[int], default=None, help="Shared-block layers (average only; span uses the range).")
    parser.add_argument("--max_loops", type=int, default=4, help="Loop budget K.")
    parser.add_argument("--max_seq_len", type=Optional[int], default=None, help="Cap on the RoPE table (default: the model's context).")
    parser.add_argument("--tokenizer", type=Optional[str], default=None, help="tokenizer.json (default: the one in --hf).")
    parser.add_argument("--steps", type=int, default=2000, help="trainer.max_steps of the YAML.")
    parser.add_argument("--switch_fraction", type=float, default=0.25, help="Share of the steps at k = 1 before depths mix.")
    parser.add_argument("--lr", type=float, default=3e-4, help="Peak LR of the continued training.")
    parser.add_argument("--seq_len", type=int, default=1024, help="data.seq_len of the YAML (capped at the context).")
    parser.add_argument(
        "--dtype",
        type=Literal["source", "float32", "bfloat16", "float16"],
        default="source",
        help="dtype of the checkpoint's weights; source keeps the safetensors files' dtype.",
    )
    add_switch(
        parser, "--verify", True,
        "Load the source with transformers and report the k = 1 logit gap (two fp32 copies of the model in memory).",
        was_bool=True,
    )  # fmt: skip
    return parser


def retrofit_command(argv: list[str]) -> None:
    """``elr retrofit --hf DIR --out DIR [--input A:B --shared A:B --output A:B ...]``."""
    import yaml

    from elr_lightning.hf.export import _hf, save_module_checkpoint

    args = retrofit_parser().parse_args(argv)
    _hf()
    directory, out = Path(args.hf), Path(args.out)
    config = read_hf_config(directory)
    split = make_split(config.num_hidden_layers, args.input, args.shared, args.output, args.n_rec, args.shared_init)
    conditioner = {"d_cond": 64, "rank": 8}
    tokenizer = Path(args.tokenizer) if args.tokenizer is not None else directory / "tokenizer.json"
    ckpt, tok_out, yaml_out = out / "retrofit.ckpt", out / "tokenizer.json", out / "retrofit.yaml"
    refuse_to_replace("--out", out, (ckpt.name, tok_out.name, yaml_out.name), args.overwrite)
    module = build_module(directory, split, args.max_loops, args.max_seq_len, tokenizer, conditioner, DTYPES[args.dtype])
    save_module_checkpoint(module, ckpt, overwrite=args.overwrite)
    write_file(tok_out, module.tokenizer.to_json(), overwrite=args.overwrite)
    seq_len = min(args.seq_len, module.arch.max_seq_len)
    fit = fit_config(module.arch, ckpt.resolve(), tok_out.resolve(), args.steps, args.switch_fraction, args.lr, seq_len, conditioner)
    header = (
        f"# elr retrofit of {directory.name}: input {split.input}, shared {split.shared} ({split.init}, n_rec {split.n_rec}), "
        f"output {split.output}\n# Set data.init_args.sources to your corpus, then: elr fit --config {out / 'retrofit.yaml'}\n"
    )
    write_file(yaml_out, header + yaml.safe_dump(fit, sort_keys=False), overwrite=args.overwrite)
    a = module.arch
    print(f"wrote {ckpt} and {out / 'retrofit.yaml'}: D_eff(k) = {a.n_in} + {a.n_rec} k + {a.n_out}")
    if args.verify:
        gap = source_logit_gap(directory, module)
        kept = "every layer kept" if split.keeps_every_layer(config.num_hidden_layers) else "layers dropped or averaged"
        print(f"k = 1 against the source model ({kept}): max |logit difference| = {gap:.2e}")
