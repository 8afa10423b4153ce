"""ELRModule: within-step mixing, loss, optimizer groups, logging, and clear errors."""

from __future__ import annotations

import glob
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import tiny_config
from elr_lightning.callbacks import LoopCountPlots
from elr_lightning.conditioning import LoopConditioner
from elr_lightning.data import TextDataModule
from elr_lightning.module import ELRModule
from elr_lightning.optim import param_groups
from elr_lightning.sampling import FixedLoops, OneLoopOverride


def _grads(module: ELRModule) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@given(seed=st.integers(0, 2**16), k0=st.integers(1, 4), k1=st.integers(1, 4))
def test_virtual_ranks_gradient_equals_averaged_half_batches(seed, k0, k1):
    torch.manual_seed(seed)
    module = ELRModule(arch=tiny_config(), conditioner=LoopConditioner(d_cond=8, rank=2), virtual_ranks=2)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    batch = torch.randint(0, 64, (4, 17))
    module.shard_loss(batch, [k0, k1]).backward()
    mixed = _grads(module)
    module.zero_grad()
    halves = [F_loss(module, batch[:2], k0), F_loss(module, batch[2:], k1)]
    (0.5 * (halves[0] + halves[1])).backward()
    separate = _grads(module)
    assert mixed.keys() == separate.keys() and len(mixed) > 0
    for name in mixed:
        torch.testing.assert_close(mixed[name], separate[name], rtol=1e-5, atol=1e-7, msg=name)


def F_loss(module: ELRModule, batch: torch.Tensor, k: int) -> torch.Tensor:
    logits = module(batch[:, :-1], k)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def test_param_groups_cover_every_parameter_once():
    module = ELRModule(arch=tiny_config(), conditioner=LoopConditioner(d_cond=8, rank=2))
    groups = {g["name"]: g for g in param_groups(module.model, 0.1)}
    assert set(groups) == {"decay", "no_decay", "gate", "conditioning"}
    assert groups["decay"]["weight_decay"] == 0.1
    assert all(groups[n]["weight_decay"] == 0.0 for n in ("no_decay", "gate", "conditioning"))
    assert all(p.ndim == 2 for p in groups["decay"]["params"])
    assert all(p.ndim == 1 for p in groups["no_decay"]["params"])
    gate = module.model.update
    assert {id(p) for p in groups["gate"]["params"]} == {id(gate.gate.weight), id(gate.gate.bias), id(gate.gamma)}
    total = sum(len(g["params"]) for g in groups.values())
    assert total == len(list(module.model.parameters()))


def test_tied_head_lands_once_and_frozen_parameters_are_left_out():
    module = ELRModule(arch=tiny_config())
    assert module.model.head.weight is module.model.embed.weight
    module.model.norm.weight.requires_grad_(False)
    groups = param_groups(module.model, 0.0)
    placed = [id(p) for g in groups for p in g["params"]]
    assert len(placed) == len(set(placed)) == len(list(module.model.parameters())) - 1
    assert id(module.model.norm.weight) not in placed


def _tiny_data(tmp_path, **kw) -> TextDataModule:
    args = dict(seq_len=32, batch_size=4, max_bytes=60_000, cache_dir=str(tmp_path / "cache"), val_batches=2)
    args.update(kw)
    return TextDataModule(**args)


def _trainer(tmp_path, steps: int = 4, **kw) -> Trainer:
    args = dict(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=TensorBoardLogger(str(tmp_path), name="tb"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        val_check_interval=steps,
        num_sanity_val_steps=0,
    )
    args.update(kw)
    return Trainer(**args)


def test_fit_logs_every_promised_tag(tmp_path):
    module = ELRModule(
        arch=tiny_config(vocab_size=256), sampler=OneLoopOverride(4, 0.15), virtual_ranks=2,
        conditioner=LoopConditioner(d_cond=8, rank=2), warmup_steps=1,
    )
    trainer = _trainer(tmp_path, callbacks=[LoopCountPlots()])
    trainer.fit(module, datamodule=_tiny_data(tmp_path))
    metrics = trainer.callback_metrics
    for tag in ("train/loss", "train/loops_mean", "train/beta_mean", "train/p1"):
        assert tag in metrics
    for k in range(1, 5):
        assert math.isfinite(metrics[f"val/loss_k{k}"]) and math.isfinite(metrics[f"val/bpb_k{k}"])
        # byte tokenizer: one byte per token, so bpb = loss / ln 2
        assert metrics[f"val/bpb_k{k}"].item() == pytest.approx(metrics[f"val/loss_k{k}"].item() / math.log(2), rel=1e-5)
    events = EventAccumulator(glob.glob(str(tmp_path / "tb" / "version_0" / "events*"))[0])
    events.Reload()
    assert "train/loops" in events.Tags()["histograms"]
    assert "val/loss_vs_loops" in events.Tags()["images"]
    assert "val/loss_k4" in events.Tags()["scalars"]


def test_beta_mean_is_the_mean_over_the_steps_shards(tmp_path):
    """``train/beta_mean`` averages every shard's forward of the step (equal shards), not the last one's."""
    module = ELRModule(arch=tiny_config(vocab_size=256), sampler=OneLoopOverride(4, 0.5), virtual_ranks=2)
    torch.manual_seed(0)
    with torch.no_grad():
        module.model.update.gate.weight.normal_(0.0, 0.5)
    per_forward: list[torch.Tensor] = []

    def record(model, args, out):
        if model.training:
            per_forward.append(model.update.metrics()["beta_mean"].clone())

    module.model.register_forward_hook(record)
    trainer = _trainer(tmp_path, steps=1, limit_val_batches=0)
    trainer.fit(module, datamodule=_tiny_data(tmp_path))
    assert len(per_forward) == 2 and not torch.isclose(per_forward[0], per_forward[1])
    torch.testing.assert_close(trainer.callback_metrics["train/beta_mean"], (per_forward[0] + per_forward[1]) / 2)


def test_nan_loss_is_a_clear_error(tmp_path):
    module = ELRModule(arch=tiny_config(vocab_size=256), sampler=FixedLoops(1))
    with torch.no_grad():
        module.model.embed.weight.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="train/loss is nan"):
        _trainer(tmp_path).fit(module, datamodule=_tiny_data(tmp_path))


