"""The Hugging Face export of hybrid (Gated DeltaProduct) and mixture-of-experts models.

Logits equal the native model's at k = 1, 2 and K, ``generate(loops=k)`` equals ``elr generate``
(per-loop cache, left padding included), the export loads without ``elr_lightning``, and an import
gives back every weight and buffer bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from _elr_ckpt import SERVE_ARCH  # noqa: E402
from conftest import perturbed_model  # noqa: E402
from test_hf_export import ATOL, in_process, run_remote  # noqa: E402
from elr_lightning.config import ModelConfig  # noqa: E402
from elr_lightning.inference.generate import generate  # noqa: E402
from elr_lightning.hf.export import export_hf, hf_config_fields, import_hf, save_module_checkpoint  # noqa: E402
from elr_lightning.mixers import GatedDeltaProduct  # noqa: E402
from elr_lightning.model import LoopedLM  # noqa: E402
from elr_lightning.tokenizers import ByteTokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

GDP = {"class_path": "elr_lightning.mixers.GatedDeltaProduct", "init_args": {"num_householder": 2, "chunk_size": 8}}
HYBRID = dataclasses.replace(
    SERVE_ARCH, token_pattern={"in": ["gdp"], "rec": ["gdp", "attention"], "out": ["attention"]}, mixers={"gdp": GDP}
)


def moe_arch(replay: str = "replay", hybrid: bool = False, top_k: int = 2) -> ModelConfig:
    """SERVE_ARCH (or HYBRID) with a shared-expert MoE in every layer under route replay mode ``replay``."""
    moe = {
        "class_path": "elr_lightning.mixers.MoE",
        "init_args": {"num_experts": 4, "top_k": top_k, "expert_dim": 16, "shared_expert_dim": 8},
    }
    base = HYBRID if hybrid else SERVE_ARCH
    return dataclasses.replace(base, channel_pattern=["moe"], route_replay=replay, mixers={**base.mixers, "moe": moe})


def model_of(arch: ModelConfig) -> LoopedLM:
    """A perturbed model whose MoE balancing biases are non-zero too (they steer the routes)."""
    model = perturbed_model(arch)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias"):
                buffer.copy_(0.05 * torch.randn_like(buffer))
    return model


ARCHS = {
    "hybrid": HYBRID,
    "moe_replay": moe_arch(),
    "moe_replay_experts": moe_arch("replay_experts"),
    "moe_replay_inference": moe_arch("replay_inference"),
    "moe_dynamic": moe_arch("dynamic"),
    "moe_top_1": moe_arch("replay_experts", top_k=1),  # gated by the raw router probability
    "hybrid_moe": moe_arch(hybrid=True),
}


@pytest.mark.parametrize("name", list(ARCHS))
def test_logits_and_generate_equal_the_native_model(name: str) -> None:
    model = model_of(ARCHS[name])
    hf = in_process(model)
    ids = torch.randint(0, 256, (2, 21), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for k in (1, 2, SERVE_ARCH.max_loops):
            assert (model(ids, k) - hf(ids, loops=k).logits).abs().max().item() <= ATOL, (name, k)
            ours = generate(model, ids[:1, :7], loops=k, max_new_tokens=8, greedy=True, kv_cache="per_loop")
            theirs = hf.generate(ids[:1, :7], loops=k, max_new_tokens=8, do_sample=False, pad_token_id=0)
            assert torch.equal(ours.sequences, theirs), (name, k)


def test_route_replay_reaches_the_export() -> None:
    """The replay mode changes the export's logits as it changes the native model's (same weights)."""
    ids = torch.randint(0, 256, (1, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        replay, dynamic = (in_process(model_of(moe_arch(mode)))(ids, loops=3).logits for mode in ("replay", "dynamic"))
    assert (replay - dynamic).abs().max().item() > 1e-3


def test_left_padded_hybrid_batch_leaves_the_recurrent_state_alone() -> None:
    model = model_of(moe_arch(hybrid=True))
    hf = in_process(model)
    short, long = [5, 6, 7], [1, 2, 3, 4, 5, 6, 7]
    batch, mask = torch.tensor([[0] * 4 + short, long]), torch.tensor([[0] * 4 + [1] * 3, [1] * 7])
    with torch.no_grad():
        for k in (1, 3):
            logits = hf(batch, attention_mask=mask, loops=k).logits
            assert (logits[0, 4:] - model(torch.tensor([short]), k)[0]).abs().max().item() <= ATOL, k
            theirs = hf.generate(batch, attention_mask=mask, loops=k, max_new_tokens=6, do_sample=False, pad_token_id=0)
            ours = generate(model, batch, attention_mask=mask, loops=k, max_new_tokens=6, greedy=True)
            assert torch.equal(theirs, ours.sequences), k


def test_import_restores_every_weight_and_buffer_bit_for_bit(tmp_path: Path) -> None:
    model = model_of(moe_arch(hybrid=True))
    out = export_hf(model, ByteTokenizer(), tmp_path / "export")
    back = import_hf(out)
    save_module_checkpoint(back, tmp_path / "back.ckpt")  # the checkpoint `elr import` writes
    before, after = model.state_dict(), back.model.state_dict()
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert tensor.dtype == after[name].dtype and torch.equal(tensor, after[name]), name
    assert back.model.config == model.config


def test_byte_tokenizer_export_has_a_pad_token(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    out = export_hf(model_of(HYBRID), ByteTokenizer(), tmp_path / "x")
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.pad_token_id == 0 and tok(["ab", "abcd"], padding=True)["input_ids"][0] == [97, 98, 0, 0]
    assert json.loads((out / "config.json").read_text())["pad_token_id"] == 0
    assert json.loads((out / "generation_config.json").read_text())["pad_token_id"] == 0


class MyGDP(GatedDeltaProduct):
    """A token mixer of one's own (the export knows the library's classes only, matched exactly)."""


def test_mixers_of_ones_own_are_refused() -> None:
    arch = dataclasses.replace(HYBRID, mixers={"gdp": {"class_path": f"{__name__}.MyGDP"}})
    with pytest.raises(ValueError, match="the mixer MyGDP has no Hugging Face counterpart"):
        hf_config_fields(LoopedLM(arch))


@pytest.mark.slow
def test_hybrid_moe_export_loads_without_elr_lightning(tmp_path: Path) -> None:
    """The shipped remote code (with the copied ``delta_rule.py``) runs where elr_lightning cannot import."""
    model = model_of(dataclasses.replace(moe_arch(hybrid=True), max_seq_len=64))
    out = export_hf(model, ByteTokenizer(), tmp_path / "export")
    assert {"hybrid_elr.py", "delta_rule.py"} <= {p.name for p in out.iterdir()}
    result = run_remote(out, tmp_path)
    with torch.no_grad():
        for k in (1, 2, 3, 4):
            assert (model(result["ids"], k) - result[f"logits{k}"]).abs().max().item() <= ATOL, k
            ours = generate(model, result["ids"], loops=k, max_new_tokens=12, greedy=True, kv_cache="per_loop")
            assert torch.equal(result[f"gen{k}"], ours.sequences), k
