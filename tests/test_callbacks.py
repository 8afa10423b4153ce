"""Tests of the ELR callbacks: delayed mixed depth, zero-init conditioning, compute accounting (eq. 5)."""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback

from elr_lightning.callbacks import ComputeAccounting, DelayedMixedDepth, DelayedSampler, ZeroInitConditioning
from elr_lightning.callbacks.delayed_mixed_depth import load_weights_where_present
from elr_lightning.callbacks.switch import SwitchPoint
from elr_lightning.callbacks.zero_init_conditioning import conditioning_parameters, zero_heads
from elr_lightning.cli import run
from conftest import SWITCH_ARCH, quiet_trainer, switch_module
from elr_lightning.conditioning import LoopConditioner
from elr_lightning.config import ModelConfig
from elr_lightning.data import TextDataModule
from elr_lightning.flops import (
    compute_multiplier,
    flops_multiplier,
    forward_flops_per_token,
    train_flops_per_token,
)
from elr_lightning.model import LoopedLM
from elr_lightning.module import ELRModule
from elr_lightning.sampling import FixedLoops, OneLoopOverride
from elr_lightning.updates import NonRecurrent

ROOT = Path(__file__).resolve().parents[1]
ARCH = SWITCH_ARCH


def make_module(conditioner: bool = True, **arch: Any) -> ELRModule:
    """The shared switch-test module (see conftest), at lr 1e-2."""
    return switch_module(conditioner, lr=1e-2, **arch)


def make_data(tmp_path: Path) -> TextDataModule:
    return TextDataModule(seq_len=16, batch_size=4, max_bytes=20000, cache_dir=str(tmp_path / "cache"))


def make_trainer(callbacks: list[Callback], max_steps: int = 6, **kwargs: Any) -> pl.Trainer:
    return quiet_trainer(
        max_steps=max_steps, devices=1, limit_val_batches=0, precision=32, callbacks=callbacks, **kwargs
    )


# ---- switch point and sampler ----------------------------------------------------------------
def test_delayed_sampler_is_k1_before_the_switch_and_the_mixed_schedule_after():
    after = OneLoopOverride(4, 0.25)
    sampler = DelayedSampler(after, switch_step=10)
    for step in range(30):
        expected = [1] * 8 if step < 10 else after.schedule(7, step, 8)
        assert sampler.schedule(7, step, 8) == expected
    assert sampler.max_loops == 4


def test_switch_point_resolves_a_fraction_of_planned_steps():
    trainer = make_trainer([], max_steps=800)
    assert SwitchPoint(0.75).resolve(trainer) == 600
    assert SwitchPoint(0.75, step=17).resolve(trainer) == 17
    with pytest.raises(ValueError, match="switch_fraction"):
        SwitchPoint(1.5)
    with pytest.raises(ValueError, match="switch_step"):
        SwitchPoint(None, -1)


# ---- the switch itself -------------------------------------------------------------------------
class SwitchProbe(Callback):
    """Records grads, optimizer state and LRs per step; checks outputs around the switch."""

    def __init__(self, switch: int, inputs: torch.Tensor) -> None:
        self.switch = switch
        self.inputs = inputs
        self.grads: dict[int, dict[str, Optional[float]]] = {}
        self.state_before_switch: Optional[int] = None
        self.lrs: dict[int, dict[str, float]] = {}
        self.scheduled: dict[int, float] = {}
        self.before: dict[int, torch.Tensor] = {}
        self.outputs_checked = False
        self.loops: dict[int, list[int]] = {}

    def logits(self, module: ELRModule) -> dict[int, torch.Tensor]:
        with torch.no_grad():
            return {k: module(self.inputs, k) for k in range(1, module.arch.max_loops + 1)}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: ELRModule, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        self.loops[step] = pl_module.step_schedule()
        if step != self.switch:
            return
        conditioner = pl_module.model.conditioner
        assert conditioner.active
        assert all(torch.count_nonzero(p) == 0 for p in zero_heads(pl_module))
        after = self.logits(pl_module)
        conditioner.set_active(False)
        plain = self.logits(pl_module)
        conditioner.set_active(True)
        without_heads = make_module(conditioner=False)
        own = pl_module.state_dict()
        without_heads.load_state_dict({k: v for k, v in own.items() if k in without_heads.state_dict()})
        no_heads = self.logits(without_heads)
        for k in after:
            assert torch.equal(after[k], self.before[k]), f"k={k}: the switch changed the outputs"
            assert torch.equal(after[k], plain[k])
            assert torch.equal(after[k], no_heads[k])
        self.outputs_checked = True

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: ELRModule, optimizer: Any) -> None:
        step = trainer.global_step
        self.grads[step] = {
            name: None if p.grad is None else float(p.grad.abs().sum())
            for name, p in pl_module.named_parameters()
            if p in set(conditioning_parameters(pl_module))
        }
        self.lrs[step] = {g["name"]: g["lr"] for g in optimizer.param_groups}
        self.scheduled[step] = trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0]

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: ELRModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step != self.switch:
            return
        optimizer = trainer.optimizers[0]
        self.state_before_switch = sum(p in optimizer.state for p in conditioning_parameters(pl_module))
        self.before = self.logits(pl_module)
        with torch.no_grad():
            for p in zero_heads(pl_module):
                p.fill_(0.5)  # something touched the heads: the switch must re-zero them