def test_tokenizer_larger_than_model_vocab_is_refused(tmp_path):
    module = ELRModule(arch=tiny_config(vocab_size=64))
    with pytest.raises(ValueError, match=r"arch\.vocab_size=64"):
        _trainer(tmp_path).fit(module, datamodule=_tiny_data(tmp_path))


def test_seq_len_above_rope_table_is_refused(tmp_path):
    module = ELRModule(arch=tiny_config(vocab_size=256, max_seq_len=16))
    with pytest.raises(ValueError, match=r"data\.seq_len=32 exceeds arch\.max_seq_len=16"):
        _trainer(tmp_path).fit(module, datamodule=_tiny_data(tmp_path))


def test_batch_smaller_than_virtual_ranks_is_refused():
    module = ELRModule(arch=tiny_config(), virtual_ranks=4)
    with pytest.raises(ValueError, match="virtual_ranks=4"):
        module.shard_loss(torch.zeros(2, 9, dtype=torch.long), [1, 1, 1, 1])


def test_virtual_ranks_above_the_batch_are_refused_at_setup_before_sanity_validation(tmp_path):
    started = []

    class Spy(Callback):
        def on_sanity_check_start(self, trainer, pl_module):
            started.append("sanity")

    module = ELRModule(arch=tiny_config(vocab_size=256), virtual_ranks=8)
    trainer = _trainer(tmp_path, num_sanity_val_steps=1, callbacks=[Spy()])
    with pytest.raises(ValueError, match=r"virtual_ranks=8 is larger than data\.batch_size=4"):
        trainer.fit(module, datamodule=_tiny_data(tmp_path))
    assert started == []


def test_training_lowers_validation_loss(tmp_path):
    torch.manual_seed(0)
    module = ELRModule(arch=tiny_config(vocab_size=256), sampler=OneLoopOverride(2, 0.5), virtual_ranks=2,
                       warmup_steps=2, val_loops=[1, 2])
    data = _tiny_data(tmp_path)
    trainer = _trainer(tmp_path, steps=30, logger=False)
    trainer.validate(module, datamodule=data, verbose=False)
    before = trainer.callback_metrics["val/loss_k1"].item()
    trainer.fit(module, datamodule=data)
    assert trainer.callback_metrics["val/loss_k1"].item() < before - 0.5


