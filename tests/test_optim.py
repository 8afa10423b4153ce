"""The AdamW builder: torch's fused kernel where the parameters allow it, the same steps as the per-tensor loop."""

from __future__ import annotations

import torch

from conftest import tiny_config
from elr_lightning.conditioning import LoopConditioner
from elr_lightning.model import LoopedLM
from elr_lightning.optim import adamw, param_groups


def _model(seed: int = 0) -> LoopedLM:
    torch.manual_seed(seed)
    return LoopedLM(tiny_config(max_seq_len=16), conditioner=LoopConditioner(d_cond=8, rank=4))


def _steps(model: LoopedLM, optimizer: torch.optim.Optimizer, n: int) -> None:
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    for _ in range(n):
        logits = model(ids[:, :-1], 2)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_cpu_parameters_get_the_fused_update_and_it_steps_as_the_loop_does() -> None:
    fused_model, loop_model = _model(), _model()
    fused = adamw(param_groups(fused_model, 0.1, 1e-3), lr=1e-3, betas=(0.9, 0.95))
    loop = torch.optim.AdamW(param_groups(loop_model, 0.1, 1e-3), lr=1e-3, betas=(0.9, 0.95), foreach=False)
    assert all(group["fused"] for group in fused.param_groups)
    _steps(fused_model, fused, 3)
    _steps(loop_model, loop, 3)
    for (name, got), want in zip(fused_model.named_parameters(), loop_model.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)


def test_an_explicit_choice_wins_and_unsupported_parameters_keep_torchs_default() -> None:
    model = _model()
    assert not adamw(param_groups(model, 0.1), lr=1e-3, foreach=False).defaults["fused"]
    integer = torch.nn.Parameter(torch.zeros(3, dtype=torch.long), requires_grad=False)
    assert not adamw([{"params": [integer]}], lr=1e-3).defaults["fused"]  # no fused kernel for integers


def test_loading_a_state_saved_by_the_loop_keeps_the_fused_update() -> None:
    """A resume from a checkpoint written before (per-tensor loop) continues with the fused kernel, same state."""
    model = _model()
    loop = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3, foreach=False)
    _steps(model, loop, 2)
    state = loop.state_dict()
    assert state["param_groups"][0]["fused"] is None
    resumed = adamw(param_groups(model, 0.1), lr=1e-3)
    resumed.load_state_dict(state)
    assert all(group["fused"] for group in resumed.param_groups)
    first = next(iter(model.parameters()))
    torch.testing.assert_close(resumed.state[first]["exp_avg"], loop.state[first]["exp_avg"])
    _steps(model, resumed, 1)
    assert float(resumed.state[first]["step"]) == 3.0


def test_bf16_mixed_clips_the_fused_adamws_gradients(tmp_path) -> None:
    """Lightning's mixed precision refuses to clip a fused optimizer's gradients, which under bf16-mixed (no grad
    scaler) stopped every run with gradient_clip_val at its first step; they are clipped to the norm asked."""
    import pytest
    from lightning.pytorch import Callback, Trainer

    from elr_lightning.module import ELRModule

    norms: list[float] = []

    class GradNorm(Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            def record(optimizer, args, kwargs) -> None:
                grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
                norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))

            trainer.optimizers[0].register_step_post_hook(record)  # the closure (backward, clipping) runs inside step

    module = ELRModule(arch=tiny_config(), lr=1e-3, warmup_steps=0)
    batches = torch.utils.data.DataLoader(torch.randint(0, 64, (8, 17)), batch_size=4)
    trainer = Trainer(
        accelerator="cpu", devices=1, precision="bf16-mixed", gradient_clip_val=1e-3, max_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        default_root_dir=tmp_path, callbacks=[GradNorm()],
    )
    trainer.fit(module, batches)
    assert trainer.optimizers[0].defaults["fused"] is True
    assert len(norms) == 2 and all(norm == pytest.approx(1e-3, rel=1e-3) for norm in norms), norms