def test_switch_is_bit_identical_and_brings_the_heads_into_the_optimizer(tmp_path):
    switch, steps = 3, 6
    module = make_module()
    inputs = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    probe = SwitchProbe(switch, inputs)
    trainer = make_trainer([DelayedMixedDepth(switch_step=switch), ZeroInitConditioning(), probe], max_steps=steps)
    trainer.fit(module, make_data(tmp_path))

    assert probe.outputs_checked
    mixed = OneLoopOverride(3, 0.5)
    for step in range(steps):
        assert probe.loops[step] == ([1, 1] if step < switch else mixed.schedule(0, step, 2)), probe.loops
    assert any(k > 1 for step in range(switch, steps) for k in probe.loops[step])
    heads = {n for n, p in module.named_parameters() if p in set(zero_heads(module))}
    for step in range(switch):
        assert all(g is None for g in probe.grads[step].values()), f"step {step}: heads got grads before the switch"
    assert probe.state_before_switch == 0
    assert all(probe.grads[switch][name] > 0 for name in heads), probe.grads[switch]
    assert all(g is not None and g > 0 for g in probe.grads[switch + 1].values()), probe.grads[switch + 1]
    for step in range(switch, steps):
        lrs = probe.lrs[step]
        assert lrs["conditioning"] == lrs["decay"] == probe.scheduled[step] > 0
    optimizer = trainer.optimizers[0]
    assert all(p in optimizer.state for p in conditioning_parameters(module))
    assert all(torch.count_nonzero(p) > 0 for p in zero_heads(module))


class ZeroGradsBeforeSwitch(Callback):
    """What a sharded strategy that touches every parameter does: zero grads for the inactive heads."""

    def __init__(self, switch: int) -> None:
        self.switch = switch

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: ELRModule, optimizer: Any) -> None:
        if trainer.global_step < self.switch:
            for p in conditioning_parameters(pl_module):
                p.grad = torch.zeros_like(p)


def test_zero_gradients_before_the_switch_leave_no_trace(tmp_path):
    states = []
    for extra in ([], [ZeroGradsBeforeSwitch(3)]):
        module = make_module()
        trainer = make_trainer([DelayedMixedDepth(switch_step=3), ZeroInitConditioning(), *extra])
        trainer.fit(module, make_data(tmp_path))
        states.append(module.state_dict())
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_resumed_state_refuses_a_moved_switch():
    callback = DelayedMixedDepth(switch_fraction=0.75)
    callback.switch_step = 600
    callback.load_state_dict({"switch_step": 600})
    with pytest.raises(ValueError, match="switch at step 450.*step 600"):
        callback.load_state_dict({"switch_step": 450})
    zero = ZeroInitConditioning(switch_step=5)
    zero.switch_step = 5
    with pytest.raises(ValueError, match="switch_step: 4"):
        zero.load_state_dict({"switch_step": 4})


def test_delayed_mixed_depth_with_conditioner_needs_zero_init(tmp_path):
    trainer = make_trainer([DelayedMixedDepth(switch_step=2)])
    with pytest.raises(ValueError, match="ZeroInitConditioning"):
        trainer.fit(make_module(), make_data(tmp_path))


def test_zero_init_needs_a_switch_and_a_conditioner(tmp_path):
    with pytest.raises(ValueError, match="follows a DelayedMixedDepth"):
        make_trainer([ZeroInitConditioning()]).fit(make_module(), make_data(tmp_path))
    with pytest.raises(ValueError, match="needs a model with a conditioner"):
        make_trainer([ZeroInitConditioning(switch_step=1)]).fit(make_module(conditioner=False), make_data(tmp_path))


