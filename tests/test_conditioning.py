"""Eq. 4's context inputs: tau_i = i / k and kappa = k / K, each in its own half of the MLP input."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import tiny_config
from elr_lightning.conditioning import LoopConditioner
from elr_lightning.model import LoopedLM


def _phi(x: float, n_freqs: int) -> list[float]:
    """[sin(2^j pi x) for j] + [cos(2^j pi x) for j], written out independently of the library."""
    angles = [math.pi * 2.0**j * x for j in range(n_freqs)]
    return [math.sin(a) for a in angles] + [math.cos(a) for a in angles]


def test_tau_and_kappa_reach_the_context_mlp_in_order_and_not_swapped():
    """At k = 3 of K = 4: loop i feeds [phi(i / 3); phi(3 / 4)]. tau and kappa differ at every loop
    (1/3, 2/3, 1 against 3/4), so a swap, or i / K in place of i / k, changes the inputs."""
    n_freqs = 3
    model = LoopedLM(tiny_config(max_loops=4), conditioner=LoopConditioner(d_cond=8, rank=2, n_freqs=n_freqs))
    seen = []
    model.conditioner.mlp.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach().clone()))
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 5)), 3)
    expected = [torch.tensor(_phi(i / 3, n_freqs) + _phi(3 / 4, n_freqs)) for i in (1, 2, 3)]
    assert len(seen) == 3
    for got, want in zip(seen, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "beyond_budget, expected",
    [
        ("ratio", [(i / 6, 6 / 4) for i in range(1, 7)]),  # eq. 4 as written: kappa = 6 / 4, never trained
        ("clamp", [(i / 6, 1.0) for i in range(1, 7)]),  # the trained budget code, finer loop steps
        ("replay", [(1 / 4, 1.0), (2 / 4, 1.0), (3 / 4, 1.0), (1.0, 1.0), (1.0, 1.0), (1.0, 1.0)]),  # K's loops, then its last
    ],
)
def test_beyond_the_budget_the_loops_get_the_codes_their_mode_names(beyond_budget, expected):
    """At k = 6 of K = 4 loop i feeds [phi(tau_i); phi(kappa)] as ``beyond_budget`` says; within the
    budget (k = 3) every mode feeds eq. 4's own [phi(i / 3); phi(3 / 4)]."""
    n_freqs = 3
    model = LoopedLM(tiny_config(max_loops=4), conditioner=LoopConditioner(8, 2, n_freqs, beyond_budget=beyond_budget))
    for loops, want in ((6, expected), (3, [(i / 3, 3 / 4) for i in (1, 2, 3)])):
        seen = []
        handle = model.conditioner.mlp.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach().clone()))
        with torch.no_grad():
            model(torch.randint(0, 64, (1, 5)), loops)
        handle.remove()
        assert len(seen) == len(want)
        for got, (tau, kappa) in zip(seen, want):
            torch.testing.assert_close(got, torch.tensor(_phi(tau, n_freqs) + _phi(kappa, n_freqs)), rtol=0, atol=1e-6)


@pytest.mark.parametrize("beyond_budget", ["ratio", "clamp", "replay"])
def test_the_hugging_face_conditioner_gives_the_same_contexts_at_every_k_to_2k(beyond_budget):
    """The exported modeling file writes the rule out again (it imports nothing of ours): same weights, same c_i."""
    pytest.importorskip("transformers")
    from elr_lightning.hf.modeling_elr import ELRConditioner

    ours = LoopConditioner(8, 2, 3, beyond_budget=beyond_budget)
    theirs = ELRConditioner(d_cond=8, n_freqs=3, beyond_budget=beyond_budget)
    theirs.mlp.load_state_dict(ours.mlp.state_dict())
    for loops in range(1, 9):
        for loop in range(1, loops + 1):
            torch.testing.assert_close(theirs(loop, loops, 4), ours.context(loop, loops, 4, torch.zeros(())), rtol=0, atol=0)


def test_an_unknown_beyond_budget_is_refused_naming_the_field_and_the_choices():
    with pytest.raises(ValueError, match=r"LoopConditioner.beyond_budget='clip': choose one of ratio, clamp, replay"):
        LoopConditioner(beyond_budget="clip")


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
def test_phi_is_computed_in_fp32_under_lightnings_half_precisions(precision):
    """Eq. 4's codes are the fp32 codes of inference and export, cast to the MLP's dtype; the frequencies stay fp32."""
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision

    from elr_lightning.conditioning import sinusoid

    plugin = HalfPrecision(precision) if precision.endswith("-true") else MixedPrecision(precision, "cpu")
    reference = LoopConditioner(d_cond=16, rank=4, n_freqs=8)
    model = LoopedLM(tiny_config(), conditioner=LoopConditioner(d_cond=16, rank=4, n_freqs=8))
    model = plugin.convert_module(model)
    conditioner = model.conditioner
    assert conditioner.freqs.dtype == torch.float32 and torch.equal(conditioner.freqs, reference.freqs)
    seen: list[torch.Tensor] = []
    conditioner.mlp.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    max_loops, codes = 4, []
    with plugin.forward_context():
        for loops in range(1, 2 * max_loops + 1):
            for loop in range(1, loops + 1):
                conditioner(loop, loops, max_loops, torch.zeros(1))
                tau, kappa = conditioner.steps(loop, loops, max_loops)
                codes.append(torch.cat((sinusoid(tau, reference.freqs), sinusoid(kappa, reference.freqs))))
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    assert [x.dtype for x in seen] == [dtype] * len(codes)
    assert all(torch.equal(x, code.to(dtype)) for x, code in zip(seen, codes))


def test_a_cast_to_bfloat16_keeps_the_frequencies_and_a_cast_back_changes_nothing():
    conditioner = LoopConditioner(n_freqs=8)
    exact = conditioner.freqs.clone()
    conditioner.to(torch.bfloat16)
    assert conditioner.mlp[0].weight.dtype == torch.bfloat16 and torch.equal(conditioner.freqs, exact)
    conditioner.to(torch.float64)  # a wider cast is nn.Module's own
    assert conditioner.freqs.dtype == torch.float64 and torch.equal(conditioner.freqs, exact.double())


@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
def test_rope_tables_stay_fp32_under_lightnings_true_half_precisions(precision):
    """RoPE's tables are those of fp32 training, inference and export after Lightning casts the model, and a
    half-precision attention layer rotates with them (its output equals the rotation by the fp32 tables)."""
    from lightning.pytorch.plugins.precision import HalfPrecision

    from elr_lightning.mixers.attention import apply_rope

    reference = LoopedLM(tiny_config())
    model = HalfPrecision(precision).convert_module(LoopedLM(tiny_config()))
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float16
    assert model.embed.weight.dtype == dtype
    assert model.rotary.cos.dtype == model.rotary.sin.dtype == torch.float32
    assert torch.equal(model.rotary.cos, reference.rotary.cos) and torch.equal(model.rotary.sin, reference.rotary.sin)
    assert (model.rotary.cos.to(dtype).float() - reference.rotary.cos).abs().max() > 1e-4  # what a cast table lost
    x = torch.randn(1, 2, 8, reference.rotary.cos.shape[1] * 2).to(dtype)
    cos, sin = model.rotary(0, 8)
    assert torch.equal(apply_rope(x, cos, sin), apply_rope(x.float(), *reference.rotary(0, 8)).to(dtype))
    model.float()
    assert torch.equal(model.rotary.cos, reference.rotary.cos)
