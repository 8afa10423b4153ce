"""Generation decodes a conditioned model through each k's conditioning constants, computed once per
generation from the weights as they are; ``LoopedLM.forward`` itself stays a pure function of its inputs."""

from __future__ import annotations

import gc
import warnings
import weakref
from dataclasses import replace

import pytest
import torch

from conftest import GQA_CONFIG, PlainConditioner, perturbed_model
from elr_lightning.inference.cache import PerLoopCache
from elr_lightning.conditioning import LoopConditioner
from elr_lightning.inference.generate import generate
from elr_lightning.model import LoopedLM
from elr_lightning.inference.fold import ConditionedBlock, FoldedLM, _build, conditioned_at, serving_model

pytestmark = pytest.mark.usefixtures("one_thread")

HYBRID = replace(
    GQA_CONFIG,
    token_pattern={"in": ["gdp"], "rec": ["gdp", "attention"], "out": ["attention"]},
    mixers={"gdp": {"class_path": "elr_lightning.mixers.GatedDeltaProduct", "init_args": {"chunk_size": 8}}},
)
MOE = replace(
    GQA_CONFIG,
    channel_pattern=["moe"],
    mixers={
        "moe": {"class_path": "elr_lightning.mixers.MoE", "init_args": {"num_experts": 4, "top_k": 2, "expert_dim": 16}}
    },
)


@pytest.mark.parametrize("config", [GQA_CONFIG, HYBRID, MOE], ids=["attention", "hybrid", "moe"])
@pytest.mark.parametrize("policy", ["per_loop", "last_loop"])
@pytest.mark.parametrize("loops", [1, 3])
def test_decoding_through_the_constants_equals_the_conditioner_per_token(config, policy: str, loops: int) -> None:
    model = perturbed_model(config)
    prompt = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    kwargs = dict(loops=loops, kv_cache=policy, max_new_tokens=6, greedy=True, output_logits=True)
    served = generate(model, prompt, **kwargs)
    runner = serving_model(model, loops)
    assert isinstance(runner, FoldedLM)
    shared = runner.core.per_loop[0][0].attn is model.core.layers[0].attn
    # On the CPU the weights are shared, not copied, at every k; elsewhere k = 1 folds into copies
    # (which a decode step reads instead of the originals) unless a mixer has no weight fold (MoE).
    assert shared
    assert any(isinstance(m, ConditionedBlock) for m in runner.modules())
    copied = _build(model, loops, fused_norm=True)
    assert (copied.core.per_loop[0][0].attn is model.core.layers[0].attn) == (loops > 1 or config is MOE)
    with torch.no_grad():
        torch.testing.assert_close(copied(prompt, loops), runner(prompt, loops), atol=1e-4, rtol=0)
    plain = generate(model, prompt, fold=False, **kwargs)
    torch.testing.assert_close(served.logits, plain.logits, atol=1e-4, rtol=0)
    assert torch.equal(served.new_tokens, plain.new_tokens)


def test_serving_leaves_the_training_mode_of_the_model_alone() -> None:
    model = perturbed_model(GQA_CONFIG).train()
    generate(model, [[1, 2, 3]], loops=1, max_new_tokens=2, greedy=True)
    generate(model, [[1, 2, 3]], loops=2, max_new_tokens=2, greedy=True)
    assert all(m.training for m in model.modules())


def test_a_runner_is_a_snapshot_built_per_call_and_reused_when_passed() -> None:
    """Each call builds anew; a runner passed to ``generate`` is used as it is (a snapshot of the constants)."""
    model = perturbed_model(GQA_CONFIG)
    prompt = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    kwargs = dict(loops=3, kv_cache="per_loop", max_new_tokens=6, greedy=True, output_logits=True)
    served = generate(model, prompt, **kwargs)
    runner = serving_model(model, 3)
    assert serving_model(model, 3) is not runner
    assert generate(runner, prompt, **kwargs).logits.equal(served.logits)
    with torch.no_grad():
        model.core.layers[0].attn_mod.omega.bias.add_(0.5)  # an optimizer step would do this in place
    changed = generate(model, prompt, **kwargs)
    torch.testing.assert_close(changed.logits, generate(model, prompt, fold=False, **kwargs).logits, atol=1e-4, rtol=0)
    assert not torch.allclose(changed.logits, served.logits, atol=1e-3)
    assert generate(runner, prompt, **kwargs).logits.equal(served.logits)  # the snapshot: the old constants


