"""Eq. 4's context inputs: tau_i = i / k and kappa = k / K, each in its own half of the MLP input."""

from __future__ import annotations

import math

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


def test_beyond_the_budget_kappa_is_held_at_one_unless_told_otherwise():
    """At k = 6 of K = 4 loop i feeds [phi(i / 6); phi(1)]: the trained budget code, not phi(6 / 4), which
    differs from phi(2 / 4) only at the lowest frequency. ``clamp_budget=False`` keeps k / K."""
    n_freqs = 3
    for clamp, kappa in ((True, 1.0), (False, 6 / 4)):
        model = LoopedLM(tiny_config(max_loops=4), conditioner=LoopConditioner(8, 2, n_freqs, clamp_budget=clamp))
        seen = []
        model.conditioner.mlp.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach().clone()))
        with torch.no_grad():
            model(torch.randint(0, 64, (1, 5)), 6)
        for i, got in enumerate(seen, start=1):
            torch.testing.assert_close(got, torch.tensor(_phi(i / 6, n_freqs) + _phi(kappa, n_freqs)), rtol=0, atol=1e-6)
    conditioner = LoopConditioner(8, 2, n_freqs)
    torch.testing.assert_close(conditioner.context(6, 6, 4, torch.zeros(())), conditioner.context(4, 4, 4, torch.zeros(())))
