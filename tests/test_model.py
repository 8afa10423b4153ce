"""The looped LM: data flow (DESIGN §2), eq. 1, eq. 2 at init, zero-init conditioning (eq. 4)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import tiny_config
from elr_lightning.conditioning import LoopConditioner
from elr_lightning.config import ModelConfig
from elr_lightning.model import LoopedLM
from elr_lightning.updates import BETA_INIT, AdaptiveDelta, FixedDelta, NonRecurrent, Replace, Residual


def test_logits_shape_for_every_k(tiny):
    model = LoopedLM(tiny, conditioner=LoopConditioner(d_cond=8, rank=2))
    x = torch.randint(0, tiny.vocab_size, (3, 10))
    for k in range(1, 6):
        assert model(x, k).shape == (3, 10, tiny.vocab_size)


@pytest.mark.parametrize("loops", [1, 2, 4])
def test_each_layer_runs_as_eq1_says(loops):
    cfg = tiny_config(n_in=2, n_rec=3, n_out=1)
    model = LoopedLM(cfg)
    calls: dict[str, int] = {}
    layers = {"in": model.input_layers, "rec": model.core.layers, "out": model.output_layers}
    for name, block in layers.items():
        for i, layer in enumerate(block):
            layer.register_forward_hook(lambda *_, key=f"{name}{i}": calls.__setitem__(key, calls.get(key, 0) + 1))
    model(torch.randint(0, cfg.vocab_size, (1, 5)), loops)
    assert all(calls[f"in{i}"] == 1 for i in range(2)) and calls["out0"] == 1
    assert all(calls[f"rec{i}"] == loops for i in range(3))
    assert sum(calls.values()) == cfg.effective_depth(loops)


@given(seed=st.integers(0, 2**16), loops=st.integers(1, 5), d=st.sampled_from([16, 32]))
def test_zero_init_conditioning_is_identity_bit_for_bit(seed, loops, d):
    torch.manual_seed(seed)
    cfg = tiny_config(d_model=d, n_rec=2)
    plain = LoopedLM(cfg)
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    conditioned = LoopedLM(cfg, conditioner=LoopConditioner(d_cond=8, rank=3))
    missing, unexpected = conditioned.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and missing and all("mod" in k or "conditioner" in k for k in missing)
    x = torch.randint(0, cfg.vocab_size, (2, 12))
    assert torch.equal(conditioned(x, loops), plain(x, loops))


def test_nonzero_heads_change_the_output(tiny):
    model = LoopedLM(tiny, conditioner=LoopConditioner(d_cond=8, rank=2))
    x = torch.randint(0, tiny.vocab_size, (2, 8))
    before = model(x, 3)
    with torch.no_grad():
        model.output_layers[0].mlp_mod.omega.bias.fill_(0.5)
    assert not torch.allclose(before, model(x, 3))


def test_inactive_conditioner_runs_plain_layers(tiny):
    model = LoopedLM(tiny, conditioner=LoopConditioner(d_cond=8, rank=2))
    with torch.no_grad():
        model.output_layers[0].mlp_mod.omega.bias.fill_(0.5)
    x = torch.randint(0, tiny.vocab_size, (2, 8))
    active = model(x, 2)
    model.conditioner.set_active(False)
    plain = LoopedLM(tiny)
    plain.load_state_dict(model.state_dict(), strict=False)
    assert torch.equal(model(x, 2), plain(x, 2)) and not torch.equal(active, plain(x, 2))


@given(seed=st.integers(0, 2**16), d=st.sampled_from([8, 32, 64]))
def test_beta_at_init_is_half_ln2(seed, d):
    torch.manual_seed(seed)
    rule = LoopedLM(tiny_config(d_model=d), update=AdaptiveDelta()).update
    s_tilde = torch.randn(2, 5, d) * 10
    beta = rule.beta(s_tilde)
    assert BETA_INIT == pytest.approx(0.5 * math.log(2)) == pytest.approx(0.3466, abs=1e-4)
    assert torch.allclose(beta, torch.full_like(beta, BETA_INIT), atol=1e-7)


def test_gate_adds_d_squared_plus_2d_parameters(tiny):
    elr, base = LoopedLM(tiny), LoopedLM.baseline(tiny)
    d = tiny.d_model
    assert sum(p.numel() for p in elr.parameters()) - sum(p.numel() for p in base.parameters()) == d * d + 2 * d


def test_baseline_is_a_plain_stack(tiny):
    base = LoopedLM.baseline(tiny)
    x = torch.randint(0, tiny.vocab_size, (2, 7))
    ctx = base.loop_context(x, 1)
    h = base.embed(x)
    for layer in [*base.input_layers, *base.core.layers, *base.output_layers]:
        h = layer(h, ctx)
    assert torch.allclose(base(x, 1), base.head(base.norm(h)))


@pytest.mark.parametrize(
    "rule, expected",
    [  # s_{i-1} = 1, r_i = 3, s~_i = 2 (= s_{i-1} + h_in with h_in = 1), worked out by hand
        (FixedDelta(0.25), 1.5),  # s + 0.25 (r - s)
        (Residual(), 2.0),  # s + (r - s~): the block's residual on top of the state
        (Replace(), 3.0),  # r
        (NonRecurrent(), 3.0),  # r
    ],
)
def test_ablation_rules(rule, expected):
    s, r, s_tilde = (torch.full((1, 2, 4), v) for v in (1.0, 3.0, 2.0))
    assert torch.equal(rule(s, r, s_tilde), torch.full((1, 2, 4), expected))


def test_adaptive_delta_at_k1_from_paper():
    """s_1 = h_in + beta (R(2 h_in) - h_in) with s~_1 = s_0 + h_in = 2 h_in (eq. 2)."""
    cfg = tiny_config(n_in=0, n_out=0)
    model = LoopedLM(cfg)
    h_in = torch.randn(1, 4, cfg.d_model)
    ctx = model.loop_context(torch.zeros(1, 4, dtype=torch.long), 1)
    s, _ = model.core(h_in, ctx)
    r = model.core.layers[0](2 * h_in, ctx.at(1, None))
    assert torch.allclose(s, h_in + BETA_INIT * (r - h_in), atol=1e-6)


def test_init_weights_zeroes_gate_and_heads(tiny):
    model = LoopedLM(tiny, conditioner=LoopConditioner(d_cond=8, rank=2))
    zero = [model.update.gate.weight, model.update.gate.bias, model.update.gamma]  # gamma = 0: beta = 0.5 ln 2
    for layer in [*model.core.layers, *model.output_layers]:
        for mod in (layer.attn_mod, layer.mlp_mod):
            zero += [mod.film.weight, mod.film.bias, mod.g.weight, mod.omega.weight]
    assert all(torch.count_nonzero(p) == 0 for p in zero)
    assert model.embed.weight.std().item() == pytest.approx(tiny.init_std, rel=0.2)
    assert model.core.layers[0].attn.o.weight.std() < model.core.layers[0].attn.q.weight.std()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"d_model": 30, "n_heads": 4}, "arch.d_model"),
        ({"n_rec": 0}, "arch.n_rec"),
        ({"max_loops": 0}, "arch.max_loops"),
        ({"n_heads": 4, "n_kv_heads": 3}, "arch.n_kv_heads"),
        ({"vocab_size": 0}, "arch.vocab_size"),
        ({"d_model": 27, "n_heads": 3}, "arch.d_model / arch.n_heads = 9 must be even for rotary embeddings; pick"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        ModelConfig(**kwargs)


def test_sequence_above_rope_limit_is_refused():
    model = LoopedLM(tiny_config(max_seq_len=16))
    with pytest.raises(ValueError, match=r"arch\.max_seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long), 1)


def test_loops_below_one_is_refused(tiny):
    with pytest.raises(ValueError, match="loops=0"):
        LoopedLM(tiny)(torch.zeros(1, 4, dtype=torch.long), 0)


def test_grouped_query_attention_runs_and_differs_from_full_heads():
    gqa = LoopedLM(tiny_config(n_heads=4, n_kv_heads=2))
    mha = LoopedLM(tiny_config(n_heads=4))
    assert sum(p.numel() for p in gqa.parameters()) < sum(p.numel() for p in mha.parameters())
    assert gqa(torch.randint(0, 64, (2, 9)), 2).isfinite().all()


def test_causality(tiny):
    model = LoopedLM(tiny)
    x = torch.randint(0, tiny.vocab_size, (1, 12))
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 1) % tiny.vocab_size
    assert torch.allclose(model(x, 3)[:, :8], model(y, 3)[:, :8], atol=1e-6)


def test_active_flag_travels_with_the_weights(tiny):
    source = LoopedLM(tiny, conditioner=LoopConditioner(d_cond=8, rank=2))
    source.conditioner.set_active(False)
    assert "core.conditioner.active_flag" in source.state_dict()
    target = LoopedLM(tiny, conditioner=LoopConditioner(d_cond=8, rank=2))
    assert target.conditioner.active
    target.load_state_dict(source.state_dict())
    assert not target.conditioner.active
    x = torch.randint(0, tiny.vocab_size, (1, 6))
    assert torch.equal(target(x, 2), source(x, 2))


@given(step=st.floats(0.05, 1.0))
@settings(max_examples=8, deadline=None)
def test_adaptive_delta_starts_at_its_initial_step(step: float) -> None:
    model = LoopedLM(tiny_config(d_model=16), update=AdaptiveDelta(initial_step=step))
    beta = model.update.beta(torch.randn(2, 3, 16))
    assert torch.allclose(beta, torch.full_like(beta, step), rtol=1e-5)


@pytest.mark.parametrize("step", [0.0, -0.1, 1.5])
def test_adaptive_delta_rejects_a_step_outside_0_1(step: float) -> None:
    with pytest.raises(ValueError, match="AdaptiveDelta.initial_step"):
        AdaptiveDelta(initial_step=step)


def test_mean_injection_feeds_the_block_the_mean_of_state_and_input() -> None:
    rule = AdaptiveDelta(injection="mean")
    s, h_in = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    assert torch.allclose(rule.inject(s, h_in), (s + h_in) / 2)
    assert torch.equal(AdaptiveDelta().inject(s, h_in), s + h_in)
    model = LoopedLM(tiny_config(d_model=16), update=AdaptiveDelta(injection="mean"))
    assert model(torch.zeros(1, 4, dtype=torch.long), 2).isfinite().all()
    with pytest.raises(ValueError, match="AdaptiveDelta.injection"):
        AdaptiveDelta(injection="max")