def test_the_constants_are_rebuilt_when_a_parameter_is_replaced() -> None:
    model = perturbed_model(GQA_CONFIG)
    prompt = torch.randint(0, 64, (1, 4), generator=torch.Generator().manual_seed(1))
    kwargs = dict(loops=2, kv_cache="last_loop", max_new_tokens=3, greedy=True, output_logits=True)
    before = generate(model, prompt, **kwargs).logits
    assert generate(model, prompt, **kwargs).logits.equal(before)  # served from the same constants
    weight = model.output_layers[0].mlp_mod.omega.bias
    model.output_layers[0].mlp_mod.omega.bias = torch.nn.Parameter(weight.detach() + 1.0)
    after = generate(model, prompt, **kwargs).logits
    torch.testing.assert_close(after, generate(model, prompt, fold=False, **kwargs).logits, atol=1e-4, rtol=0)
    assert not torch.allclose(after, before, atol=1e-3)


def _edit_mul(model: LoopedLM) -> None:
    for p in model.parameters():
        p.data.mul_(1.05)  # through .data: no version counter moves


def _edit_copy(model: LoopedLM) -> None:
    g = torch.Generator().manual_seed(7)
    for p in model.parameters():
        p.data.copy_(p.data + 0.05 * torch.randn(p.shape, generator=g))


def _edit_ema_swap(model: LoopedLM) -> None:
    """Swap in EMA weights in place (as an EMA callback does before validation), keeping the originals."""
    model.ema = [p.detach().clone().lerp_(torch.zeros_like(p), 0.1) for p in model.parameters()]
    for p, ema in zip(model.parameters(), model.ema):
        live = p.data.clone()
        p.data.copy_(ema)
        ema.copy_(live)


def _edit_load_state_dict(model: LoopedLM) -> None:
    model.load_state_dict(perturbed_model(GQA_CONFIG, seed=9).state_dict())


@pytest.mark.parametrize("edit", [_edit_mul, _edit_copy, _edit_ema_swap, _edit_load_state_dict],
                         ids=["data_mul", "data_copy", "ema_swap", "load_state_dict"])
@pytest.mark.parametrize("loops", [1, 3])
def test_generation_always_decodes_the_current_weights(edit, loops: int) -> None:
    """However the weights change between two generations (in place through ``p.data`` too, which no version
    counter sees), the next generation decodes them: it equals running the conditioner per token."""
    model = perturbed_model(GQA_CONFIG)
    prompt = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    kwargs = dict(loops=loops, kv_cache="per_loop", max_new_tokens=6, greedy=True, output_logits=True)
    before = generate(model, prompt, **kwargs)
    edit(model)
    after = generate(model, prompt, **kwargs)
    torch.testing.assert_close(after.logits, generate(model, prompt, fold=False, **kwargs).logits, atol=1e-4, rtol=0)
    assert not torch.allclose(after.logits, before.logits, atol=1e-2)
    if edit is _edit_ema_swap:  # and back: the live weights again
        for p, ema in zip(model.parameters(), model.ema):
            p.data.copy_(ema)
        torch.testing.assert_close(generate(model, prompt, **kwargs).logits, before.logits, atol=1e-5, rtol=0)


def test_forward_runs_the_conditioner_itself_and_serve_folded_opts_out(monkeypatch: pytest.MonkeyPatch) -> None:
    model = perturbed_model(GQA_CONFIG)
    calls = []
    context = LoopConditioner.context
    monkeypatch.setattr(LoopConditioner, "context", lambda self, *a: calls.append(a) or context(self, *a))
    ids = torch.randint(0, 64, (1, 4))
    with torch.no_grad():
        model(ids, 3, cache=PerLoopCache(max_len=8))
    assert len(calls) == 3  # forward: no fold
    generate(model, ids, loops=3, max_new_tokens=4, greedy=True)
    assert len(calls) == 6  # the constants: one context per loop, once per generation (not per token)
    model.serve_folded = False
    assert serving_model(model, 3) is model
    generate(model, ids, loops=3, max_new_tokens=4, greedy=True)
    assert len(calls) == 6 + 3 * 4  # the conditioner per forward pass: prefill and three decode steps
    assert isinstance(serving_model(model, 3, fold=True), FoldedLM)


