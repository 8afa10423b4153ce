"""Foundation sampler properties: eq. 3 marginals, purity of the schedule, resume replay."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import tiny_config
from elr_lightning.module import ELRModule
from elr_lightning.sampling import FixedLoops, OneLoopOverride, UniformLoops


def test_paper_reference_p1():
    """K = 5, f = 0.15 gives p_1 = 0.32 (paper §6)."""
    assert OneLoopOverride(5, 0.15).expected_p1() == pytest.approx(0.32)


@given(
    k=st.integers(1, 6),
    f=st.sampled_from([0.0, 0.1, 0.15, 0.25, 0.5, 1.0]),
    shards=st.sampled_from([1, 2, 4, 8]),
    seed=st.integers(0, 1000),
)
def test_realised_marginals_match_eq3(k, f, shards, seed):
    sampler = OneLoopOverride(k, f)
    steps = 4000
    drawn = [x for t in range(steps) for x in sampler.schedule(seed, t, shards)]
    p1 = sum(x == 1 for x in drawn) / len(drawn)
    mean = sum(drawn) / len(drawn)
    # The override fraction is exact by construction; the shared k is i.i.d. uniform per step.
    tol = 4 * (k / (2 * steps**0.5))
    assert p1 == pytest.approx(sampler.expected_p1(), abs=max(tol / k, 0.03))
    assert mean == pytest.approx(sampler.expected_mean_loops(), abs=max(tol, 0.05))
    assert all(1 <= x <= k for x in drawn)


@given(seed=st.integers(0, 10**6), step=st.integers(0, 10**6), shards=st.integers(1, 16))
def test_schedule_is_pure(seed, step, shards):
    a, b = OneLoopOverride(4, 0.25), OneLoopOverride(4, 0.25)
    assert a.schedule(seed, step, shards) == b.schedule(seed, step, shards)
    assert [a.loops(seed, step, s, shards) for s in range(shards)] == a.schedule(seed, step, shards)


@given(seed=st.integers(0, 1000), interrupt=st.integers(1, 60), shards=st.integers(1, 8))
def test_schedule_replays_across_a_simulated_resume(seed, interrupt, shards):
    """A module rebuilt mid-run (as after a checkpoint load) continues with the same loop counts."""
    sampler = OneLoopOverride(4, 0.15)
    first = ELRModule(arch=tiny_config(), sampler=sampler, virtual_ranks=shards, loop_seed=seed)
    straight = [first.step_schedule(t) for t in range(80)]
    resumed = ELRModule(arch=tiny_config(), sampler=OneLoopOverride(4, 0.15), virtual_ranks=shards, loop_seed=seed)
    replay = straight[:interrupt] + [resumed.step_schedule(t) for t in range(interrupt, 80)]
    assert replay == straight


def test_different_seeds_give_different_schedules():
    sampler = UniformLoops(4)
    assert [sampler.schedule(0, t, 1) for t in range(50)] != [sampler.schedule(1, t, 1) for t in range(50)]


def test_fixed_loops():
    assert FixedLoops(3).schedule(0, 7, 4) == [3, 3, 3, 3]


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: OneLoopOverride(4, 1.5), "override_fraction=1.5"),
        (lambda: OneLoopOverride(4, -0.1), "override_fraction=-0.1"),
        (lambda: OneLoopOverride(0, 0.1), "max_loops=0"),
        (lambda: UniformLoops(0), "max_loops=0"),
        (lambda: FixedLoops(0), "FixedLoops.k=0"),
        (lambda: ELRModule(arch=tiny_config(max_loops=4), sampler=FixedLoops(5)), r"sampler\.max_loops=5 exceeds"),
        (lambda: ELRModule(arch=tiny_config(), virtual_ranks=0), "virtual_ranks=0"),
    ],
)
def test_bad_sampler_settings_name_the_field(make, match):
    with pytest.raises(ValueError, match=match):
        make()
