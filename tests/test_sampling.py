"""Schedule properties of the loop samplers: override rotation, eq. (3), and the ablation samplers."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elr_lightning.sampling import IndependentRank, OneLoopOverride, Synchronized

fractions = st.sampled_from([0.0, 0.05, 0.1, 0.15, 0.2, 1 / 3, 0.5, 0.75, 1.0])


@given(k=st.integers(1, 8), f=fractions, shards=st.integers(1, 24), steps=st.integers(1, 600))
def test_every_shard_is_overridden_equally_often(k, f, shards, steps):
    sampler = OneLoopOverride(k, f)
    counts = Counter(s for t in range(steps) for s in sampler.overridden(t, shards))
    per_shard = [counts[s] for s in range(shards)]
    assert max(per_shard) - min(per_shard) <= 1
    assert sum(per_shard) == pytest.approx(f * shards * steps, abs=1)


@given(f=fractions, shards=st.integers(1, 24), step=st.integers(0, 10**6))
def test_each_step_overrides_floor_or_ceil_of_f_times_s(f, shards, step):
    """Only multiples of 1/S are exact per step; the rotation realises f S on average."""
    n = len(OneLoopOverride(4, f).overridden(step, shards))
    assert n in (math.floor(f * shards + 1e-9), math.ceil(f * shards - 1e-9))


@given(
    k=st.integers(1, 8), f=fractions, shards=st.integers(1, 24), seed=st.integers(0, 10**6), step=st.integers(0, 10**6)
)
def test_non_override_shards_share_one_k_within_a_step(k, f, shards, seed, step):
    sampler = OneLoopOverride(k, f)
    schedule = sampler.schedule(seed, step, shards)
    forced = set(sampler.overridden(step, shards))
    assert all(schedule[s] == 1 for s in forced)
    assert {schedule[s] for s in range(shards) if s not in forced} <= {sampler.shared_loops(seed, step)}
    assert all(1 <= x <= k for x in schedule)


@given(seed=st.integers(0, 10**4), shards=st.sampled_from([4, 8, 20]))
def test_realised_p1_is_eq3_paper_point(seed, shards):
    """K = 5, f = 0.15: p_1 = 1/5 + (4/5) 0.15 = 0.32 and mean k = 0.15 + 0.85 * 3 = 2.7 (eq. 3)."""
    sampler = OneLoopOverride(5, 0.15)
    steps = 3000
    drawn = [x for t in range(steps) for x in sampler.schedule(seed, t, shards)]
    # The override count is exact by construction; the shared k varies: std of p_1 ~ 0.4 / sqrt(steps).
    assert sum(x == 1 for x in drawn) / len(drawn) == pytest.approx(0.32, abs=0.035)
    assert sum(drawn) / len(drawn) == pytest.approx(2.7, abs=0.15)


@given(k=st.integers(1, 6), seed=st.integers(0, 10**6), step=st.integers(0, 10**6), shards=st.integers(1, 32))
def test_independent_rank_shard_k_depends_on_seed_step_shard_only(k, seed, step, shards):
    sampler = IndependentRank(k)
    schedule = sampler.schedule(seed, step, shards)
    assert all(1 <= x <= k for x in schedule)
    assert sampler.schedule(seed, step, shards + 3)[:shards] == schedule
    assert IndependentRank(k).schedule(seed, step, shards) == schedule


@given(seed=st.integers(0, 10**4))
def test_independent_rank_is_uniform_and_mixes_within_steps(seed):
    sampler, shards, steps = IndependentRank(4), 4, 2000
    rows = [sampler.schedule(seed, t, shards) for t in range(steps)]
    counts = Counter(x for row in rows for x in row)
    assert all(counts[k] / (shards * steps) == pytest.approx(0.25, abs=0.03) for k in range(1, 5))
    # Four independent uniform draws agree with probability 4 * (1/4)^4 = 1/64.
    assert sum(len(set(row)) == 1 for row in rows) / steps == pytest.approx(1 / 64, abs=0.02)
    assert sampler.expected_p1() == 0.25 and sampler.expected_mean_loops() == 2.5


@given(k=st.integers(1, 6), seed=st.integers(0, 10**6), step=st.integers(0, 10**6), shards=st.integers(1, 32))
def test_synchronized_shards_all_run_the_same_k(k, seed, step, shards):
    schedule = Synchronized(k, weights=[1.0] * k).schedule(seed, step, shards)
    assert len(set(schedule)) == 1 and 1 <= schedule[0] <= k


@given(seed=st.integers(0, 10**6), step=st.integers(0, 10**6), shards=st.integers(1, 16))
def test_unweighted_synchronized_draws_the_override_shared_k(seed, step, shards):
    """Every shard of a synchronized step runs one k, the k the non-overridden shards of a one-loop-override
    step run: the two samplers differ only by the overrides (the paper's comparison)."""
    sync = Synchronized(4).schedule(seed, step, shards)
    assert len(sync) == shards and len(set(sync)) == 1 and 1 <= sync[0] <= 4
    override = OneLoopOverride(4, 0.5).schedule(seed, step, shards)
    assert all(k == sync[0] for k in override if k != 1) or sync[0] == 1


@given(seed=st.integers(0, 10**4), weights=st.sampled_from([[1, 1, 1, 1], [2, 1, 1, 0], [0.32] + [0.17] * 4]))
def test_synchronized_frequencies_follow_the_normalised_weights(seed, weights):
    sampler, steps = Synchronized(len(weights), weights=weights), 4000
    counts = Counter(sampler.schedule(seed, t, 2)[0] for t in range(steps))
    total = sum(weights)
    for k, w in enumerate(weights, start=1):
        assert counts[k] / steps == pytest.approx(w / total, abs=0.035)
        if w == 0:
            assert counts[k] == 0
    assert sampler.expected_p1() == pytest.approx(weights[0] / total)
    assert sampler.expected_mean_loops() == pytest.approx(sum(k * w for k, w in enumerate(weights, 1)) / total)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: IndependentRank(0), "IndependentRank.max_loops=0"),
        (lambda: Synchronized(0), "Synchronized.max_loops=0"),
        (lambda: Synchronized(4, weights=[1, 1]), r"Synchronized\.weights=\[1, 1\] must list 4 weights, one per"),
        (lambda: Synchronized(2, weights=[1, -1]), r"Synchronized\.weights=.* must be finite and >= 0"),
        (lambda: Synchronized(2, weights=[1, float("nan")]), r"Synchronized\.weights=.* must be finite"),
        (lambda: Synchronized(2, weights=[0, 0]), r"Synchronized\.weights=.* must not all be zero"),
    ],
)
def test_bad_ablation_sampler_settings_name_the_field(make, match):
    with pytest.raises(ValueError, match=match):
        make()
