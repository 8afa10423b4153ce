"""Ranks at different k issue the same collectives when each recurrent layer is its own FSDP2 unit (issue 47).

With ``recurrent_units: layer`` a rank past its own k pads its forward with idle passes
(``RecurrentCore.idle_passes``), so that every rank gathers each recurrent layer as often as the
deepest. Under truncated backpropagation (``backprop_loops`` between a rank's k and the step's pass
count) the first idle pass that keeps a graph used to receive a tensor that did not require grad:
FSDP2 then registered no post-backward hook for that call, the layer stayed gathered through its
backward, and the rank issued one all-gather fewer than its peers (a hang on two gloo ranks).

A fake process group of two ranks in this process counts each rank's collectives alone, at every
k, for every ``backprop_loops`` x activation-checkpointing mode; two gloo ranks then train through
steps that mix k = 1 with k = 3 and compare their counts.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import _dist_worker
from elr_lightning.strategies import shard_looped_lm
from test_strategies import corpus, launch  # noqa: F401 - corpus is a fixture

#: The tiny model's K: a step's pass count P is the deepest k of its ranks, at most K.
PASSES = 3
#: backprop_loops below every k, between k and P, and none (through every loop).
BACKPROP_LOOPS = (1, 2, None)
CHECKPOINTING = ("none", "loop", "layer")
#: (model, backprop_loops, checkpointing): the dense model everywhere; the hybrid and MoE layers, whose
#: mixers add no hook of their own, once each where the fault was (backprop_loops between k and P).
GRID = [("attention", b, c) for b in BACKPROP_LOOPS for c in CHECKPOINTING]
GRID += [("hybrid", 2, "loop"), ("moe", 2, "layer")]


@pytest.fixture(scope="module")
def fake_mesh() -> Iterator[DeviceMesh]:
    """A 1-D mesh over a fake two-rank process group: collectives return at once, nobody else takes part."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
    finally:
        dist.destroy_process_group()


def _counts(model: torch.nn.Module, loops: int) -> dict[str, int]:
    """The collectives of one training forward and backward at ``loops``, padded to :data:`PASSES`."""
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(loops))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(ids, loops, passes=PASSES).float().square().mean().backward()
    return _dist_worker.collective_counts(prof)


@pytest.mark.parametrize("model, backprop_loops, checkpointing", GRID, ids=lambda v: str(v))
def test_every_k_gathers_each_layer_as_often(model: str, backprop_loops: Any, checkpointing: str, fake_mesh: DeviceMesh):
    lm = _dist_worker.tiny_module(
        1, hybrid=model == "hybrid", moe=model == "moe", activation_checkpointing=checkpointing,
        backprop_loops=backprop_loops,
    ).model
    shard_looped_lm(lm, fake_mesh["data_parallel"], recurrent_units="layer")
    counts = {k: _counts(lm, k) for k in range(1, PASSES + 1)}
    layer = counts[PASSES]["FSDP::all_gather (core.layers.0)"]
    assert layer >= PASSES + 1, f"the shared layer is gathered {layer} times: the count proves nothing"
    for k, seen in counts.items():
        assert seen == counts[PASSES], f"k={k} padded to {PASSES} passes issues other collectives than k={PASSES}"


#: Two gloo ranks, each recurrent layer its own unit, backprop through the last 2 of K = 3 loops: steps 2 and 3
#: of the tiny module's schedule put one rank at k = 1 beside one at k = 3 (asserted below).
RANK_CASES = {
    f"layer_bp2_{mode}": {
        "strategy": "fsdp", "recurrent_units": "layer", "virtual_ranks": 1, "backprop_loops": 2,
        "activation_checkpointing": mode, "count_collectives": True,
    }
    for mode in CHECKPOINTING
}


@pytest.mark.slow
def test_ranks_at_k1_and_k3_issue_the_same_collectives(corpus, tmp_path):  # noqa: F811 - corpus is a fixture
    results = launch("fsdp", corpus, tmp_path / "runs", RANK_CASES, timeout_s=300, steps=4)
    for name, ranks in results.items():
        schedules = [sorted(k for r in ranks for k in r["loops"][i][1]) for i in range(len(ranks[0]["loops"]))]
        assert [1, 3] in schedules, f"{name}: no step put ranks at k = 1 and k = 3 ({schedules})"
        first, second = (r["collectives"] for r in ranks)
        assert first["FSDP::all_gather (core.layers.0)"] > 4 * PASSES, f"{name}: too few gathers to prove anything"
        assert first == second, f"{name}: the ranks' collectives differ: {first} vs {second}"