def test_zero_init_needs_the_conditioning_group_from_step_zero(tmp_path):
    class OneGroup(ELRModule):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    pl.seed_everything(0)
    module = OneGroup(ModelConfig(**ARCH), conditioner=LoopConditioner(8, 2, 2), sampler=FixedLoops(1))
    with pytest.raises(ValueError, match="param group named 'conditioning'"):
        make_trainer([ZeroInitConditioning(switch_step=1)]).fit(module, make_data(tmp_path))


def test_delayed_sampler_rejects_a_sampler_beyond_the_budget(tmp_path):
    callbacks = [DelayedMixedDepth(sampler=OneLoopOverride(5, 0.15), switch_step=1), ZeroInitConditioning()]
    with pytest.raises(ValueError, match="exceeds arch.max_loops=3"):
        make_trainer(callbacks).fit(make_module(), make_data(tmp_path))


# ---- continuing from a one-loop checkpoint -----------------------------------------------------
def test_init_from_a_plain_non_recurrent_state_dict(tmp_path):
    arch = ModelConfig(**ARCH)
    pl.seed_everything(3)
    plain = LoopedLM(arch, update=NonRecurrent(), conditioner=None)
    path = tmp_path / "plain.pt"
    torch.save(plain.state_dict(), path)
    module = make_module()
    new = load_weights_where_present(module.model, str(path))
    assert new and all("conditioner" in n or "_mod." in n or "update." in n for n in new)
    assert any("update.gate" in n for n in new) and any("attn_mod.film" in n for n in new)
    for name, value in plain.state_dict().items():
        assert torch.equal(module.model.state_dict()[name], value)
    assert all(torch.count_nonzero(p) == 0 for p in zero_heads(module))


def test_init_from_a_lightning_checkpoint_starts_the_mixed_phase_at_once(tmp_path):
    one_loop = make_module()
    trainer = make_trainer([DelayedMixedDepth(switch_step=100), ZeroInitConditioning()], max_steps=2)
    trainer.fit(one_loop, make_data(tmp_path))
    path = tmp_path / "one_loop.ckpt"
    trainer.save_checkpoint(path)

    module = make_module()
    probe = SwitchProbe(switch=-1, inputs=torch.zeros(1, 4, dtype=torch.long))
    callbacks = [DelayedMixedDepth(init_from=str(path)), ZeroInitConditioning(), probe]
    make_trainer(callbacks, max_steps=2).fit(module, make_data(tmp_path / "b"))
    assert callbacks[0].switch_step == 0
    assert any(k > 1 for k in probe.loops[0] + probe.loops[1])
    assert all(g is not None for g in probe.grads[1].values())


def test_init_from_a_different_architecture_is_refused(tmp_path):
    path = tmp_path / "wide.pt"
    torch.save(LoopedLM(ModelConfig(**{**ARCH, "d_model": 64})).state_dict(), path)
    with pytest.raises(ValueError, match="shapes differ"):
        load_weights_where_present(make_module().model, str(path))
    torch.save(LoopedLM(ModelConfig(**{**ARCH, "n_rec": 2})).state_dict(), path)
    with pytest.raises(ValueError, match="lacks: core.layers.1"):
        load_weights_where_present(make_module().model, str(path))


# ---- compute accounting (eq. 5) ----------------------------------------------------------------
def yaml_arch(name: str) -> tuple[ModelConfig, dict[str, Any]]:
    config = yaml.safe_load((ROOT / "config" / name).read_text())
    args = config["model"]["init_args"]
    return ModelConfig(**args["arch"]), args["sampler"]["init_args"]


