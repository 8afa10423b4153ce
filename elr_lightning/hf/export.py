"""``elr export`` and ``elr import``: a checkpoint to a Hugging Face model directory and back.

An export holds ``model.safetensors`` (the LM head left out when tied to the embedding, as Hugging
Face expects), ``config.json`` (``model_type: elr``, ``auto_map``, every architecture field, and the
``ModelConfig`` verbatim under ``elr_arch``), ``generation_config.json`` (the tokenizer's EOS), the
tokenizer files, and the self-contained
``configuration_elr.py`` / ``modeling_elr.py``, so ``AutoModelForCausalLM.from_pretrained(DIR,
trust_remote_code=True)`` loads it with only ``transformers`` installed. An import rebuilds the
:class:`~elr_lightning.module.ELRModule` and writes a Lightning checkpoint whose weights equal the
exported ones bit for bit. Neither replaces what a user owns: an export goes into a new or empty
folder (``--overwrite`` replaces the export files of an earlier one and keeps every other file),
an import never replaces an existing checkpoint (unless ``--overwrite``).

Supported: dense, hybrid (Gated DeltaProduct token mixers) and mixture-of-experts models (route
replay as trained) with any of the library's state-update rules and the eq. 4 loop conditioning.
Other plug-ins (mixers, updates, conditioners of one's own) are refused with a message naming what
the export does not know.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

from elr_lightning.arguments import CommandParser, add_switch, command_parser
from elr_lightning.files import new_file_mode, write_atomically
from elr_lightning.checkpoints.schema import checked_arch, plugin_from_config
from elr_lightning.conditioning import Conditioner, LoopConditioner
from elr_lightning.errors import install_extra
from elr_lightning.config import ModelConfig
from elr_lightning.hf.config_json import read_json_object
from elr_lightning.layers import Block
from elr_lightning.mixers import Attention, GatedDeltaProduct, MoE, SwiGLU
from elr_lightning.model import LoopedLM
from elr_lightning.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer
from elr_lightning.checkpoints.trust import add_trust_argument, apply_trust_argument
from elr_lightning.updates import AdaptiveDelta, FixedDelta, NonRecurrent, Replace, Residual, StateUpdate

#: ``ModelConfig`` fields the modeling file implements; a field outside it must keep its default.
DENSE_FIELDS = (
    "vocab_size", "d_model", "n_heads", "n_kv_heads", "n_in", "n_rec", "n_out", "d_ff", "ff_multiple_of",
    "max_seq_len", "rope_base", "max_loops", "tie_embeddings", "norm_eps", "init_std",
    "head_size", "rope_scaling", "qk_norm", "qkv_bias",
)

#: ``ModelConfig`` fields that choose the mixers; the export reads the built mixers instead (:func:`layer_mixers`).
MIXER_FIELDS = ("token_pattern", "channel_pattern", "mixers", "route_replay")

#: State-update rules by their name in ``config.json``; matched on the exact class.
UPDATE_RULES: dict[str, type[StateUpdate]] = {
    "adaptive_delta": AdaptiveDelta,
    "fixed_delta": FixedDelta,
    "residual": Residual,
    "replace": Replace,
    "non_recurrent": NonRecurrent,
}

#: The remote code: file name in the export -> its source in the package. ``delta_rule.py`` is the
#: Gated DeltaProduct recurrence the library trains with, shipped as it is (it imports only torch).
REMOTE_CODE = {
    "configuration_elr.py": ("hf", "configuration_elr.py"),
    "modeling_elr.py": ("hf", "modeling_elr.py"),
    "hybrid_elr.py": ("hf", "hybrid_elr.py"),
    "delta_rule.py": ("mixers", "delta_rule.py"),
}
_ACTIVE_FLAG = "core.conditioner.active_flag"
#: The byte tokenizer's pad token in an export: the NUL byte.
BYTE_PAD_ID = 0


def _hf():
    try:
        import safetensors.torch
        import transformers
    except ImportError as err:
        raise ImportError(
            f"Hugging Face export and import need transformers and safetensors; install them with {install_extra('hf')}"
        ) from err
    return transformers, safetensors.torch


def _check_dense(config: ModelConfig) -> None:
    defaults = {f.name: f for f in dataclasses.fields(config)}
    for name, value in dataclasses.asdict(config).items():
        if name in DENSE_FIELDS or name in MIXER_FIELDS:
            continue
        f = defaults[name]
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        if value != default:
            raise ValueError(
                f"arch.{name}={value!r}: the Hugging Face modeling file does not implement this field; export a "
                "model that leaves it at its default"
            )


def _mixer_fields(mixer: Any) -> dict[str, Any]:
    """The ``config.json`` entry of one built mixer (matched on its exact class)."""
    if type(mixer) is Attention:
        return {"type": "attention"}
    if type(mixer) is SwiGLU:
        return {"type": "swiglu"}
    if type(mixer) is GatedDeltaProduct:
        return {
            "type": "gdp", "num_householder": mixer.n, "num_heads": mixer.heads, "head_dim": mixer.dk,
            "value_dim": mixer.dv, "conv_size": mixer.conv_size, "allow_neg_eigval": mixer.allow_neg_eigval,
            "chunk_size": mixer.chunk_size,
        }
    if type(mixer) is MoE:
        return {
            "type": "moe", "num_experts": mixer.num_experts, "top_k": mixer.top_k, "expert_dim": mixer.expert_dim,
            "shared_expert_dim": 0 if mixer.shared_down is None else mixer.shared_down.in_features,
            "replay": mixer.replay, "normalize_weights": mixer.normalize_weights,
        }
    raise ValueError(
        f"arch.token_pattern/channel_pattern: the mixer {type(mixer).__name__} has no Hugging Face counterpart; "
        f"the export supports {', '.join(cls.__name__ for cls in (Attention, GatedDeltaProduct, SwiGLU, MoE))}"
    )


def layer_mixers(model: LoopedLM) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(token_mixers, channel_mixers)`` of ``config.json``: each layer's mixers in stack order.

    Raises:
        ValueError: A mixer the modeling file does not implement.
    """
    layers: list[Block] = [*model.input_layers, *model.core.layers, *model.output_layers]
    return [_mixer_fields(layer.attn) for layer in layers], [_mixer_fields(layer.mlp) for layer in layers]


