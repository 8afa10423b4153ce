"""The mixture-of-experts channel mixer: dispatch against a dense reference, route replay, balancing,
accounting, configs and bad input."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from conftest import GQA_CONFIG, REPO_ROOT, perturbed_model, quiet_trainer, tiny_config
from elr_lightning.config import ModelConfig
from elr_lightning.context import LoopContext
from elr_lightning.estimate.cost import cost_report
from elr_lightning.flops import train_flops_per_token
from elr_lightning.inference.generate import generate
from elr_lightning.inference.fold import fold_conditioning, serving_model
from elr_lightning.mixers import MoE
from elr_lightning.mixers.dispatch import combine, expert_swiglu, grouped_mm_supported, plan_dispatch
from elr_lightning.model import LoopedLM
from elr_lightning.module import ELRModule
from elr_lightning.strategies.common import loop_dependent_parameters, unused_parameters

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIGS = REPO_ROOT / "config"


def moe_config(base: ModelConfig | None = None, **init_args) -> ModelConfig:
    """``base`` (the tiny config) with every channel mixer an MoE of ``init_args``."""
    args = {"num_experts": 4, "top_k": 2, "expert_dim": 16, **init_args}
    return replace(
        base or tiny_config(),
        channel_pattern=["moe"],
        mixers={"moe": {"class_path": "elr_lightning.mixers.MoE", "init_args": args}},
    )


def dense_reference(x, w_up, w_down, experts, weights):
    """Every expert on every token, mixed by a dense one-hot gate matrix: the plain definition."""
    n, e = x.shape[0], w_up.shape[0]
    gates = torch.zeros(n, e, dtype=weights.dtype).scatter_add(1, experts, weights)
    out = torch.zeros_like(x)
    for i in range(e):
        gate, up = (x @ w_up[i]).chunk(2, dim=-1)
        out = out + gates[:, i : i + 1] * ((F.silu(gate) * up) @ w_down[i])
    return out


def context(loop: int = 0, loops: int = 1) -> LoopContext:
    return LoopContext(None, loops, 4, loop=loop)  # a channel mixer never reads positions


@given(
    tokens=st.integers(1, 40),
    experts=st.integers(1, 6),
    top_k=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_grouped_and_loop_dispatch_equal_the_dense_reference(tokens, experts, top_k, seed):
    top_k = min(top_k, experts)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 8, generator=g, dtype=torch.float64).float().requires_grad_()
    w_up = (0.3 * torch.randn(experts, 8, 8, generator=g)).requires_grad_()
    w_down = (0.3 * torch.randn(experts, 4, 8, generator=g)).requires_grad_()
    logits = torch.randn(tokens, experts, generator=g, requires_grad=True)
    chosen = torch.topk(logits, top_k, dim=-1).indices
    plan = plan_dispatch(chosen, experts)
    assert sum(plan.sizes) == tokens * top_k  # dropless
    grad_out = torch.randn(tokens, 8, generator=g)
    results = []
    for path in ("grouped", "loop", "dense"):
        weights = logits.softmax(-1).gather(-1, chosen)
        weights = weights / weights.sum(-1, keepdim=True)
        if path == "dense":
            out = dense_reference(x, w_up, w_down, chosen, weights)
        else:
            out = combine(expert_swiglu(x, w_up, w_down, plan, path == "grouped"), weights, plan, tokens)
        grads = torch.autograd.grad(out, (x, w_up, w_down, logits), grad_out)
        results.append((out, grads))
    assert grouped_mm_supported(x, w_up) and grouped_mm_supported(x[:, :4], w_down)
    for out, grads in results[:2]:
        torch.testing.assert_close(out, results[2][0], rtol=1e-5, atol=1e-5)
        for got, want in zip(grads, results[2][1]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # An expert without tokens still gets a (zero) gradient: every rank reduces every parameter.
    unused = set(range(experts)) - set(chosen.flatten().tolist())
    for e in unused:
        assert torch.count_nonzero(results[0][1][1][e]) == 0


def test_grouped_mm_support_needs_16_byte_rows():
    assert not grouped_mm_supported(torch.zeros(3, 6), torch.zeros(2, 6, 8))
    assert grouped_mm_supported(torch.zeros(3, 8, dtype=torch.bfloat16), torch.zeros(2, 8, 8, dtype=torch.bfloat16))
    assert not grouped_mm_supported(torch.zeros(3, 8), torch.zeros(2, 8, 8, dtype=torch.float64))


def test_auto_dispatch_takes_the_loop_for_float64_and_matches_float32() -> None:
    """``torch._grouped_mm`` computes in fp32/bf16/fp16 only: a float64 model on the CPU must not reach it."""
    assert not grouped_mm_supported(torch.zeros(3, 8, dtype=torch.float64), torch.zeros(2, 8, 8, dtype=torch.float64))
    torch.manual_seed(0)
    model = LoopedLM(moe_config(tiny_config(max_seq_len=16))).eval()
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        single = model(ids, 2)
        double = model.double()(ids, 2)
    assert double.dtype == torch.float64
    torch.testing.assert_close(double.float(), single, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dispatch", ["grouped", "loop"])
def test_moe_layer_equals_the_dense_reference_with_a_shared_expert(dispatch):
    torch.manual_seed(0)
    moe = MoE(tiny_config(), num_experts=5, top_k=2, expert_dim=8, shared_expert_dim=8, dispatch=dispatch)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 7, 32)
    out = moe(x, context(), 0)
    flat = x.reshape(-1, 32)
    _, experts, weights = moe.route(moe.router(flat))
    gate, up = moe.shared_up(flat).chunk(2, -1)
    want = dense_reference(flat, moe.w_up, moe.w_down, experts, weights) + moe.shared_down(F.silu(gate) * up)
    torch.testing.assert_close(out.reshape(-1, 32), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weights.sum(-1), torch.ones(14))


@pytest.mark.parametrize("replay", ["dynamic", "replay", "replay_experts"])
@pytest.mark.parametrize("loops", [1, 3])
def test_top_1_router_learns_from_the_lm_loss_alone(replay, loops):
    """Top-1 gates with the router probability (Switch Transformer), not p / p = 1: with the balance loss
    off, the LM loss alone still moves the router of every layer."""
    model = LoopedLM(moe_config(num_experts=4, top_k=1, aux_loss_coef=0.0, replay=replay)).train()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(loops))
    logits = model(ids[:, :-1], loops)
    F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
    grads = {name: p.grad.abs().max().item() for name, p in model.named_parameters()}
    routers = [name.removesuffix("router.weight") for name in grads if name.endswith("router.weight")]
    assert len(routers) == 3
    for layer in routers:  # p / p = 1 leaves only rounding noise, ~1e-8 of the experts' gradient
        assert grads[layer + "router.weight"] > 1e-3 * grads[layer + "w_down"], layer


@pytest.mark.parametrize("top_k, normalize, sums_to_one", [(1, None, False), (2, None, True), (1, True, True),
                                                          (3, False, False)])
def test_gate_weights_are_normalised_above_top_1_unless_told(top_k, normalize, sums_to_one):
    """``normalize_weights=None``: raw probability at top_k = 1, normalised top-k above; ``True``/``False`` force it."""
    moe = MoE(tiny_config(), num_experts=4, top_k=top_k, expert_dim=8, normalize_weights=normalize)
    torch.nn.init.normal_(moe.router.weight, std=1.0)
    probs, experts, weights = moe.route(moe.router(torch.randn(9, 32)))
    chosen = probs.gather(-1, experts)
    want = chosen / chosen.sum(-1, keepdim=True) if sums_to_one else chosen
    torch.testing.assert_close(weights, want)
    assert torch.allclose(weights.sum(-1), torch.ones(9)) == sums_to_one


# ---- route replay -------------------------------------------------------------------------------


def _two_loops(moe: MoE, x1: torch.Tensor, x2: torch.Tensor) -> tuple[torch.Tensor, LoopContext]:
    ctx = context(1, 2)
    moe(x1, ctx, 3)
    return moe(x2, ctx.at(2, None), 3), ctx


@pytest.mark.parametrize(
    "replay, training, replays",
    [("dynamic", True, False), ("dynamic", False, False), ("replay_inference", True, False),
     ("replay_inference", False, True), ("replay", True, True), ("replay", False, True),
     ("replay_experts", True, True), ("replay_experts", False, True)],
)
def test_loop_two_reuses_loop_one_experts_per_mode(replay, training, replays):
    """(C) reuses loop 1's experts and gate weights; ``replay_experts`` recomputes the gates at loop 1's experts."""
    torch.manual_seed(1)
    moe = MoE(tiny_config(), num_experts=6, top_k=2, expert_dim=8, replay=replay).train(training)
    torch.nn.init.normal_(moe.router.weight, std=1.0)
    for p in (moe.w_up, moe.w_down):
        torch.nn.init.normal_(p, std=0.3)
    x1, x2 = torch.randn(1, 12, 32), torch.randn(1, 12, 32)
    out, ctx = _two_loops(moe, x1, x2)
    _, first, first_weights = moe.route(moe.router(x1[0]))
    probs, own, own_weights = moe.route(moe.router(x2[0]))
    assert not torch.equal(first.sort(-1).values, own.sort(-1).values), "the inputs must route differently"
    if not replays:
        experts, weights = own, own_weights
    elif replay == "replay_experts":
        experts, weights = first, probs.gather(-1, first) / probs.gather(-1, first).sum(-1, keepdim=True)
    else:
        experts, weights = first, first_weights
    want = dense_reference(x2[0], moe.w_up, moe.w_down, experts, weights)
    torch.testing.assert_close(out[0], want, rtol=1e-5, atol=1e-6)
    assert ("plan" in ctx.scratch(3, 1)) == (replay != "dynamic")


@pytest.mark.parametrize("replay", ["replay", "replay_experts"])
@pytest.mark.parametrize("rows", [slice(0, 2), slice(1, 3), torch.tensor([3, 0])], ids=["prefix", "slice", "indices"])
def test_a_later_loop_on_some_rows_replays_those_rows_routes(replay, rows):
    """A loop on some rows of loop 1's batch (``ctx.rows``, as a mixed-depth decode step runs it) equals the loop
    on every row, taken at those rows: each token keeps its own loop 1 experts, several tokens per row too."""
    torch.manual_seed(2)
    moe = MoE(tiny_config(), num_experts=6, top_k=2, expert_dim=8, replay=replay).eval()
    for p in (moe.router.weight, moe.w_up, moe.w_down):
        torch.nn.init.normal_(p, std=0.3)
    x1, x2 = torch.randn(4, 3, 32), torch.randn(4, 3, 32)
    every, ctx = _two_loops(moe, x1, x2)
    some = moe(x2[rows], ctx.on_rows(2, rows, ctx.positions, None), 3)
    torch.testing.assert_close(some, every[rows], rtol=1e-5, atol=1e-5)
    moe.replay = "dynamic"
    assert not torch.allclose(_two_loops(moe, x1, x2)[0], every, atol=1e-3), "the inputs must route differently"


def test_paper_replay_runs_the_router_on_loop_one_only():
    """(C): the expert assignments are computed once; loops 2..k never call the router."""
    moe = MoE(tiny_config(), num_experts=6, top_k=2, expert_dim=8, replay="replay")
    calls: list[int] = []
    moe.router.register_forward_hook(lambda *_: calls.append(1))
    ctx = context(1, 4)
    for i in range(1, 5):
        moe(torch.randn(1, 9, 32), ctx.at(i, None), 0)
    assert len(calls) == 1
    moe.replay = "replay_experts"
    calls.clear()
    ctx = context(1, 4)
    for i in range(1, 5):
        moe(torch.randn(1, 9, 32), ctx.at(i, None), 0)
    assert len(calls) == 4


@pytest.mark.parametrize("replay", ["dynamic", "replay"])
def test_model_replay_changes_nothing_at_one_loop_and_something_at_three(replay):
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    models = {mode: perturbed_model(moe_config(GQA_CONFIG, replay=mode), seed=4) for mode in ("dynamic", replay)}
    with torch.no_grad():
        one = {mode: m(ids, 1) for mode, m in models.items()}
        three = {mode: m(ids, 3) for mode, m in models.items()}
    torch.testing.assert_close(one["dynamic"], one[replay], rtol=0, atol=0)
    assert torch.equal(three["dynamic"], three[replay]) == (replay == "dynamic")


@pytest.mark.parametrize("loops", [1, 3])
def test_replay_decode_equals_recompute(loops):
    """At decode, loop 1 routes the new token and loops 2..k replay: as in one forward over everything."""
    model = perturbed_model(moe_config(GQA_CONFIG, replay="replay", shared_expert_dim=8), seed=5)
    prompt = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(loops))
    out = generate(model, prompt, loops=loops, kv_cache="per_loop", max_new_tokens=8, greedy=True, output_logits=True)
    with torch.no_grad():
        full = model(out.sequences[:, :-1], loops)[:, 4:]
    torch.testing.assert_close(out.logits, full, atol=1e-4, rtol=0)


@pytest.mark.parametrize("replay", ["dynamic", "replay_inference", "replay"])
def test_every_parameter_takes_part_at_every_k(replay):
    model = LoopedLM(moe_config(replay=replay, num_experts=8, top_k=1))
    assert loop_dependent_parameters(model, range(1, 5)) == {}
    assert all(names == [] for names in unused_parameters(model, range(1, 5)).values())


@pytest.mark.parametrize("replay", ["dynamic", "replay"])
def test_a_meta_device_moe_runs_the_fsdp_setup_probe(replay):
    """meta_init + FSDP probes the unmaterialised model (config/30b_a3b.yaml): routing has no values there."""
    with torch.device("meta"):
        model = LoopedLM(moe_config(replay=replay, num_experts=3, top_k=2))
    assert loop_dependent_parameters(model, range(1, 4)) == {}
    plan = plan_dispatch(torch.empty(5, 2, dtype=torch.long, device="meta"), 3)
    assert plan.sizes == [4, 3, 3] and plan.counts.is_meta and plan.offsets.is_meta


# ---- balancing -----------------------------------------------------------------------------------


def test_aux_loss_is_the_switch_loss_averaged_over_routing_loops():
    torch.manual_seed(3)
    moe = MoE(tiny_config(), num_experts=4, top_k=2, expert_dim=8, aux_loss_coef=0.5)
    for p in (moe.w_up, moe.w_down):
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(1, 10, 32)
    for loops, replay in ((1, "dynamic"), (3, "dynamic"), (3, "replay")):
        moe.replay = replay
        ctx = context(1, loops)
        for i in range(1, loops + 1):
            moe(x, ctx.at(i, None), 0)
        probs, experts, _ = moe.route(moe.router(x[0]))
        f = torch.bincount(experts.flatten(), minlength=4).float() / 20
        want = 0.5 * 4 * (f * probs.mean(0)).sum()
        torch.testing.assert_close(ctx.aux_losses["moe_aux_loss"], want)
    moe.eval()
    ctx = context(1, 1)
    moe(x, ctx, 0)
    assert ctx.aux_losses == {}, "no balance loss outside training"


def test_module_adds_the_aux_loss_weighted_by_shard():
    module = ELRModule(arch=moe_config(aux_loss_coef=0.1), virtual_ranks=2)
    batch = torch.randint(0, 64, (3, 9), generator=torch.Generator().manual_seed(0))
    aux: dict[str, torch.Tensor] = {}
    module.shard_loss(batch, [1, 2], aux)
    parts = []
    for shard, k in zip(batch.tensor_split(2), [1, 2]):
        own: dict[str, torch.Tensor] = {}
        module.model(shard[:, :-1], k, aux_losses=own)
        parts.append(own["moe_aux_loss"] * shard.shape[0] / 3)
    torch.testing.assert_close(aux["moe_aux_loss"], sum(parts))
    assert 0.1 * 3 * 0.9 < aux["moe_aux_loss"].item() < 0.1 * 3 * 2  # three MoE layers, near balance


def test_bias_balancing_moves_towards_underloaded_experts_and_steers_the_choice_only():
    moe = MoE(tiny_config(), num_experts=4, top_k=1, expert_dim=8, balance_rate=0.25)
    moe._load = torch.tensor([10.0, 0.0, 5.0, 1.0])
    load = moe.end_step(lambda t: 2 * t)  # as if a second rank had the same load
    assert load.tolist() == [20.0, 0.0, 10.0, 2.0]
    assert moe.expert_bias.tolist() == [-0.25, 0.25, -0.25, 0.25]
    logits = torch.tensor([[2.0, 1.9, 0.0, 0.0]])
    probs, experts, weights = moe.route(logits)
    assert experts.tolist() == [[1]] and weights.tolist() == [[probs[0, 1].item()]]  # the bias is not in the gate
    assert not moe.expert_bias.requires_grad and moe.end_step(lambda t: t).tolist() == [0.0] * 4
    moe.reset_buffers()
    assert moe.expert_bias.tolist() == [0.0] * 4


@pytest.mark.filterwarnings("ignore:You defined a `validation_step`")
def test_fit_logs_aux_loss_and_expert_load(tmp_path):
    from lightning.pytorch import Trainer
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from elr_lightning.callbacks import LoopCountPlots

    module = ELRModule(arch=moe_config(balance_rate=0.01), virtual_ranks=1, warmup_steps=0)
    data = [torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    trainer = quiet_trainer(
        max_steps=3, log_every_n_steps=1, logger=TensorBoardLogger(tmp_path, name="moe"), limit_val_batches=0,
        callbacks=[LoopCountPlots()],
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    events = EventAccumulator(str(tmp_path / "moe" / "version_0"))
    events.Reload()
    aux = [e.value for e in events.Scalars("train/moe_aux_loss")]
    assert len(aux) == 3 and all(0 < v < 1 for v in aux)
    assert {f"train/moe_load/layer{j}" for j in range(3)} <= set(events.Tags()["histograms"])
    assert all(math.isfinite(e.value) for e in events.Scalars("train/moe_load_cv/layer1"))
    assert torch.count_nonzero(module.model.core.layers[0].mlp.expert_bias) > 0


# ---- accounting and configs ------------------------------------------------------------------------


def test_active_parameters_and_flops_count_top_k_experts():
    config = moe_config(num_experts=8, top_k=2, expert_dim=16, shared_expert_dim=8)
    moe = MoE(config, num_experts=8, top_k=2, expert_dim=16, shared_expert_dim=8)
    d = 32
    assert moe.active_parameters() == d * 8 + 2 * 3 * d * 16 + 3 * d * 8
    assert moe.flops_per_token(10.0) == 2 * (d * 8 + 2 * 3 * d * 16 + 3 * d * 8)
    dense = replace(config, channel_pattern=["swiglu"], d_ff=2 * 16 + 8)
    # the router is the only difference in active FLOPs from a SwiGLU of the active width
    diff = train_flops_per_token(config, 3, 16) - train_flops_per_token(dense, 3, 16)
    assert diff == pytest.approx(3 * (1 + 3 + 1) * 2 * d * 8)


def test_cost_json_reports_total_and_active(capsys):
    from elr_lightning.cli import main

    main(["cost", "--config", str(CONFIGS / "quickstart_moe.yaml"), "--json"])
    params = json.loads(capsys.readouterr().out)["parameters"]
    experts = 4 * 8 * 3 * 128 * 192  # 4 layers, 8 experts, 3 matrices of 128 x 192
    assert params["total"] - params["active"] == experts * 6 // 8


def test_30b_a3b_is_30b_total_3b_active_on_meta():
    report = cost_report(str(CONFIGS / "30b_a3b.yaml"), loops=[1, 4])
    total, active = report["parameters"]["total"], report["parameters"]["active"]
    assert abs(total / 30e9 - 1) < 0.05 and abs(active / 3e9 - 1) < 0.05
    assert report["forward_gflops_per_token"][4] > report["forward_gflops_per_token"][1]


# ---- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "init_args, message",
    [
        ({"num_experts": 2, "top_k": 3}, r"top_k=3 must be in 1..num_experts=2; lower top_k or add experts"),
        ({"num_experts": 0, "top_k": 1}, r"num_experts=0 must be an integer >= 1"),
        ({"aux_loss_coef": -0.1}, r"aux_loss_coef=-0.1 must be >= 0"),
        ({"replay": "sometimes"}, r"replay='sometimes' is not a route replay mode; use one of"),
        ({"balance_rate": -1.0}, r"balance_rate=-1.0 must be >= 0"),
    ],
)
def test_bad_moe_arguments_name_the_field(init_args, message):
    with pytest.raises(ValueError, match=r"arch\.mixers\.moe\.init_args=.*" + message) as info:
        LoopedLM(moe_config(**init_args))
    assert "\n" not in str(info.value)


def test_route_replay_is_refused_without_moe_or_with_an_unknown_mode():
    with pytest.raises(ValueError, match=r"arch.route_replay='replay' needs a routed channel mixer.*put moe in"):
        tiny_config(route_replay="replay")
    with pytest.raises(ValueError, match=r"arch.route_replay='always' is not a route replay mode"):
        replace(moe_config(), route_replay="always")
    model = LoopedLM(replace(moe_config(), route_replay="replay_inference"))
    assert model.core.layers[0].mlp.replay == "replay_inference"


@pytest.mark.parametrize("checkpointing", ["loop", "layer"])
def test_recomputed_loops_count_their_expert_load_once(checkpointing: str) -> None:
    """Activation checkpointing runs a loop's forward again in the backward: its routes are not counted again."""
    loads = {}
    for setting in ("none", checkpointing):
        model = perturbed_model(moe_config(GQA_CONFIG, replay="dynamic"), seed=6).train()
        model.set_backprop(setting)
        ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
        model(ids, 3).float().pow(2).mean().backward()
        loads[setting] = [layer.mlp.end_step(lambda t: t) for layer in [*model.input_layers, *model.core.layers, *model.output_layers]]
    for plain, recomputed in zip(loads["none"], loads[checkpointing]):
        assert plain.sum() > 0
        torch.testing.assert_close(recomputed, plain)


