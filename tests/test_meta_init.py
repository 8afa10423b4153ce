"""``meta_init``: a model built on the meta device, materialised with ``to_empty`` and initialised with
``init_weights``, gets the documented init; without the FSDP strategy the run stops at once."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from conftest import SWITCH_ARCH, quiet_trainer
from elr_lightning.conditioning import LoopConditioner
from elr_lightning.config import ModelConfig
from elr_lightning.model import LoopedLM
from elr_lightning.module import ELRModule

#: Wide enough for a statistical check of the normal inits (256 x 64 embedding entries).
ARCH = ModelConfig(**{**SWITCH_ARCH, "d_model": 64, "n_heads": 4})


def _module(meta_init: bool) -> ELRModule:
    return ELRModule(arch=ARCH, conditioner=LoopConditioner(d_cond=16, rank=4, n_freqs=4), meta_init=meta_init)


def test_meta_init_builds_only_the_model_on_meta():
    module = _module(meta_init=True)
    assert all(t.is_meta for t in (*module.model.parameters(), *module.model.buffers()))
    assert not module.token_bytes.is_meta
    assert all(not t.is_meta for t in module.val_loss["1"].metric_state.values())
    assert module.model.head.weight is module.model.embed.weight


@pytest.mark.parametrize("conditioner_active", [True, False])
def test_materialised_meta_model_gets_the_documented_init(conditioner_active):
    model = _module(meta_init=True).model
    model.conditioner.set_active(conditioner_active)
    model.to_empty(device="cpu")
    with torch.no_grad():  # make any value init_weights leaves alone visible
        for t in (*model.parameters(), *model.buffers()):
            t.fill_(math.nan) if t.is_floating_point() else t.fill_(not conditioner_active)
    model.init_weights()

    fresh = LoopedLM(ARCH, conditioner=LoopConditioner(d_cond=16, rank=4, n_freqs=4))
    assert model.head.weight is model.embed.weight
    assert model.roles == _module(meta_init=False).model.roles
    assert all(torch.isfinite(p).all() for p in model.parameters())
    zeros = [p for name, p in model.named_parameters() if model.roles[name][0] == "zeros"]
    assert len(zeros) > 4 and all(torch.count_nonzero(p) == 0 for p in zeros)
    norms = [m.weight for m in model.modules() if isinstance(m, nn.RMSNorm)]
    assert norms and all(torch.all(w == 1) for w in norms)
    assert model.embed.weight.std().item() == pytest.approx(ARCH.init_std, rel=0.05)
    scaled = torch.cat([p.flatten() for p in model.parameters_with_role(init="scaled_normal")])
    assert scaled.std().item() == pytest.approx(ARCH.init_std / math.sqrt(2 * ARCH.effective_depth(1)), rel=0.05)
    assert torch.equal(model.rotary.cos, fresh.rotary.cos) and torch.equal(model.rotary.sin, fresh.rotary.sin)
    assert torch.equal(model.conditioner.freqs, fresh.conditioner.freqs)
    assert bool(model.conditioner.active_flag) is conditioner_active is model.conditioner.active
    assert model.update.metrics()["beta_mean"] == 0


def test_meta_init_without_the_fsdp_strategy_says_what_to_do():
    data = torch.utils.data.DataLoader(torch.randint(0, ARCH.vocab_size, (4, 17)), batch_size=2)
    trainer = quiet_trainer(devices=1, max_steps=1)
    with pytest.raises(ValueError, match="meta_init: true needs OneLoopOverrideFSDPStrategy"):
        trainer.fit(_module(meta_init=True), train_dataloaders=data)


def test_materialised_meta_hybrid_model_gets_the_gdp_init():
    """A Gated DeltaProduct layer's own parameters (decay rates, conv) are initialised by ``init_weights`` too."""
    arch = ModelConfig(**{**SWITCH_ARCH, "token_pattern": ["gdp"]})
    module = ELRModule(arch=arch, conditioner=LoopConditioner(d_cond=16, rank=4, n_freqs=4), meta_init=True)
    model = module.model
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(math.nan)
    model.init_weights()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    gdp = model.core.layers[0].attn
    assert model.roles["core.layers.0.attn.A_log"] == ("module", "no_decay")
    assert bool(((gdp.A_log.exp() >= 1) & (gdp.A_log.exp() <= 16)).all())
    dt = torch.nn.functional.softplus(gdp.dt_bias)
    assert bool(((dt >= 1e-3 * 0.999) & (dt <= 0.1 * 1.001)).all())
    assert gdp.conv_weight.abs().max() <= 1 / math.sqrt(gdp.conv_size)