def test_forward_flops_count_every_matmul_of_the_model():
    arch = ModelConfig(**ARCH)
    for conditioner in (None, LoopConditioner(8, 2, 2)):
        model = LoopedLM(arch, conditioner=conditioner)
        linear = 0
        for name, module in model.named_modules():
            in_heads = ".film" in name or name.endswith((".g", ".omega")) or "conditioner.mlp" in name
            if isinstance(module, torch.nn.Linear) and not in_heads:
                linear += module.weight.numel()
        t = 16
        attention = 4 * arch.d_model * (t + 1) / 2 * 3
        rank = 0 if conditioner is None else 2
        assert forward_flops_per_token(arch, 1, t, adapter_rank=rank) == 2 * linear + attention
        assert train_flops_per_token(arch, 1, t, adapter_rank=rank) == 3 * (2 * linear + attention)
    k2 = forward_flops_per_token(arch, 2, 16)
    k1 = forward_flops_per_token(arch, 1, 16)
    k3 = forward_flops_per_token(arch, 3, 16)
    assert math.isclose(k3 - k2, k2 - k1) and math.isclose(forward_flops_per_token(arch, 2.5, 16), (k2 + k3) / 2)


def test_eq5_multiplier_is_one_for_k1_and_matches_the_4b_paper_figures():
    arch, sampler = yaml_arch("4b.yaml")
    mean_k = OneLoopOverride(sampler["max_loops"], sampler["override_fraction"]).expected_mean_loops()
    assert compute_multiplier(arch, 0.25, 1.0) == 1.0 == compute_multiplier(arch, 0.0, mean_k)
    assert round(compute_multiplier(arch, 0.25, mean_k), 2) == 1.16
    assert abs(compute_multiplier(arch, 1.0, mean_k) - 1.62) < 0.03
    assert flops_multiplier(arch, 0.25, mean_k, 4096) < compute_multiplier(arch, 0.25, mean_k)


def test_eq5_multiplier_matches_the_gpt_0_5b_paper_figures():
    arch, sampler = yaml_arch("gpt_0.5b.yaml")
    mean_k = OneLoopOverride(sampler["max_loops"], sampler["override_fraction"]).expected_mean_loops()
    assert round(compute_multiplier(arch, 0.25, mean_k), 2) == 1.20
    assert round(compute_multiplier(arch, 1.0, mean_k), 2) == 1.79


def test_compute_accounting_counts_every_shard_of_the_run(tmp_path):
    module = make_module()
    accounting = ComputeAccounting()
    switch, steps = 2, 6
    callbacks = [DelayedMixedDepth(switch_step=switch), ZeroInitConditioning(), accounting]
    trainer = make_trainer(callbacks, max_steps=steps)
    trainer.fit(module, make_data(tmp_path))

    arch, tokens = module.arch, 2 * 16
    flops = base = 0.0
    for step in range(steps):
        rank = 2 if step >= switch else 0
        for k in module.step_schedule(step):
            flops += tokens * train_flops_per_token(arch, k, 16, adapter_rank=rank)
            base += tokens * train_flops_per_token(arch, 1, 16)
    assert math.isclose(accounting.flops, flops, rel_tol=1e-12)
    assert math.isclose(accounting.multiplier, flops / base, rel_tol=1e-12)
    assert math.isclose(float(trainer.callback_metrics["train/compute_multiplier"]), flops / base, rel_tol=1e-6)
    prediction = accounting.predicted(trainer, module)
    assert prediction["rho"] == (steps - switch) / steps
    # By hand: eq. 3 mean k = f + (1 - f)(K + 1) / 2 = 0.5 + 0.5 * 2 = 1.5 for K = 3, f = 0.5; layers
    # 1 / 1 / 1 give D_eff(1) = 3 and D_eff(1.5) = 3.5; eq. 5 = (1 - 2/3) + 2/3 * 3.5 / 3 = 10 / 9.
    assert prediction["mean_loops"] == pytest.approx(1.5)
    assert prediction["eq5"] == pytest.approx(10 / 9)
    resumed = ComputeAccounting()
    resumed.load_state_dict(copy.deepcopy(accounting.state_dict()))
    assert resumed.multiplier == accounting.multiplier


def test_yaml_fragment_adds_the_callbacks_to_a_config(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["elr"])
    fragment = str(ROOT / "callbacks/delayed_mixed_depth.yaml")
    with pytest.raises(SystemExit):
        run(["fit", "--config", str(ROOT / "config/quickstart.yaml"), "--config", fragment, "--print_config"])
    callbacks = yaml.safe_load(capsys.readouterr().out)["trainer"]["callbacks"]
    names = [cb["class_path"].rsplit(".", 1)[-1] for cb in callbacks]
    assert names[-3:] == ["DelayedMixedDepth", "ZeroInitConditioning", "ComputeAccounting"]
    assert "ModelCheckpoint" in names[0]
    assert callbacks[-3]["init_args"]["switch_fraction"] == 0.75
