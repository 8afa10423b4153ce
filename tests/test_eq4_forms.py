"""Eq. 4's fast in-graph forms (folded into the weights per loop) against the reference form on the activations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_config
from elr_lightning.conditioning import LoopConditioner
from elr_lightning.mixers.base import ChannelMixer
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


def test_batched_heads_equal_each_sublayers_own() -> None:
    """``FiLMAdapterModulator.modulations``: every sublayer's heads in one matmul equal ``modulation`` one by one."""
    torch.manual_seed(0)
    conditioner = LoopConditioner(d_cond=8, rank=4)
    mods = [conditioner.make_modulator(d) for d in (16, 16, 24)]  # widths may differ
    with torch.no_grad():
        for p in (p for mod in mods for p in mod.parameters()):
            p.normal_(std=0.2)
    c = torch.randn(8)
    for (scale, shift, terms), mod in zip(type(mods[0]).modulations(mods, c), mods):
        want_scale, want_shift, want = mod.modulation(c)
        for got, expected in ((scale, want_scale), (shift, want_shift), (terms.up, want.up), (terms.gate, want.gate)):
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
        assert terms.down is want.down


def test_a_loop_asks_for_all_its_sublayers_heads_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """One batched call per loop for the recurrent block and one per output layer: not one per sublayer."""
    model = LoopedLM(tiny_config(max_seq_len=16), conditioner=LoopConditioner(d_cond=8, rank=4))
    modulator = type(model.core.layers[0].attn_mod)
    calls = []
    original = modulator.modulations.__func__
    monkeypatch.setattr(modulator, "modulations", classmethod(lambda cls, mods, c: calls.append(len(mods)) or original(cls, mods, c)))
    model(torch.zeros(1, 4, dtype=torch.long), 3)
    n_rec, n_out = model.config.n_rec, model.config.n_out
    assert calls == [2 * n_rec] * 3 + [2] * n_out


def test_a_modulator_class_without_batched_heads_runs_the_reference_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """``modulations`` raising ``NotImplementedError`` leaves its sublayers to eq. 4 on the activations."""
    torch.manual_seed(0)
    model = LoopedLM(tiny_config(max_seq_len=16), conditioner=LoopConditioner(d_cond=8, rank=4))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_mod." in name:
                p.normal_(std=0.2)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    model.set_conditioning_form(folded=False)
    want = model(ids, 2)
    model.set_conditioning_form(folded=True)

    def unbatched(cls, mods, c):
        raise NotImplementedError

    modulator = type(model.core.layers[0].attn_mod)
    monkeypatch.setattr(modulator, "modulations", classmethod(unbatched))
    pre_calls = []
    original_pre = modulator.pre
    monkeypatch.setattr(modulator, "pre", lambda self, h, c: pre_calls.append(1) or original_pre(self, h, c))
    got = model(ids, 2)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert len(pre_calls) == 2 * (2 * model.config.n_rec + model.config.n_out)  # every sublayer, k = 2


class InPlaceGate(ChannelMixer):
    """A user's channel mixer that modifies a tensor its forward saved: autograd must refuse its backward."""

    fold_inputs, fold_outputs = ("up",), ("down",)

    def __init__(self, config) -> None:
        super().__init__(config)
        self.up = torch.nn.Linear(config.d_model, 2 * config.d_model, bias=False)
        self.down = torch.nn.Linear(2 * config.d_model, config.d_model, bias=False)

    def forward(self, x: torch.Tensor, ctx, layer: int) -> torch.Tensor:
        s = torch.sigmoid(self.up(x))  # sigmoid saves its output for the backward pass
        s.mul_(2)
        return self.down(s)


@pytest.mark.parametrize("conditioned", [False, True])
@pytest.mark.parametrize("tokens", [(2, 16), (8, 16)])  # P on the activations, and folded into the weights
def test_an_in_place_change_of_a_saved_tensor_raises_in_the_folded_form_as_without_it(
    conditioned: bool, tokens: tuple[int, int]
) -> None:
    """Eq. 4's saved-tensor hooks keep autograd's in-place check: a wrong gradient would otherwise pass silently."""
    config = tiny_config(max_seq_len=16, channel_pattern={"rec": [f"{__name__}.InPlaceGate"]})  # in the loop only
    torch.manual_seed(0)
    model = LoopedLM(config, conditioner=LoopConditioner(d_cond=8, rank=2) if conditioned else None).train()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    ids = torch.randint(0, 64, tokens)
    loss = F.cross_entropy(model(ids[:, :-1], 2).flatten(0, 1), ids[:, 1:].flatten())
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