def hf_config_fields(model: LoopedLM) -> dict[str, Any]:
    """The ``config.json`` fields of ``model``'s export (``ELRConfig`` arguments and ``elr_arch``).

    Raises:
        ValueError: An architecture field, mixer, state-update rule or conditioner the modeling
            file does not implement.
    """
    config = model.config
    _check_dense(config)
    token_mixers, channel_mixers = layer_mixers(model)
    rule = next((name for name, cls in UPDATE_RULES.items() if type(model.update) is cls), None)
    if rule is None:
        raise ValueError(
            f"model.update: {type(model.update).__name__} has no Hugging Face counterpart; the export supports "
            f"{', '.join(cls.__name__ for cls in UPDATE_RULES.values())}"
        )
    conditioner = model.conditioner
    if conditioner is not None and type(conditioner) is not LoopConditioner:
        raise ValueError(
            f"model.conditioner: {type(conditioner).__name__} has no Hugging Face counterpart; the export "
            "supports LoopConditioner (eq. 4) or none"
        )
    return {
        "vocab_size": config.vocab_size,
        "d_model": config.d_model,
        "n_heads": config.n_heads,
        "n_kv_heads": config.kv_heads,
        "n_in": config.n_in,
        "n_rec": config.n_rec,
        "n_out": config.n_out,
        "d_ff": config.ff_dim,
        "max_seq_len": config.max_seq_len,
        "rope_base": config.rope_base,
        "max_loops": config.max_loops,
        "norm_eps": config.norm_eps,
        "init_std": config.init_std,
        "state_update": rule,
        "fixed_delta_beta": float(model.update.beta) if rule == "fixed_delta" else 0.5,
        "conditioning": None
        if conditioner is None
        else {"d_cond": conditioner.d_cond, "rank": conditioner.rank, "n_freqs": conditioner.n_freqs,
              "beyond_budget": conditioner.beyond_budget},
        "conditioning_active": bool(conditioner.active) if conditioner is not None else False,
        "tie_word_embeddings": config.tie_embeddings,
        "head_dim": config.head_dim,
        "rope_freq_scaling": config.rope_scaling,
        "qk_norm": config.qk_norm,
        "qkv_bias": config.qkv_bias,
        "injection": getattr(model.update, "injection", "sum"),
        "token_mixers": token_mixers,
        "channel_mixers": channel_mixers,
        "elr_arch": dataclasses.asdict(config),
    }


def hf_state_dict(model: LoopedLM) -> dict[str, Tensor]:
    """``model``'s weights under their Hugging Face names: ``model.`` + our name; ``lm_head`` untied only."""
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name == _ACTIVE_FLAG:
            continue  # a config field (conditioning_active) in the export
        if name == "head.weight":
            if not model.config.tie_embeddings:
                tensors["lm_head.weight"] = tensor
            continue
        tensors[f"model.{name}"] = tensor
    return {k: v.detach().contiguous().clone() for k, v in tensors.items()}


