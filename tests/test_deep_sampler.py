"""``DeepLoopOverride``: eq. (3)'s p_1 in every step, the shared k over 2..K drawn from its weights."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elr_lightning.sampling import DeepLoopOverride, LoopCurriculum, OneLoopOverride

weights_2_to_k = st.integers(2, 6).flatmap(
    lambda k: st.tuples(st.just(k), st.lists(st.integers(0, 5), min_size=k - 1, max_size=k - 1).filter(any))
)


@given(kw=weights_2_to_k, f=st.sampled_from([0.0, 0.1, 0.15, 0.5]), shards=st.sampled_from([1, 2, 4, 8]))
def test_realised_p1_is_eq3_exactly_up_to_one_shard(kw, f, shards):
    k, weights = kw
    sampler = DeepLoopOverride(k, f, [float(w) for w in weights])
    steps = 600
    ones = sum(x == 1 for t in range(steps) for x in sampler.schedule(0, t, shards))
    p1 = 1 / k + (1 - 1 / k) * f
    assert sampler.expected_p1() == pytest.approx(p1)
    # The rotation hands out floor(T p_1 S) one-loop shards in T steps: no sampling noise.
    assert ones == math.floor(steps * p1 * shards + 1e-9)


@given(kw=weights_2_to_k, seed=st.integers(0, 10**6))
def test_shared_k_frequencies_follow_the_weights(kw, seed):
    k, weights = kw
    sampler = DeepLoopOverride(k, 0.15, [float(w) for w in weights])
    steps = 3000
    counts = Counter(sampler.shared_loops(seed, t) for t in range(steps))
    total = sum(weights)
    for loops in range(2, k + 1):
        p = weights[loops - 2] / total
        assert counts[loops] / steps == pytest.approx(p, abs=5 * math.sqrt(p * (1 - p) / steps) + 1e-9)
    assert 1 not in counts
    probabilities = sampler.probabilities()
    assert sum(probabilities) == pytest.approx(1.0)
    assert probabilities[1:] == pytest.approx([(1 - sampler.expected_p1()) * w / total for w in weights])


@given(k=st.integers(2, 6), f=st.sampled_from([0.0, 0.15, 0.3]), seed=st.integers(0, 1000))
def test_uniform_weights_keep_one_loop_overrides_marginal(k, f, seed):
    deep, plain = DeepLoopOverride(k, f), OneLoopOverride(k, f)
    assert deep.probabilities()[1:] == pytest.approx([(1 - plain.expected_p1()) / (k - 1)] * (k - 1))
    assert deep.expected_mean_loops() == pytest.approx(plain.expected_mean_loops())


@given(k=st.integers(2, 6), f=st.sampled_from([0.0, 0.15, 0.5]), step=st.integers(0, 10**5), seed=st.integers(0, 99))
def test_every_step_mixes_depths_once_p1_times_shards_reaches_one(k, f, step, seed):
    p1 = 1 / k + (1 - 1 / k) * f
    shards = math.ceil(1 / p1)
    schedule = DeepLoopOverride(k, f).schedule(seed, step, shards)
    assert 1 in schedule
    if math.ceil(p1 * shards) < shards:  # room for a deeper shard in every step
        assert any(x > 1 for x in schedule)
    assert len({x for x in schedule if x > 1}) <= 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_loops=1), "max_loops=1 must be >= 2 .*; for K = 1 use elr_lightning.sampling.FixedLoops"),
        (dict(max_loops=3, weights=[1.0]), "weights=.*must list 2 weights"),
        (dict(max_loops=3, weights=[0.0, 0.0]), "must not all be zero"),
        (dict(max_loops=3, override_fraction=1.5), "override_fraction=1.5 must be in"),
    ],
)
def test_bad_settings_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DeepLoopOverride(**kwargs)


def test_curriculum_moves_the_shared_k_from_its_start_to_its_final_weights():
    sampler = LoopCurriculum(3, 0.15, weights=[1, 0], final_weights=[0, 1], ramp_steps=100)
    assert sampler.weights_at(0) == [1.0, 0.0] and sampler.weights_at(50) == [0.5, 0.5]
    assert sampler.weights_at(100) == sampler.weights_at(10**6) == [0.0, 1.0]
    assert {sampler.shared_loops(7, t) for t in range(5)} == {2}
    assert {sampler.shared_loops(7, t) for t in range(100, 200)} == {3}
    early = sum(sampler.shared_loops(7, t) == 3 for t in range(0, 50))
    late = sum(sampler.shared_loops(7, t) == 3 for t in range(50, 100))
    assert early < late


@given(seed=st.integers(0, 10**6), step=st.integers(0, 10**5), shards=st.sampled_from([1, 4, 8]))
def test_curriculum_is_a_pure_function_of_seed_and_step_and_keeps_eq3_p1(seed, step, shards):
    make = lambda: LoopCurriculum(4, 0.15, weights=[3, 1, 1], final_weights=[1, 1, 3], ramp_steps=500)  # noqa: E731
    a, b = make(), make()
    assert a.schedule(seed, step, shards) == b.schedule(seed, step, shards)
    assert a.expected_p1() == pytest.approx(DeepLoopOverride(4, 0.15).expected_p1())
    probabilities = a.probabilities()
    assert sum(probabilities) == pytest.approx(1.0) and probabilities[0] == pytest.approx(a.expected_p1())


def test_curriculum_training_average_counts_the_hold_at_the_final_weights():
    ramp_only = LoopCurriculum(3, 0.0, weights=[1, 0], final_weights=[0, 1], ramp_steps=100)
    held = LoopCurriculum(3, 0.0, weights=[1, 0], final_weights=[0, 1], ramp_steps=100, hold_steps=300)
    assert ramp_only.probabilities()[2] == pytest.approx((2 / 3) * 0.495)
    assert held.probabilities()[2] > ramp_only.probabilities()[2]
    assert held.expected_mean_loops() > ramp_only.expected_mean_loops()


@pytest.mark.parametrize("field, kwargs", [
    ("ramp_steps", {"ramp_steps": 0}),
    ("hold_steps", {"hold_steps": -1}),
    ("final_weights", {"final_weights": [1, 2, 3]}),
])
def test_curriculum_rejects_bad_values_naming_the_field(field, kwargs):
    with pytest.raises(ValueError, match=f"LoopCurriculum.{field}"):
        LoopCurriculum(3, 0.15, **kwargs)
