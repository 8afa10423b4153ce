"""GDP-Hybrid models in inference: cache policies with recurrent state, padding, accounting, folding, cost."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from conftest import GQA_CONFIG, perturbed_model
from elr_lightning.inference.cache import PerLoopCache, kv_cache_bytes, layer_caches, recurrent_state_bytes
from elr_lightning.inference.fold import fold_conditioning
from elr_lightning.inference.generate import generate
from elr_lightning.model import LoopedLM

pytestmark = pytest.mark.usefixtures("one_thread")

#: One GDP input layer, a GDP + attention recurrent block, one attention output layer.
HYBRID = replace(
    GQA_CONFIG,
    token_pattern={"in": ["gdp"], "rec": ["gdp", "attention"], "out": ["attention"]},
    mixers={"gdp": {"class_path": "elr_lightning.mixers.GatedDeltaProduct", "init_args": {"chunk_size": 8}}},
)


@pytest.fixture(scope="module")
def model() -> LoopedLM:
    return perturbed_model(HYBRID)


@pytest.mark.parametrize("loops", [1, 2, 4])
def test_per_loop_greedy_decode_equals_recompute(model: LoopedLM, loops: int) -> None:
    prompt = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(loops))
    out = generate(model, prompt, loops=loops, kv_cache="per_loop", max_new_tokens=12, greedy=True, output_logits=True)
    with torch.no_grad():
        full = model(out.sequences[:, :-1], loops)[:, 4:]
    torch.testing.assert_close(out.logits, full, atol=1e-4, rtol=0)
    assert torch.equal(out.new_tokens, full.argmax(-1))


def test_policies_agree_at_one_loop_and_differ_at_four(model: LoopedLM) -> None:
    prompt = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(7))
    kwargs = dict(max_new_tokens=6, greedy=True, output_logits=True)
    per, last = (generate(model, prompt, loops=1, kv_cache=p, **kwargs) for p in ("per_loop", "last_loop"))
    torch.testing.assert_close(per.logits, last.logits, atol=1e-6, rtol=0)
    per, last = (generate(model, prompt, loops=4, kv_cache=p, **kwargs) for p in ("per_loop", "last_loop"))
    torch.testing.assert_close(per.logits[:, 0], last.logits[:, 0], atol=1e-5, rtol=0)
    assert not torch.allclose(per.logits[:, 2], last.logits[:, 2], atol=1e-4)


@pytest.mark.parametrize("policy", ["per_loop", "last_loop"])
def test_left_padded_batch_equals_each_prompt_alone(model: LoopedLM, policy: str) -> None:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (2, 7, 4)]
    kwargs = dict(loops=3, kv_cache=policy, max_new_tokens=5, greedy=True, output_logits=True)
    batched = generate(model, prompts, **kwargs)
    for i, p in enumerate(prompts):
        alone = generate(model, [p], **kwargs)
        torch.testing.assert_close(batched.logits[i], alone.logits[0], atol=1e-4, rtol=0)


@pytest.mark.parametrize("policy, loops", [("per_loop", 3), ("last_loop", 3), ("per_loop", 1)])
def test_cache_accounting_separates_kv_and_state(model: LoopedLM, policy: str, loops: int) -> None:
    out = generate(model, torch.randint(0, 64, (2, 5)), loops=loops, kv_cache=policy, max_new_tokens=4, greedy=True)
    cache = out.cache
    assert cache.nbytes() == kv_cache_bytes(HYBRID, loops, policy, tokens=cache.offset, batch=2)
    assert cache.state_nbytes() == recurrent_state_bytes(HYBRID, loops, policy, batch=2) > 0
    gdp_stores = 1 + (loops if policy == "per_loop" else 1)  # the input layer + recurrent layer 0
    gdp = model.input_layers[0].attn
    per_store = gdp.heads * gdp.dk * gdp.dv * 4 + (gdp.conv_size - 1) * gdp.conv_weight.shape[0] * 4
    assert cache.state_nbytes() == 2 * gdp_stores * per_store
    attention_stores = layer_caches(HYBRID, loops, policy) - gdp_stores
    assert cache.nbytes() == attention_stores * 2 * HYBRID.kv_heads * HYBRID.head_dim * 4 * cache.offset * 2


def test_last_loop_state_is_the_last_loops(model: LoopedLM) -> None:
    from elr_lightning.inference.cache import LastLoopCache

    prompt = torch.randint(0, 64, (2, 7))
    per, last = PerLoopCache(8), LastLoopCache(8)
    with torch.no_grad():
        model(prompt, 3, cache=per)
        model(prompt, 3, cache=last)
    layer = HYBRID.n_in  # the recurrent block's GDP layer
    assert torch.allclose(last.slot(layer, 1).state("S"), per.slot(layer, 3).state("S"), atol=1e-6)
    assert not torch.allclose(last.slot(layer, 1).state("S"), per.slot(layer, 1).state("S"), atol=1e-3)


def test_fold_works_for_hybrid(model: LoopedLM) -> None:
    x = torch.randint(0, 64, (2, 9))
    folded = fold_conditioning(model, 3)
    with torch.no_grad():
        torch.testing.assert_close(folded(x, 3), model(x, 3), atol=1e-4, rtol=0)
        mask = torch.ones(2, 9, dtype=torch.long)
        mask[0, :4] = 0
        torch.testing.assert_close(folded(x, 3, mask)[0, 4:], model(x, 3, mask)[0, 4:], atol=1e-4, rtol=0)


def test_cost_json_reports_recurrent_state(tmp_path, capsys) -> None:
    import yaml

    from elr_lightning.estimate.cost import main

    raw = yaml.safe_load(open("config/quickstart_hybrid.yaml"))
    main(["--config", "config/quickstart_hybrid.yaml", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["parameters"]["total"] > 0
    arch = raw["model"]["init_args"]["arch"]
    state = report["recurrent_state_bytes_bf16"]
    assert set(state) == {str(k) for k in range(1, arch["max_loops"] + 1)}
    assert state["2"]["per_loop"] > state["1"]["per_loop"] == state["2"]["last_loop"] > 0
    kv = report["kv_bytes_per_token_bf16"]
    assert kv["2"]["per_loop"] > kv["1"]["per_loop"] == kv["2"]["last_loop"] > 0