def byte_tokenizer_json() -> str:
    """A HF ``tokenizers`` byte tokenizer: id b is byte b (BPE without merges over the byte-level alphabet)."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers

    from elr_lightning.tokenizers import _byte_level_alphabet

    vocab = {char: byte for char, byte in _byte_level_alphabet().items()}
    tok = HFTok(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def _write_tokenizer(tokenizer: Tokenizer, out: Path, max_seq_len: int) -> None:
    """Write the tokenizer files; ``model_max_length`` is the model's context, so ``truncation=True`` fits it."""
    transformers, _ = _hf()
    from tokenizers import Tokenizer as HFTok

    if isinstance(tokenizer, ByteTokenizer):
        raw = byte_tokenizer_json()
    elif isinstance(tokenizer, HFTokenizer):
        raw = tokenizer.to_json()
    else:
        raise ValueError(f"tokenizer: a {type(tokenizer).__name__} cannot be exported; use a HF tokenizer.json")
    eos = tokenizer.eos_id
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=HFTok.from_str(raw), model_max_length=max_seq_len)
    if eos is not None:
        fast.eos_token = fast.convert_ids_to_tokens(eos)
    if isinstance(tokenizer, ByteTokenizer):  # batched generate pads; the NUL byte, as elr generate's pad_id
        fast.pad_token = fast.convert_ids_to_tokens(BYTE_PAD_ID)
    fast.save_pretrained(str(out))
    (out / "tokenizer.json").write_text(raw, encoding="utf-8")  # the training tokenizer's exact file