def test_inactive_or_absent_conditioning_decodes_with_the_model_itself() -> None:
    model = perturbed_model(GQA_CONFIG)
    model.conditioner.set_active(False)
    assert serving_model(model, 2) is model
    plain = LoopedLM(GQA_CONFIG)
    assert serving_model(plain, 2, fold=True) is plain


def test_a_modulator_without_constants_decodes_unfolded_with_one_warning() -> None:
    torch.manual_seed(0)
    model = LoopedLM(GQA_CONFIG, conditioner=PlainConditioner(d_cond=8, rank=2)).eval()
    prompt = torch.randint(0, 64, (1, 4))
    with pytest.warns(UserWarning, match="decoding unfolded.*Identity does not implement modulation"):
        first = generate(model, prompt, loops=2, max_new_tokens=3, greedy=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = generate(model, prompt, loops=2, max_new_tokens=3, greedy=True)  # said once
    assert torch.equal(first.new_tokens, again.new_tokens)
    with pytest.raises(NotImplementedError, match="Identity does not implement modulation"):
        serving_model(model, 2, fold=True)


def test_no_process_wide_hook_and_serving_keeps_no_model_alive() -> None:
    hooks = torch.nn.modules.module._global_parameter_registration_hooks.values()
    assert not [h for h in hooks if getattr(h, "__module__", "").startswith("elr_lightning")]
    model = perturbed_model(GQA_CONFIG)
    generate(model, [[1, 2, 3]], loops=2, max_new_tokens=2, greedy=True)
    conditioned_at(model, 2)
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize("fused_norm", [True, False], ids=["fused", "split"])
@pytest.mark.parametrize("shape", [(1, 1), (1, 3), (2, 5)], ids=["one_token", "one_sequence", "batch"])
@pytest.mark.parametrize("eps", [1e-6, None], ids=["eps", "dtype_eps"])
def test_each_form_of_a_conditioned_block_equals_the_block(fused_norm: bool, shape: tuple, eps) -> None:
    model = perturbed_model(GQA_CONFIG)
    block = model.core.layers[1]
    block.attn_norm.eps = block.mlp_norm.eps = eps  # None: the norm uses its dtype's epsilon
    c = model.conditioner(2, 3, GQA_CONFIG.max_loops, model.embed.weight)
    ctx = model.loop_context(torch.zeros(shape, dtype=torch.long), 3)
    x = 3 * torch.randn(*shape, GQA_CONFIG.d_model, generator=torch.Generator().manual_seed(2))
    x[0, 0] *= 1e-3  # a small token, where eps weighs in the norm
    with torch.no_grad():
        want = block(x, ctx.at(2, c))
        got = ConditionedBlock(block, c, fused_norm=fused_norm)(x, ctx.at(2, None))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_on_the_cpu_a_conditioned_block_runs_no_rms_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    model = perturbed_model(GQA_CONFIG)
    c = model.conditioner(1, 2, GQA_CONFIG.max_loops, model.embed.weight)
    block = ConditionedBlock(model.core.layers[0], c)  # the default form on this device
    calls = []
    rms_norm = torch.nn.functional.rms_norm
    monkeypatch.setattr(torch.nn.functional, "rms_norm", lambda *a, **k: calls.append(a) or rms_norm(*a, **k))
    ids = torch.zeros(1, 1, dtype=torch.long)
    with torch.no_grad():
        block(torch.randn(1, 1, GQA_CONFIG.d_model), model.loop_context(ids, 2).at(1, None))
        model.core.layers[0](torch.randn(1, 1, GQA_CONFIG.d_model), model.loop_context(ids, 2).at(1, c))
    assert len(calls) == 2  # the block as trained normalizes twice; its served form not at all
