"""Eq. (4) folded into the sublayer weights per loop: the same function and gradients as applying it to
the activations (the reference ``Modulator.pre`` / ``post``), for attention, SwiGLU and GatedDeltaProduct."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from conftest import GQA_CONFIG, perturbed_model
from elr_lightning.mixers.base import low_rank_fold
from elr_lightning.model import LoopedLM

pytestmark = pytest.mark.usefixtures("one_thread")

HYBRID = replace(
    GQA_CONFIG,
    token_pattern={"in": ["gdp"], "rec": ["gdp", "attention"], "out": ["attention"]},
    mixers={"gdp": {"class_path": "elr_lightning.mixers.GatedDeltaProduct", "init_args": {"chunk_size": 8}}},
)


def loss_and_grads(model: LoopedLM, ids: torch.Tensor, loops: int, mask: torch.Tensor | None = None):
    model.zero_grad(set_to_none=True)
    logits = model(ids[:, :-1], loops, None if mask is None else mask[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("config", [GQA_CONFIG, HYBRID], ids=["attention", "hybrid"])
@pytest.mark.parametrize("loops", [1, 3])
@pytest.mark.parametrize("shape", [(2, 17), (6, 64)], ids=["activation-form", "weight-form"])
def test_folded_gradients_equal_the_activation_form(config, loops: int, shape: tuple[int, int]) -> None:
    """32 tokens: every mixer's projections are wider than the batch, so P and the gate act on the
    activations; 378 tokens: all are folded into the weights (Mixer.modulated picks by shape)."""
    model = perturbed_model(config).train()
    ids = torch.randint(0, 64, shape, generator=torch.Generator().manual_seed(loops))
    loss, grads = loss_and_grads(model, ids, loops)
    model.set_conditioning_form(folded=False)  # eq. 4 on the activations, as the paper writes it
    ref_loss, ref_grads = loss_and_grads(model, ids, loops)
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
    assert grads.keys() == ref_grads.keys()
    assert any(n.endswith("attn_mod.g.weight") for n in grads)  # the adapter gate is trained
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], atol=2e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def test_folded_gradients_equal_with_padding() -> None:
    model = perturbed_model(HYBRID).train()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    loss, grads = loss_and_grads(model, ids, 2, mask)
    model.set_conditioning_form(folded=False)  # eq. 4 on the activations, as the paper writes it
    ref_loss, ref_grads = loss_and_grads(model, ids, 2, mask)
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], atol=2e-5, rtol=1e-4)



@pytest.mark.parametrize("shape", [(6, 5), (40, 16)])
def test_low_rank_fold_backward_matches_autograd_in_float64(shape: tuple[int, int]) -> None:
    """The hand-written backward of W P = W + (W up) down (eq. 4's adapter in a weight) is exact."""
    gen = torch.Generator().manual_seed(shape[0])
    w, up, down = (
        torch.randn(*s, generator=gen, dtype=torch.float64, requires_grad=True)
        for s in (shape, (shape[1], 3), (3, shape[1]))
    )
    assert torch.autograd.gradcheck(low_rank_fold, (w, up, down))
    grad = torch.randn(shape, generator=gen, dtype=torch.float64)
    ours = torch.autograd.grad(low_rank_fold(w, up, down), (w, up, down), grad)
    reference = torch.autograd.grad(torch.addmm(w, w @ up, down), (w, up, down), grad)
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_beta_mean_is_the_last_loops_mean_step() -> None:
    """``metrics()`` reports the mean step size beta of the last training forward's last loop (eq. 2)."""
    model = perturbed_model(GQA_CONFIG).train()
    seen: list[torch.Tensor] = []
    model.update.register_forward_hook(lambda module, args, out: seen.append(module.beta(args[2]).detach()))
    model(torch.randint(0, 64, (2, 9)), 3)
    assert len(seen) == 3
    torch.testing.assert_close(model.update.metrics()["beta_mean"], seen[-1].float().mean())


def test_folded_training_under_bf16_autocast_tracks_fp32() -> None:
    """The weight form under bf16 autocast: the fold runs in the weights' dtype, gradients follow fp32's."""
    model = perturbed_model(GQA_CONFIG).train()
    ids = torch.randint(0, 64, (6, 64), generator=torch.Generator().manual_seed(3))
    loss, grads = loss_and_grads(model, ids, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low_loss, low_grads = loss_and_grads(model, ids, 2)
    torch.testing.assert_close(low_loss, loss, atol=0.05, rtol=0.02)
    assert grads.keys() == low_grads.keys()
    for name, g in grads.items():
        assert low_grads[name].dtype == torch.float32
        cosine = F.cosine_similarity(low_grads[name].flatten(), g.flatten(), dim=0)
        assert cosine > 0.95, f"{name}: cosine {cosine:.3f} to the fp32 gradient"