def export_hf(model: LoopedLM, tokenizer: Tokenizer, out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Write ``model`` and ``tokenizer`` as a Hugging Face model directory ``out``.

    The export is written whole into a temporary folder beside ``out`` and then put in place
    (:func:`place_export`), so a failed export leaves ``out`` as it was.

    Args:
        model: The model.
        tokenizer: Its tokenizer.
        out: The folder: new or empty, or, with ``overwrite``, one to replace the export files of.
        overwrite: Replace the :data:`EXPORT_FILES` of a folder that is not empty; other files
            (a model card of your own, ...) are kept.

    Returns:
        The directory.

    Raises:
        FileExistsError: ``out`` is not empty and ``overwrite`` is false, or is a file.
        ValueError: An architecture or plug-in the export does not support, or parameters the
            modeling file does not know.
        ImportError: ``transformers`` or ``safetensors`` is not installed.
    """
    _hf()
    from elr_lightning.hf.configuration_elr import ELRConfig
    from elr_lightning.hf.modeling_elr import ELRForCausalLM

    fields = hf_config_fields(model)
    fields["elr_tokenizer"] = "byte" if isinstance(tokenizer, ByteTokenizer) else "hf"
    config = ELRConfig(**fields)
    tensors = hf_state_dict(model)
    with torch.device("meta"):
        expected = ELRForCausalLM(config).state_dict()
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    unknown = sorted(set(tensors) - set(expected))
    if unknown:
        raise ValueError(
            f"the model has {len(unknown)} parameter(s) the Hugging Face modeling file does not know ({unknown[:4]}); "
            "layers of one's own cannot be exported"
        )
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(f"the export lacks parameter(s) {missing[:4]} that the modeling file needs")
    out = Path(out)
    check_export_folder(out, overwrite)
    staging = out.parent / f".{out.name}.{uuid.uuid4().hex}.tmp"
    staging.mkdir(parents=True)
    try:
        _write_export(model, tokenizer, config, tensors, staging)
        place_export(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _write_export(model: LoopedLM, tokenizer: Tokenizer, config: Any, tensors: dict[str, Tensor], out: Path) -> None:
    transformers, st = _hf()
    config.auto_map = {
        "AutoConfig": "configuration_elr.ELRConfig",
        "AutoModelForCausalLM": "modeling_elr.ELRForCausalLM",
    }
    config.architectures = ["ELRForCausalLM"]
    config.dtype = str(model.embed.weight.dtype).removeprefix("torch.")
    config.eos_token_id = tokenizer.eos_id  # generate() stops at EOS, as `elr generate` does
    config.pad_token_id = BYTE_PAD_ID if isinstance(tokenizer, ByteTokenizer) else None
    config.save_pretrained(str(out))
    transformers.GenerationConfig(eos_token_id=tokenizer.eos_id, pad_token_id=config.pad_token_id).save_pretrained(
        str(out)
    )
    st.save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", new_file_mode())  # safetensors creates it 0600, whatever the umask
    package = Path(__file__).parent.parent
    for name, source in REMOTE_CODE.items():
        shutil.copyfile(package.joinpath(*source), out / name)
    _write_tokenizer(tokenizer, out, model.config.max_seq_len)


#: The files an export may hold (this version's and earlier ones'): ``--overwrite`` replaces or removes
#: these and keeps every other file of the folder.
EXPORT_FILES = frozenset({
    "config.json", "generation_config.json", "model.safetensors", *REMOTE_CODE,
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
})  # fmt: skip


def check_export_folder(out: Path, overwrite: bool) -> None:
    """Refuse an export into a file, or into a folder that is not empty unless ``overwrite``.

    Raises:
        FileExistsError: Naming the folder and the fix.
    """
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {str(out)!r} is a file; give a folder")
    held = sorted(os.listdir(out)) if out.is_dir() else []
    if held and not overwrite:
        raise FileExistsError(
            f"--out {str(out)!r} is not empty ({', '.join(held[:4])}{', ...' if len(held) > 4 else ''}); give a new "
            "or empty folder, or add --overwrite to replace the export files there (other files are kept)"
        )


def place_export(new: Path, out: Path) -> None:
    """Move the complete export in ``new`` to ``out``: a new folder by one rename, else file by file.

    Into an existing folder, each file of the export replaces its namesake (``os.replace``, atomic
    per file), then the :data:`EXPORT_FILES` the new export lacks are removed, so no file of an
    earlier export stays beside the new one; files of other names are left alone.
    """
    if not out.exists():
        new.rename(out)
        return
    written = set(os.listdir(new))
    for name in sorted(written):
        os.replace(new / name, out / name)
    for name in sorted(EXPORT_FILES - written):
        if (out / name).is_file():
            (out / name).unlink()


def _update_from_config(fields: dict[str, Any], source: str) -> StateUpdate:
    """The state update ``config.json``'s ``state_update``, ``fixed_delta_beta`` and ``injection`` describe.

    Raises:
        ValueError: A key missing or of the wrong type or value, naming it, the file and the fix.
    """
    def bad(key: str, want: str) -> ValueError:
        got = f"is {fields[key]!r}" if key in fields else "is missing"
        return ValueError(f"{source}: {key} {got}; it must be {want} (as `elr export` writes it)")

    rule = fields.get("state_update")
    if not isinstance(rule, str) or rule not in UPDATE_RULES:
        raise bad("state_update", f"one of {sorted(UPDATE_RULES)}")
    if rule == "fixed_delta":
        beta = fields.get("fixed_delta_beta")
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 < beta <= 1.0:
            raise bad("fixed_delta_beta", "a number in (0, 1]")
        return FixedDelta(float(beta))
    if rule == "adaptive_delta":
        injection = fields.get("injection", "sum")
        if injection not in ("sum", "mean"):
            raise bad("injection", "'sum' or 'mean'")
        return AdaptiveDelta(injection=injection)
    return UPDATE_RULES[rule]()


def import_hf(directory: str | os.PathLike) -> Any:
    """Rebuild an :class:`~elr_lightning.module.ELRModule` from an export (weights bit for bit).

    The folder is data: ``config.json``'s ``elr_arch`` and ``conditioning`` are checked against
    their schema before anything is built (:func:`~elr_lightning.checkpoints.schema.checked_arch`:
    plain data, layers only from trusted modules), and the weights are safetensors.

    Raises:
        FileNotFoundError: No ``config.json`` or ``model.safetensors`` in ``directory``.
        UntrustedModuleError: ``elr_arch`` names a module that is not trusted.
        CheckpointConfigError: ``elr_arch`` or ``conditioning`` breaks its schema, naming the field.
        ValueError: The directory is not an ELR export.
    """
    _, st = _hf()
    from elr_lightning.module import ELRModule

    directory = Path(directory)
    for name in ("config.json", "model.safetensors"):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"--hf {str(directory)!r} has no {name}; give the directory `elr export` wrote")
    source = str(directory / "config.json")
    fields = read_json_object(directory / "config.json", "use the one `elr export` wrote")
    if fields.get("model_type") != "elr":
        raise ValueError(f"--hf {str(directory)!r}: model_type is {fields.get('model_type')!r}, not 'elr'")
    arch = ModelConfig(**checked_arch(fields.get("elr_arch"), "elr_arch", source))  # checked before a layer imports
    update = _update_from_config(fields, source)
    cond = fields.get("conditioning")
    conditioner = plugin_from_config(
        {"class_path": f"{LoopConditioner.__module__}.LoopConditioner", "init_args": cond}, Conditioner, "conditioning", source
    ) if cond else None
    module = ELRModule(arch=arch, update=update, conditioner=conditioner)
    weights = directory / "model.safetensors"
    try:
        loaded = st.load_file(str(weights))
    except Exception as err:  # safetensors raises its own SafetensorError for a damaged header
        raise ValueError(f"--hf {str(weights)!r} is not a readable safetensors file ({err}); export it again") from None
    state = {}
    for name, tensor in loaded.items():
        state[name.removeprefix("model.") if name.startswith("model.") else name.replace("lm_head.", "head.")] = tensor
    if arch.tie_embeddings and "embed.weight" in state:
        state["head.weight"] = state["embed.weight"]
    if conditioner is not None:
        active = fields.get("conditioning_active", True)
        if not isinstance(active, bool):
            raise ValueError(f"{source}: conditioning_active is {active!r}; it must be true or false (as `elr export` writes it)")
        state[_ACTIVE_FLAG] = torch.tensor(active)
    try:
        module.model.load_state_dict(state, strict=True)
    except RuntimeError as err:  # missing, unexpected or mis-shaped tensors
        problem = " ".join(str(err).split())
        raise ValueError(f"--hf {str(weights)!r} does not fit config.json's elr_arch ({problem[:300]}); export it again") from None
    if fields.get("elr_tokenizer") == "byte":
        module.tokenizer = ByteTokenizer()
    elif (directory / "tokenizer.json").is_file():
        module.tokenizer = HFTokenizer.from_json((directory / "tokenizer.json").read_text(encoding="utf-8"))
    return module


def save_module_checkpoint(module: Any, path: str | os.PathLike, overwrite: bool = True) -> None:
    """Write ``module`` as a Lightning checkpoint that ``ELRModule.load_from_checkpoint`` reads (no optimizer).

    The file is written atomically (:func:`~elr_lightning.files.write_atomically`).

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is false; it is left as it is.
    """
    import lightning

    checkpoint: dict[str, Any] = {
        "epoch": 0,
        "global_step": 0,
        "pytorch-lightning_version": lightning.__version__,
        "state_dict": module.state_dict(),
        "hparams_name": "kwargs",
        "hyper_parameters": dict(module.hparams),
    }
    module.on_save_checkpoint(checkpoint)
    write_atomically(os.fspath(path), lambda f: torch.save(checkpoint, f), overwrite=overwrite)


def export_parser() -> CommandParser:
    """The parser of ``elr export``."""
    parser = command_parser("export", "Write a checkpoint as a Hugging Face model directory.")
    parser.add_argument("--ckpt_path", type=str, required=True, help="Checkpoint written by `elr fit`.")
    parser.add_argument("--out", type=str, required=True, help="Directory to write: new or empty.")
    parser.add_argument(
        "--tokenizer", type=Optional[str], default=None, help="Override the checkpoint's saved tokenizer."
    )
    add_switch(
        parser, "--overwrite", False,
        "Replace the export files of a folder that is not empty (an earlier export); other files are kept.",
    )  # fmt: skip
    add_trust_argument(parser)
    return parser


def export_command(argv: list[str]) -> None:
    """``elr export --ckpt_path X --out DIR [--tokenizer T] [--overwrite]``."""
    from elr_lightning.inference.open import open_checkpoint

    args = export_parser().parse_args(argv)
    _hf()
    check_export_folder(Path(args.out), args.overwrite)
    opened = open_checkpoint(args.ckpt_path, args.trust_module, args.tokenizer)
    out = export_hf(opened.model, opened.tokenizer, args.out, overwrite=args.overwrite)
    print(f"wrote {out}: load it with AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)")


def import_parser() -> CommandParser:
    """The parser of ``elr import``."""
    parser = command_parser("import", "Turn an `elr export` directory back into a checkpoint.")
    parser.add_argument("--hf", type=str, required=True, help="Directory written by `elr export`.")
    parser.add_argument("--out", type=str, required=True, help="Checkpoint file to write (not an existing one).")
    add_switch(parser, "--overwrite", False, "Replace an existing --out file.")
    add_trust_argument(parser)
    return parser


def import_command(argv: list[str]) -> None:
    """``elr import --hf DIR --out X.ckpt [--overwrite]``."""
    args = import_parser().parse_args(argv)
    if os.path.lexists(args.out) and not args.overwrite:
        raise FileExistsError(f"--out {args.out!r} exists; give a new path, or add --overwrite to replace it")
    apply_trust_argument(args.trust_module)
    save_module_checkpoint(import_hf(args.hf), args.out, overwrite=args.overwrite)
    print(f"wrote {args.out}")