# ---- replay under truncated backpropagation --------------------------------------------------------


def _recurrent_router_grads(replay: str, source: str, checkpointing: str = "none") -> list[float]:
    """Gradient norms that reach the recurrent block's routers at k = 3 with ``backprop_loops=1``, from ``source``."""
    model = perturbed_model(moe_config(GQA_CONFIG, replay=replay, aux_loss_coef=0.1), seed=4)
    model.train().set_backprop(checkpointing, backprop_loops=1)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    aux: dict[str, torch.Tensor] = {}
    logits = model(ids[:, :-1], 3, aux_losses=aux)
    loss = aux["moe_aux_loss"] if source == "aux" else F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return [0.0 if layer.mlp.router.weight.grad is None else layer.mlp.router.weight.grad.norm().item() for layer in model.core.layers]


@pytest.mark.parametrize("replay", ["replay", "replay_experts"])
@pytest.mark.parametrize("source", ["aux", "lm"])
def test_replay_routes_again_at_the_first_loop_that_carries_gradient(replay: str, source: str) -> None:
    """Loop 1 runs without a graph under truncated backprop; the routers still learn as under dynamic routing."""
    dynamic = _recurrent_router_grads("dynamic", source)
    replayed = _recurrent_router_grads(replay, source)
    assert min(dynamic) > 0
    for own, reference in zip(replayed, dynamic):
        assert own > 0.1 * reference, f"{source} loss: router gradient {own:.2e} against {reference:.2e} under dynamic routing"


