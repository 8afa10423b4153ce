"""What training keeps for the backward pass: activation checkpointing per loop or per layer, and
truncated backpropagation through the last n loops (``ELRModule(activation_checkpointing, backprop_loops)``)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import _dist_worker
from conftest import GQA_CONFIG, load_bench, perturbed_model
from elr_lightning.conditioning import LoopConditioner
from elr_lightning.model import LoopedLM
from elr_lightning.module import ELRModule
from test_strategies import CASES, _reference_case, assert_matches_reference, corpus, launch  # noqa: F401,F811 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

HYBRID = replace(
    GQA_CONFIG,
    token_pattern={"in": ["gdp"], "rec": ["gdp", "attention"], "out": ["attention"]},
    mixers={"gdp": {"class_path": "elr_lightning.mixers.GatedDeltaProduct", "init_args": {"chunk_size": 8}}},
)
MEMORY_BENCH = load_bench("memory")
MODELS = {"attention": perturbed_model(GQA_CONFIG).train(), "hybrid": perturbed_model(HYBRID).train()}


def grads(model: LoopedLM, ids: torch.Tensor, loops: int, checkpointing: str = "none", backprop_loops=None):
    """``(loss, {name: grad}, bytes the forward keeps for backward: none of the checkpointed regions')``."""
    model.set_backprop(checkpointing, backprop_loops)
    model.zero_grad(set_to_none=True)
    try:
        logits, kept = MEMORY_BENCH.kept_for_backward(model, lambda: model(ids[:, :-1], loops))
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
    finally:
        model.set_backprop()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, kept["bytes"]


@settings(max_examples=6, deadline=None)
@given(
    name=st.sampled_from(sorted(MODELS)),
    loops=st.integers(1, 4),
    checkpointing=st.sampled_from(["loop", "layer"]),
    seed=st.integers(0, 2**16),
)
def test_checkpointing_gives_identical_gradients(name: str, loops: int, checkpointing: str, seed: int) -> None:
    model = MODELS[name]
    ids = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(seed))
    loss, ref, ref_saved = grads(model, ids, loops)
    ckpt_loss, got, saved = grads(model, ids, loops, checkpointing)
    assert torch.equal(loss, ckpt_loss)
    assert got.keys() == ref.keys() and len(ref) == len(list(model.parameters()))
    for key, g in ref.items():
        torch.testing.assert_close(got[key], g, rtol=1e-6, atol=1e-7, msg=lambda m, k=key: f"{k}: {m}")
    assert saved < ref_saved  # the recomputed activations were not kept


def test_loop_checkpointing_keeps_memory_flat_in_k() -> None:
    model = MODELS["attention"]
    ids = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(0))
    kept = {k: grads(model, ids, k, "loop")[2] for k in (1, 8)}
    full = {k: grads(model, ids, k)[2] for k in (1, 8)}
    assert full[8] > 3 * full[1]
    # Outside the checkpointed loops: the input and output layers, and each loop's tiny context c_i.
    assert kept[8] <= 1.2 * kept[1]
    assert kept[8] < 0.3 * full[8]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_backprop_loops_truncates_the_graph(name: str) -> None:
    model = MODELS[name]
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    loss, full, full_saved = grads(model, ids, 4)
    same_loss, all_loops, _ = grads(model, ids, 4, backprop_loops=4)
    assert torch.equal(loss, same_loss) and all(torch.equal(all_loops[k], g) for k, g in full.items())
    trunc_loss, trunc, trunc_saved = grads(model, ids, 4, backprop_loops=1)
    _, _, one_loop_saved = grads(model, ids, 1)
    assert torch.equal(loss, trunc_loss)  # the forward's values are the same
    assert trunc.keys() == full.keys()  # every parameter still gets a gradient (DDP, FSDP need it)
    assert not torch.allclose(trunc["core.layers.0.mlp.up.weight"], full["core.layers.0.mlp.up.weight"])
    assert trunc_saved < 0.5 * full_saved
    assert trunc_saved <= 1.1 * one_loop_saved  # one loop's graph, as at k = 1
    _, ckpt, _ = grads(model, ids, 4, "loop", backprop_loops=2)
    _, ref, _ = grads(model, ids, 4, backprop_loops=2)
    assert all(torch.equal(ckpt[k], g) for k, g in ref.items())


def test_truncated_loops_build_no_graph_for_their_context() -> None:
    model = MODELS["attention"]
    assert model.conditioner is not None
    recorded: list[bool] = []
    handle = model.conditioner.register_forward_hook(lambda module, args, out: recorded.append(out.requires_grad))
    try:
        grads(model, torch.randint(0, 64, (2, 9)), 3, backprop_loops=1)
    finally:
        handle.remove()
    assert recorded == [False, False, True]  # loops 1 and 2 run under no_grad, context included


def test_bad_settings_name_the_field() -> None:
    with pytest.raises(ValueError, match="activation_checkpointing='loops' must be one of"):
        ELRModule(arch=GQA_CONFIG, activation_checkpointing="loops")
    with pytest.raises(ValueError, match="backprop_loops=0 must be an integer >= 1"):
        ELRModule(arch=GQA_CONFIG, backprop_loops=0)


@pytest.mark.slow
def test_compiled_layers_with_checkpointing_match_eager() -> None:
    torch.manual_seed(0)
    arch = replace(GQA_CONFIG, n_rec=1)
    eager = ELRModule(arch=arch, conditioner=LoopConditioner(d_cond=8, rank=2))
    compiled = ELRModule(
        arch=arch, conditioner=LoopConditioner(d_cond=8, rank=2), compile_layers=True,
        activation_checkpointing="layer", backprop_loops=2,
    )
    compiled.load_state_dict(eager.state_dict())
    compiled.configure_model()
    eager.model.set_backprop("none", 2)
    batch = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    for module in (eager, compiled):
        module.shard_loss(batch, [3]).backward()
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


BACKPROP_CASES = {
    "v1_ckpt_loop": {"virtual_ranks": 1, "activation_checkpointing": "loop"},
    "v2_hybrid_ckpt_layer_bp1": {
        "virtual_ranks": 2, "hybrid": True, "activation_checkpointing": "layer", "backprop_loops": 1
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_with_checkpointing_match_one_process(
    strategy: str, corpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under DDP and FSDP, checkpointed and truncated runs train as one process with virtual ranks does,
    and ``loop`` checkpointing trains exactly as no checkpointing."""
    results = launch(strategy, corpus, tmp_path / strategy, BACKPROP_CASES)
    spec = {**corpus, "steps": 4}
    for name, case in BACKPROP_CASES.items():
        monkeypatch.setitem(CASES, name, case)  # assert_matches_reference looks the case up there
        assert_matches_reference(name, results[name], _dist_worker.train_case(_reference_case(case), spec, devices=1))
    plain = _dist_worker.train_case(_reference_case(CASES["v1"]), spec, devices=1)["state"]
    for key, value in plain.items():
        torch.testing.assert_close(results["v1_ckpt_loop"][0]["state"][key], value, rtol=1e-5, atol=5e-6)
