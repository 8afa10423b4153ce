"""``elr retrofit``: tiny random Llama / Qwen2 / Qwen3 / Mistral folders imported, k = 1 exact, refusals, round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("transformers")
import transformers  # noqa: E402

from _bpe import train_bpe  # noqa: E402
from elr_lightning.cli import run  # noqa: E402
from elr_lightning.config import ModelConfig  # noqa: E402
from elr_lightning.inference.generate import load_model  # noqa: E402
from elr_lightning.hf.retrofit import Split, make_split  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 400
#: fp32 tolerance of the issue: k = 1 reproduces the source logits (measured 0.0; a gate/up swap in one
#: layer moves them by 1e-2).
ATOL = 1e-4

COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
)
MODELS = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16},
    )),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e6, tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True, rms_norm_eps=1e-6)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None, tie_word_embeddings=False)),
}


def save_tiny(root: Path, name: str, seed: int = 0) -> Path:
    """A random tiny ``name`` model saved as a hub folder, with a real BPE ``tokenizer.json``."""
    config_cls, model_cls, extra = MODELS[name]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**COMMON, **extra})
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # random norms, biases and qk-norms, so a wrong mapping cannot pass
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith("bias"):
                p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in pname else 0.3 * torch.randn_like(p))
    folder = root / name
    model.save_pretrained(str(folder))
    train_bpe(folder / "tokenizer.json", vocab_size=VOCAB - 8)
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_src")
    return {name: save_tiny(root, name) for name in MODELS}


def logits_pair(folder: Path, ckpt: Path, loops: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    source = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    model, _ = load_model(str(ckpt))
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return source(ids).logits, model(ids, loops=loops)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_layer_kept_reproduces_the_source_at_k1(tiny: dict[str, Path], tmp_path: Path, name: str, capsys) -> None:
    run(["retrofit", "--hf", str(tiny[name]), "--out", str(tmp_path), "--max_loops", "3"])
    assert "max |logit difference|" in capsys.readouterr().out
    theirs, ours = logits_pair(tiny[name], tmp_path / "retrofit.ckpt")
    assert (theirs - ours).abs().max() < ATOL
    model, module = load_model(str(tmp_path / "retrofit.ckpt"))
    arch = model.config
    assert (arch.n_in, arch.n_rec, arch.n_out) == (1, 4, 1)  # default: first and last quarter, middle shared
    assert arch.qkv_bias == (name == "qwen2") and arch.qk_norm == (name == "qwen3")
    assert arch.head_size == (32 if name == "qwen3" else None)
    assert module.tokenizer is not None and module.tokenizer.vocab_size == VOCAB - 8  # the tokenizer travels
    # deeper loops compute something else, and finitely: the loops are live from the start
    ids = torch.arange(20)[None] % VOCAB
    with torch.no_grad():
        k1, k3 = model(ids, loops=1), model(ids, loops=3)
    assert torch.isfinite(k3).all() and not torch.allclose(k1, k3)


def test_the_yaml_continues_the_checkpoint_with_a_delayed_switch(tiny: dict[str, Path], tmp_path: Path) -> None:
    run(["retrofit", "--hf", str(tiny["qwen2"]), "--out", str(tmp_path), "--steps", "400", "--switch_fraction", "0.2",
         "--no_verify"])
    fit = yaml.safe_load((tmp_path / "retrofit.yaml").read_text())
    callbacks = {cb["class_path"].rsplit(".", 1)[1]: cb.get("init_args", {}) for cb in fit["trainer"]["callbacks"]}
    assert callbacks["DelayedMixedDepth"] == {"init_from": str((tmp_path / "retrofit.ckpt").resolve()), "switch_fraction": 0.2}
    assert "ZeroInitConditioning" in callbacks
    init = fit["model"]["init_args"]
    assert init["update"]["init_args"] == {"initial_step": 1.0, "injection": "mean"}
    assert init["warmup_steps"] == 20 and fit["trainer"]["max_steps"] == 400
    assert ModelConfig(**init["arch"]).qkv_bias
    assert fit["data"]["init_args"]["tokenizer"] == str((tmp_path / "tokenizer.json").resolve())
    assert json.loads((tmp_path / "tokenizer.json").read_text())["model"]["type"] == "BPE"


def test_dropped_and_averaged_layers(tiny: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    run(["retrofit", "--hf", str(tiny["llama3"]), "--out", str(tmp_path), "--input", "0:1", "--shared", "1:5",
         "--output", "5:6", "--shared_init", "average", "--n_rec", "2", "--no_verify"])
    model, _ = load_model(str(tmp_path / "retrofit.ckpt"))
    assert (model.config.n_in, model.config.n_rec, model.config.n_out) == (1, 2, 1)
    weights = load_file(str(tiny["llama3"] / "model.safetensors"))
    layer = "model.layers.{}.self_attn.q_proj.weight"
    expected = (weights[layer.format(2)] + weights[layer.format(4)]) / 2  # shared layer 1 = mean of layers 2 and 4
    assert torch.allclose(model.core.layers[1].attn.q.weight, expected)
    split = make_split(8, input="0:2", shared="3:5", output="6:8")  # layers 2 and 5 dropped
    assert split == Split((0, 2), (3, 5), (6, 8), 2) and not split.keeps_every_layer(8)
    assert make_split(8).keeps_every_layer(8)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--input", "0:3", "--shared", "2:5"], r"the split does not add up: --input=0:3 --shared=2:5"),
        (["--output", "5:9"], r"--output=5:9 runs past the model's 6 layers"),
        (["--shared", "2:2"], r"--shared=2:2 is empty"),
        (["--shared", "1:4", "--shared_init", "average", "--n_rec", "2"], r"--n_rec=2 must divide the 3 layers"),
        (["--shared", "1:x"], r"--shared='1:x' must be a layer range"),
    ],
)
def test_a_split_that_does_not_add_up_is_refused(tiny: dict[str, Path], tmp_path: Path, flags: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        run(["retrofit", "--hf", str(tiny["llama3"]), "--out", str(tmp_path), *flags])


def test_unsupported_architecture_missing_weights_and_foreign_tokenizer_are_refused(
    tiny: dict[str, Path], tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    gpt2 = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(str(gpt2))
    with pytest.raises(ValueError, match=r"config.json: architectures=\['GPT2LMHeadModel'\] is not supported"):
        run(["retrofit", "--hf", str(gpt2), "--out", str(tmp_path / "a")])

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in ("config.json", "tokenizer.json"):
        (broken / f).write_bytes((tiny["qwen3"] / f).read_bytes())
    weights = load_file(str(tiny["qwen3"] / "model.safetensors"))
    del weights["model.layers.3.self_attn.k_norm.weight"]
    save_file(weights, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"weights: model.layers.3.self_attn.k_norm.weight is missing"):
        run(["retrofit", "--hf", str(broken), "--out", str(tmp_path / "b")])
    (broken / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"has no \*.safetensors weights"):
        run(["retrofit", "--hf", str(broken), "--out", str(tmp_path / "b")])

    other = train_bpe(tmp_path / "big.json", vocab_size=VOCAB + 50)  # ids beyond the embedding table
    with pytest.raises(ValueError, match=r"tokenizer.json: vocabulary of 450 ids does not match config.json vocab_size=400"):
        run(["retrofit", "--hf", str(tiny["qwen2"]), "--out", str(tmp_path / "c"), "--tokenizer", str(other)])
    assert not (tmp_path / "c").exists()  # nothing written on a refusal


def test_an_existing_checkpoint_is_never_overwritten(tiny: dict[str, Path], tmp_path: Path) -> None:
    run(["retrofit", "--hf", str(tiny["mistral"]), "--out", str(tmp_path), "--no_verify"])
    before = (tmp_path / "retrofit.ckpt").read_bytes()
    with pytest.raises(FileExistsError, match="already holds retrofit.ckpt"):
        run(["retrofit", "--hf", str(tiny["qwen2"]), "--out", str(tmp_path)])
    assert (tmp_path / "retrofit.ckpt").read_bytes() == before


@pytest.mark.parametrize("name", ["qwen3", "llama3"])
def test_export_of_a_retrofit_loads_in_transformers_at_any_loops(tiny: dict[str, Path], tmp_path: Path, name: str) -> None:
    run(["retrofit", "--hf", str(tiny[name]), "--out", str(tmp_path / "r"), "--max_loops", "3", "--no_verify"])
    model, _ = load_model(str(tmp_path / "r" / "retrofit.ckpt"))
    with torch.no_grad():  # a trained-looking gate and active conditioning heads, so every path is exercised
        for p in [*model.update.parameters(), *model.parameters_with_role("conditioning")]:
            p.add_(0.05 * torch.randn_like(p))
    ckpt = tmp_path / "perturbed.ckpt"
    raw = torch.load(tmp_path / "r" / "retrofit.ckpt", weights_only=True)
    raw["state_dict"] = {f"model.{k}": v for k, v in model.state_dict().items()}
    torch.save(raw, ckpt)
    run(["export", "--ckpt_path", str(ckpt), "--out", str(tmp_path / "hf")])
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True).eval()
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for k in (1, 2, 4):
            assert (exported(ids, loops=k).logits - model(ids, loops=k)).abs().max() < 1e-5


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, r"arch.rope_scaling=.*only rope_type llama3"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, r"arch.rope_scaling=.*must be positive numbers"),
        ({"head_size": 7}, r"arch.head_size=7 must be even"),
        ({"qk_norm": 1}, r"arch.qk_norm=1 must be true or false"),
        ({"qkv_bias": "yes"}, r"arch.qkv_bias='yes' must be true or false"),
    ],
)
def test_the_new_arch_fields_refuse_bad_values(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig(**fields)


def test_head_size_decouples_heads_from_width() -> None:
    from elr_lightning.model import LoopedLM

    arch = ModelConfig(d_model=48, n_heads=4, n_kv_heads=2, head_size=16, qk_norm=True, qkv_bias=True, n_rec=1)
    attn = LoopedLM(arch).core.layers[0].attn
    assert (attn.q.weight.shape, attn.kv.weight.shape, attn.o.weight.shape) == ((64, 48), (64, 48), (48, 64))
    assert attn.q.bias is not None and attn.q_norm.weight.shape == (16,)
    plain = LoopedLM(ModelConfig(d_model=48, n_heads=4, n_rec=1)).core.layers[0].attn
    assert plain.q.bias is None and not hasattr(plain, "q_norm")  # defaults: the layer of every existing checkpoint