def test_test_and_predict_report_every_k(tmp_path):
    module = ELRModule(arch=tiny_config(vocab_size=256), val_loops=[1, 3])
    data = _tiny_data(tmp_path)
    trainer = _trainer(tmp_path, logger=False)
    results = trainer.test(module, datamodule=data, verbose=False)[0]
    assert set(results) == {"test/loss_k1", "test/loss_k3", "test/bpb_k1", "test/bpb_k3"}
    validated = trainer.validate(module, datamodule=data, verbose=False)[0]
    assert results["test/loss_k3"] == pytest.approx(validated["val/loss_k3"])
    predictions = trainer.predict(module, datamodule=data)
    assert set(predictions[0]) == {1, 3} and predictions[0][1].shape == (4,)
    mean = torch.cat([p[3] for p in predictions]).mean().item()
    assert mean == pytest.approx(validated["val/loss_k3"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("pattern", [["attention"], ["gdp"]], ids=["dense", "hybrid"])
def test_compiled_layers_match_eager(tmp_path, pattern):
    """``compile_layers`` compiles each layer once; one graph serves every k and matches eager."""
    torch.manual_seed(0)
    arch = tiny_config(vocab_size=256, token_pattern={"rec": pattern})
    eager = ELRModule(arch=arch, conditioner=LoopConditioner(d_cond=8, rank=2))
    compiled = ELRModule(arch=arch, conditioner=LoopConditioner(d_cond=8, rank=2), compile_layers=True)
    compiled.load_state_dict(eager.state_dict())
    compiled.configure_model()
    batch = torch.randint(0, 256, (2, 17))
    for k in (1, 3):
        torch.testing.assert_close(compiled.shard_loss(batch, [k]), eager.shard_loss(batch, [k]), rtol=1e-4, atol=1e-5)
    loss = compiled.shard_loss(batch, [2])
    loss.backward()
    assert all(p.grad is not None for p in compiled.model.core.layers.parameters())


def test_bf16_mixed_precision_trains(tmp_path):
    module = ELRModule(arch=tiny_config(vocab_size=256), conditioner=LoopConditioner(d_cond=8, rank=2),
                       virtual_ranks=2, warmup_steps=1)
    trainer = _trainer(tmp_path, steps=3, precision="bf16-mixed", logger=False)
    trainer.fit(module, datamodule=_tiny_data(tmp_path))
    assert all(math.isfinite(trainer.callback_metrics[f"val/loss_k{k}"]) for k in range(1, 5))
    assert all(p.dtype == torch.float32 for p in module.parameters())


def test_roles_survive_replaced_parameter_objects():
    """Sharding wrappers replace parameter objects and drop their tags; groups are kept by name."""
    model = ELRModule(arch=tiny_config(), conditioner=LoopConditioner(d_cond=8, rank=2)).model
    gate = model.update.gate
    gate.weight = torch.nn.Parameter(gate.weight.detach().clone())
    film = model.core.layers[0].attn_mod.film
    film.weight = torch.nn.Parameter(film.weight.detach().clone())
    groups = {g["name"]: g for g in param_groups(model, 0.1)}
    assert any(p is gate.weight for p in groups["gate"]["params"])
    assert any(p is film.weight for p in groups["conditioning"]["params"])
    assert any(p is film.weight for p in model.parameters_with_role("conditioning", init="zeros"))


def test_conditioner_keeps_its_roles_through_the_plugin_copy():
    """ELRModule copies its plug-ins; Parameter.__deepcopy__ drops attributes, the roles must not go."""
    conditioner = LoopConditioner(d_cond=8, rank=2)
    module = ELRModule(arch=tiny_config(), conditioner=conditioner)
    assert module.model.conditioner is not conditioner
    groups = {g["name"]: {id(p) for p in g["params"]} for g in param_groups(module.model, 0.1)}
    mlp = list(module.model.conditioner.mlp.parameters())
    assert mlp and all(id(p) in groups["conditioning"] for p in mlp)
    assert all(module.model.roles[n][1] == "conditioning" for n, _ in module.model.named_parameters() if "mlp.0" in n)


def test_a_parameter_added_after_the_model_was_built_is_named_not_asserted():
    module = ELRModule(arch=tiny_config())
    module.model.update.late = torch.nn.Parameter(torch.zeros(3))  # a plug-in that builds outside build()
    with pytest.raises(ValueError, match=r"parameter '(core\.)?update\.late' has no recorded role.*set_role"):
        param_groups(module.model, 0.1)


def test_lr_scale_multiplies_the_named_groups_and_the_schedule_keeps_the_ratio(tmp_path):
    module = ELRModule(arch=tiny_config(), lr=1e-3, warmup_steps=2, lr_scale={"gate": 10.0, "conditioning": 0.5},
                       conditioner=LoopConditioner(d_cond=8, rank=2))
    trainer = Trainer(max_steps=10, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         default_root_dir=tmp_path)
    module.trainer = trainer
    config = module.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    peak = {g["name"]: g["initial_lr"] for g in optimizer.param_groups}
    assert peak == pytest.approx({"decay": 1e-3, "no_decay": 1e-3, "gate": 1e-2, "conditioning": 5e-4})
    for _ in range(2):
        optimizer.step()
        scheduler.step()
    now = {g["name"]: g["lr"] for g in optimizer.param_groups}
    assert now["gate"] / now["decay"] == pytest.approx(10.0) and now["conditioning"] / now["decay"] == pytest.approx(0.5)


@pytest.mark.parametrize("scale", [{"gates": 2.0}, {"gate": 0.0}, {"gate": float("nan")}])
def test_lr_scale_rejects_unknown_groups_and_non_positive_values(scale):
    with pytest.raises(ValueError, match="model.init_args.lr_scale"):
        ELRModule(arch=tiny_config(), lr_scale=scale)