@pytest.mark.parametrize("checkpointing", ["loop", "layer"])
def test_recomputing_the_loop_that_routed_again_gives_the_same_gradients(checkpointing: str) -> None:
    """Activation checkpointing recomputes the re-routing loop as it ran (same ops, same gradients)."""
    for source in ("aux", "lm"):
        torch.testing.assert_close(
            _recurrent_router_grads("replay", source, checkpointing), _recurrent_router_grads("replay", source)
        )


# ---- serving at a fixed k --------------------------------------------------------------------------


@pytest.mark.parametrize("loops", [1, 3])
def test_fold_serves_moe_with_constants_and_refuses_weight_copies(loops: int) -> None:
    """``--fold`` (the constants, weights shared) decodes as trained; the weight fold says why it refuses."""
    model = perturbed_model(moe_config(GQA_CONFIG, replay="replay"), seed=1)
    prompt = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(loops))
    kwargs = dict(loops=loops, max_new_tokens=6, greedy=True, output_logits=True)
    folded, plain = generate(model, prompt, fold=True, **kwargs), generate(model, prompt, fold=False, **kwargs)
    assert serving_model(model, loops, fold=True) is not model  # the constant form is what ran
    assert torch.equal(folded.new_tokens, plain.new_tokens)
    torch.testing.assert_close(folded.logits, plain.logits, atol=1e-5, rtol=0)
    with pytest.raises(NotImplementedError, match=r"MoE cannot be folded into copies .* serving_model\(model, k\)"):
        fold_conditioning(model, loops)
