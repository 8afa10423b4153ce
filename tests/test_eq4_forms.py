"""Eq. 4's fast in-graph forms (folded into the weights per loop) against the reference form on the activations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_config
from elr_lightning.conditioning import LoopConditioner
from elr_lightning.model import LoopedLM
from test_gdp import hybrid_config
from test_moe import moe_config

ARCHS = {
    "attention": lambda: tiny_config(max_seq_len=16),
    "hybrid": lambda: hybrid_config(max_seq_len=16),
    "moe": lambda: moe_config(tiny_config(max_seq_len=16)),
}


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("tokens", [(2, 16), (8, 16)])  # fewer and more tokens than the fold's width threshold
def test_folded_training_forward_equals_the_reference_form(arch: str, tokens: tuple[int, int]) -> None:
    torch.manual_seed(0)
    model = LoopedLM(ARCHS[arch](), conditioner=LoopConditioner(d_cond=8, rank=4))
    with torch.no_grad():  # heads off their zero init, so every term of eq. 4 is active
        for name, p in model.named_parameters():
            if "_mod." in name or name.startswith("core.conditioner"):
                p.normal_(std=0.2)
    ids = torch.randint(0, 64, tokens, generator=torch.Generator().manual_seed(1))
    results = {}
    for folded in (False, True):
        model.set_conditioning_form(folded)
        model.zero_grad()
        logits = model(ids, 3)
        F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
        results[folded] = logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.testing.assert_close(results[True][0], results[False][0], rtol=1e-5, atol=1e-5)
    assert results[True][1].keys() == results[False][1].keys()
    for name, grad in results[False][1].items():
        torch.testing.assert_close(results[True][1][name], grad, rtol=1e-4, atol=1e-6, msg=name)
