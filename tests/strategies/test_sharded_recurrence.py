"""The recurrent block sharded layer by layer, ranks at different k, and load balance (issue 40).

A multi-process run is compared with one process that runs the same shards: :class:`SimulatedRanks`
plays rank r in micro-batch r of each step (gradient accumulation over the ranks), so each
micro-batch computes what rank r computes, and the accumulated gradient adds the ranks' in rank
order. Where the run adds them in that order too (two ranks: one addition; four: a rank-ordered
reduction, :class:`~_dist_worker.RankOrderedReduceScatter`) and every unit reduces once per backward
pass (DDP, FSDP2 with the whole recurrent block as one unit), the trained parameters and every loss
are equal bit for bit. A recurrent layer sharded on its own reduce-scatters its gradient at every
loop: the ranks' gradients of loop i are added before the loops', the reference adds the loops'
first, so those runs equal it to fp32 round-off, and bit for bit where nothing was reduced yet (the
first step's losses).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import _dist_worker
from conftest import tiny_config
from elr_lightning.module import ELRModule
from elr_lightning.sampling import OneLoopOverride
from elr_lightning.step_logging import rank_utilisation
from elr_lightning.strategies import OneLoopOverrideFSDPStrategy
from test_strategies import corpus, launch  # noqa: F401 - corpus is a fixture

#: Cases of both world sizes: ``strategy``, ``recurrent_units``, the model and whether the parameters must be bitwise equal.
CASES = {
    2: {
        "ddp_attention": {"strategy": "ddp", "virtual_ranks": 1, "bitwise": True},
        "ddp_hybrid": {"strategy": "ddp", "virtual_ranks": 2, "hybrid": True, "bitwise": True},
        "fsdp_core_moe": {"strategy": "fsdp", "recurrent_units": "core", "virtual_ranks": 2, "moe": True, "bitwise": True},
        "fsdp_layer_attention": {"strategy": "fsdp", "recurrent_units": "layer", "virtual_ranks": 1},
        "fsdp_layer_hybrid": {"strategy": "fsdp", "recurrent_units": "layer", "virtual_ranks": 2, "hybrid": True},
        "fsdp_layer_moe": {"strategy": "fsdp", "recurrent_units": "layer", "virtual_ranks": 2, "moe": True},
        "fsdp_layer_micro_batches": {
            "strategy": "fsdp", "recurrent_units": "layer", "virtual_ranks": 2, "depth_layout": "micro_batches",
        },
    },
    4: {
        "ddp_moe": {"strategy": "ddp", "virtual_ranks": 2, "moe": True, "rank_ordered": True, "bitwise": True},
        "fsdp_core_attention": {
            "strategy": "fsdp", "recurrent_units": "core", "virtual_ranks": 1, "rank_ordered": True, "bitwise": True,
        },
        "fsdp_layer_hybrid": {
            "strategy": "fsdp", "recurrent_units": "layer", "virtual_ranks": 1, "hybrid": True, "rank_ordered": True,
        },
        "fsdp_layer_moe": {
            "strategy": "fsdp", "recurrent_units": "layer", "virtual_ranks": 2, "moe": True, "rank_ordered": True,
        },
        "fsdp_layer_micro_batches": {
            "strategy": "fsdp", "recurrent_units": "layer", "virtual_ranks": 2, "depth_layout": "micro_batches",
            "rank_ordered": True,
        },
    },
}
STEPS = 3
PER_RANK_BATCH = 2
#: Largest deviation measured where loops' gradients are reduce-scattered one loop at a time (3 steps):
#: 1.5e-7 on two ranks, 2.1e-7 on four; the parameters are of order 0.01 to 1.
ROUND_OFF = 1e-6


def _reference(case: dict[str, Any], world: int, corpus: dict[str, str]) -> dict[str, Any]:
    spec = {**corpus, "steps": STEPS}
    reference = {**case, "strategy": None, "rank_ordered": False, "simulated_ranks": world, "batch_size": PER_RANK_BATCH}
    return _dist_worker.train_case(reference, spec, devices=1)


def _depth(loops: int) -> int:
    return tiny_config().effective_depth(loops)


def assert_equals_one_process(name: str, case: dict[str, Any], ranks: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    world = len(ranks)
    per_step = [[step, [k for r in ranks for k in r["loops"][i][1]]] for i, (step, _) in enumerate(ranks[0]["loops"])]
    # the reference's micro-batch m of a step is rank m
    steps = [reference["loops"][i : i + world] for i in range(0, len(reference["loops"]), world)]
    assert [[group[0][0], [k for _, loops in group for k in loops]] for group in steps] == per_step
    deviation = 0.0
    for rank, result in enumerate(ranks):
        # the first step runs on equal weights: each rank's loss is its micro-batch's (scaled by 1/W there)
        assert result["losses"][0] == world * reference["losses"][rank], (name, rank)
        for key, value in reference["state"].items():
            deviation = max(deviation, (result["state"][key].float() - value.float()).abs().max().item())
            if case.get("bitwise"):
                assert torch.equal(result["state"][key], value), f"{name}: {key} differs on rank {rank}"
    assert deviation <= ROUND_OFF, f"{name}: the parameters deviate by {deviation:.2e} from one process"
    moved = max((v.float() - reference["initial"][k].float()).abs().max().item() for k, v in reference["state"].items())
    assert moved > 1e-2, f"{name}: training barely moved the parameters; the comparison proves nothing"
    schedules = [[loops] for _, loops in per_step]
    expected = [rank_utilisation(schedule, world, _depth, case["strategy"] == "fsdp") for schedule in schedules]
    assert all(r["utilisation"] == pytest.approx(expected) for r in ranks), (name, expected)
    if case.get("depth_layout") == "micro_batches":  # one k per slot on every rank, depths mixed across slots
        assert all(r["loops"] == ranks[0]["loops"] for r in ranks) and expected == [1.0] * STEPS
        assert any(len(set(loops)) > 1 for _, loops in ranks[0]["loops"]), f"{name}: slots never ran different k"
    else:
        assert min(expected) < 1, f"{name}: ranks never ran different k"
    print(
        f"{world} ranks, {name}: loops {[loops for _, loops in per_step]}, train/rank_utilisation {expected}, "
        f"largest parameter deviation from one process {deviation:.1e}"
    )


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(CASES))
def test_ranks_at_different_k_equal_one_process_with_the_same_shards(world, corpus, tmp_path):
    cases = {name: {key: v for key, v in case.items() if key != "bitwise"} for name, case in CASES[world].items()}
    results = launch("ddp", corpus, tmp_path / f"w{world}", cases, timeout_s=400, world=world, steps=STEPS)
    for name, case in CASES[world].items():
        assert_equals_one_process(name, case, results[name], _reference(cases[name], world, corpus))
        units = results[name][0]["fsdp_units"]
        if case.get("recurrent_units") == "layer":  # each recurrent layer its own unit: the block is never gathered whole
            assert units == ["", "input_layers.0", "core", "core.layers.0", "output_layers.0"]
        elif case["strategy"] == "fsdp":
            assert units == ["", "input_layers.0", "core", "output_layers.0"]


# ---- idle passes ---------------------------------------------------------------------------------------


MODELS = {"attention": {}, "hybrid": {"hybrid": True}, "moe": {"moe": True}}
BACKPROP = {"none": {}, "loop": {"activation_checkpointing": "loop"}, "layer+bp1": {"activation_checkpointing": "layer", "backprop_loops": 1}}


@pytest.mark.parametrize("backprop", sorted(BACKPROP))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_idle_passes_change_no_value_and_no_gradient(model, backprop):
    """A forward at k = 1 padded to 3 passes gives the logits, auxiliary losses and gradients of k = 1, bit for bit."""
    results = []
    for passes in (None, 3):
        module = _dist_worker.tiny_module(1, **MODELS[model], **BACKPROP[backprop])
        calls = []
        for layer in module.model.core.layers:
            layer.register_forward_pre_hook(lambda mod, args: calls.append(args[0].shape[0]))
        aux: dict[str, torch.Tensor] = {}
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
        logits = module.model(ids, 1, aux_losses=aux, passes=passes)
        (logits.float().square().mean() + sum(aux.values(), torch.zeros(()))).backward()
        grads = {name: p.grad for name, p in module.model.named_parameters() if p.grad is not None}
        results.append((logits.detach(), aux, grads, calls))
    (logits, aux, grads, calls), (padded_logits, padded_aux, padded_grads, padded_calls) = results
    assert torch.equal(logits, padded_logits)
    assert aux.keys() == padded_aux.keys() and all(torch.equal(aux[k], padded_aux[k]) for k in aux)
    assert grads.keys() == padded_grads.keys() and all(torch.equal(grads[k], padded_grads[k]) for k in grads)
    assert [n for n in padded_calls if n] == calls and padded_calls.count(0) >= 2  # two idle passes, on no rows


def test_passes_below_the_loop_count_are_refused():
    model = _dist_worker.tiny_module(1).model
    with pytest.raises(ValueError, match=r"passes=1 must be an integer >= loops=2"):
        model(torch.zeros(1, 4, dtype=torch.long), 2, passes=1)


# ---- the loop layout and the utilisation figure --------------------------------------------------------


def _attached(module: ELRModule, ranks: int, accumulate: int, step: int, micro_batch: int, strategy: Any = None) -> ELRModule:
    progress = SimpleNamespace(current=SimpleNamespace(ready=micro_batch + 1))
    module._trainer = SimpleNamespace(
        global_rank=0, world_size=ranks, global_step=step, accumulate_grad_batches=accumulate,
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)),
        strategy=strategy or SimpleNamespace(data_parallel_rank=0, data_parallel_size=ranks),
    )
    return module


@given(step=st.integers(0, 10_000), accumulate=st.integers(1, 4), virtual=st.integers(1, 3), ranks=st.integers(1, 4))
def test_micro_batch_layout_runs_one_k_per_slot_on_every_rank(step, accumulate, virtual, ranks):
    sampler = OneLoopOverride(4, 0.3)
    module = ELRModule(arch=tiny_config(), sampler=sampler, virtual_ranks=virtual, loop_seed=3, depth_layout="micro_batches")
    slots = sampler.schedule(3, step, accumulate * virtual)
    for m in range(accumulate):
        _attached(module, ranks, accumulate, step, m)
        assert module.micro_batch_index() == m
        assert module.step_schedule() == slots[m * virtual : (m + 1) * virtual] * ranks
    assert sorted(k for schedule in module.step_schedules(step) for k in schedule) == sorted(slots * ranks)


def test_micro_batch_layout_keeps_eq3_over_the_slots():
    """p_1 and mean k of eq. (3) over 2,000 steps of 4 micro-batches x 2 virtual ranks, every rank alike."""
    sampler = OneLoopOverride(4, 0.15)
    module = ELRModule(arch=tiny_config(), sampler=sampler, virtual_ranks=2, loop_seed=1, depth_layout="micro_batches")
    _attached(module, 8, 4, 0, 0)
    shards = [k for step in range(2000) for schedule in module.step_schedules(step) for k in schedule]
    assert sum(k == 1 for k in shards) / len(shards) == pytest.approx(sampler.expected_p1(), abs=0.02)
    assert sum(shards) / len(shards) == pytest.approx(sampler.expected_mean_loops(), abs=0.05)


def test_collective_passes_are_the_deepest_k_of_each_slot():
    strategy = SimpleNamespace(data_parallel_rank=1, data_parallel_size=3, pads_recurrent_passes=True)
    module = _attached(ELRModule(arch=tiny_config(), virtual_ranks=2, loop_seed=5), 3, 1, 7, 0, strategy)
    schedule = module.step_schedule()
    assert module.collective_passes() == [max(schedule[0::2]), max(schedule[1::2])]
    strategy.pads_recurrent_passes = False
    assert module.collective_passes() is None


@given(
    loops=st.lists(st.integers(1, 8), min_size=1, max_size=12),
    ranks=st.sampled_from([1, 2, 3, 4]),
    waits_per_shard=st.booleans(),
)
def test_rank_utilisation_is_the_work_over_ranks_times_the_most(loops, ranks, waits_per_shard):
    schedule = loops * ranks  # every rank the same work
    assert rank_utilisation([schedule], ranks, _depth, waits_per_shard) == 1.0
    uneven = [1] * len(loops) * (ranks - 1) + loops  # the last rank alone runs deeper
    work = [_depth(1) * len(loops)] * (ranks - 1) + [sum(map(_depth, loops))]
    assert rank_utilisation([uneven], ranks, _depth, waits_per_shard) == pytest.approx(sum(work) / (ranks * max(work)))
    assert 1 / ranks <= rank_utilisation([uneven], ranks, _depth, waits_per_shard) <= 1


@given(
    slots=st.lists(st.lists(st.integers(1, 8), min_size=2, max_size=4), min_size=1, max_size=3),
    virtual=st.integers(1, 3),
    data=st.data(),
)
def test_rank_utilisation_waits_for_the_deepest_rank_of_every_slot(slots, virtual, data):
    """Each slot lasts as long as its deepest rank: the wall is the sum over slots of the max over ranks.

    ``slots``: per micro-batch, the ranks' work in one shard; each rank runs ``virtual`` shards per micro-batch.
    Under DDP (``waits_per_shard`` false) the ranks meet once per micro-batch, so a rank's shards add up first.
    """
    ranks = len(slots[0])
    # micro-batch m: rank r's v-th shard runs loops[m][v][r]
    loops = [[[data.draw(st.integers(1, 8)) for _ in range(ranks)] for _ in range(virtual)] for _ in slots]
    schedules = [[per_shard[r] for r in range(ranks) for per_shard in micro] for micro in loops]
    work = sum(_depth(k) for micro in loops for per_shard in micro for k in per_shard)
    fsdp_wall = sum(max(map(_depth, per_shard)) for micro in loops for per_shard in micro)
    ddp_wall = sum(max(sum(_depth(per_shard[r]) for per_shard in micro) for r in range(ranks)) for micro in loops)
    assert rank_utilisation(schedules, ranks, _depth) == pytest.approx(work / (ranks * fsdp_wall))
    assert rank_utilisation(schedules, ranks, _depth, waits_per_shard=False) == pytest.approx(work / (ranks * ddp_wall))
    # waiting at every shard can only cost; the two agree with one shard per rank and micro-batch
    assert rank_utilisation(schedules, ranks, _depth) <= rank_utilisation(schedules, ranks, _depth, False) + 1e-12
    if virtual == 1:
        assert rank_utilisation(schedules, ranks, _depth) == rank_utilisation(schedules, ranks, _depth, False)


def test_rank_utilisation_of_k1_beside_k6():
    """The issue's example: one rank at k = 1 waits for one at k = 6 (D_eff = 3 and 8 on the tiny model)."""
    assert rank_utilisation([[1, 6]], 2, _depth) == pytest.approx((3 + 8) / (2 * 8))
    # two shards per rank at [1, 6] and [6, 1]: under FSDP each shard's forward waits for the deepest rank,
    # so both ranks pad both shards to k = 6; under DDP the two ranks' shards add up to the same work
    assert rank_utilisation([[1, 6, 6, 1]], 2, _depth) == pytest.approx((3 + 8 + 8 + 3) / (2 * (8 + 8)))
    assert math.isclose(rank_utilisation([[1, 6, 6, 1]], 2, _depth, waits_per_shard=False), 1.0)
    # micro-batches [1, 6] then [6, 1]: the ranks meet at the end of each under either strategy
    assert rank_utilisation([[1, 6], [6, 1]], 2, _depth, waits_per_shard=False) == pytest.approx(22 / 32)


def test_strategies_that_gather_per_forward_wait_per_shard():
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    from elr_lightning.step_logging import ranks_wait_per_shard
    from elr_lightning.strategies import OneLoopOverrideDDPStrategy

    assert ranks_wait_per_shard(OneLoopOverrideFSDPStrategy())
    assert not ranks_wait_per_shard(OneLoopOverrideDDPStrategy()) and not ranks_wait_per_shard(DDPStrategy())
    assert not ranks_wait_per_shard(SingleDeviceStrategy("cpu"))


def test_bad_layout_and_units_name_the_field():
    with pytest.raises(ValueError, match=r"model.init_args.depth_layout='shards' must be one of ranks, micro_batches"):
        ELRModule(arch=tiny_config(), depth_layout="shards")
    with pytest.raises(ValueError, match=r"recurrent_units='loop' must be one of core, layer"):
        OneLoopOverrideFSDPStrategy(recurrent_units="loop")