@pytest.mark.slow
@pytest.mark.parametrize("token", [["attention"], ["gdp"]], ids=["moe", "hybrid_moe"])
def test_compiled_moe_layers_match_eager_and_count_load_once_under_checkpointing(token: list[str]) -> None:
    """``compile_layers`` with MoE (and a GDP hybrid): loss and gradients equal eager's, and with
    activation checkpointing the recomputed loops still count their expert load once."""
    torch.manual_seed(0)
    arch = replace(moe_config(tiny_config(vocab_size=256, token_pattern={"rec": token})), route_replay="replay")
    modules = {}
    for name, kwargs in (("eager", {}), ("compiled", {"compile_layers": True, "activation_checkpointing": "loop"})):
        modules[name] = ELRModule(arch=arch, conditioner=None, **kwargs)
        if name == "compiled":
            modules[name].load_state_dict(modules["eager"].state_dict())
        modules[name].configure_model()
    batch = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    losses, loads, grads = {}, {}, {}
    for name, module in modules.items():
        module.train()
        losses[name] = module.shard_loss(batch, [3])
        losses[name].backward()
        layers = [*module.model.input_layers, *module.model.core.layers, *module.model.output_layers]
        loads[name] = [layer.mlp.end_step(lambda t: t) for layer in layers]
        grads[name] = module.model.core.layers[0].mlp.w_up.grad
    torch.testing.assert_close(losses["compiled"], losses["eager"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grads["compiled"], grads["eager"], rtol=1e-3, atol=1e-5)
    for eager, compiled in zip(loads["eager"], loads["compiled"]):
        assert eager.sum() > 0
        torch.testing.assert_close(compiled, eager)
