"""Foundation sampler properties: eq. 3 marginals, purity of the schedule, resume replay."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
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


#: (seed, step, shards) points of the cross-process check.
POINTS = [(seed, step, shards) for seed in (0, 7, 12345) for step in (0, 1, 99, 10**6) for shards in (1, 3, 8)]


_SCHEDULES = (
    "from elr_lightning.sampling import OneLoopOverride\n"
    "sampler = OneLoopOverride(4, 0.15)\n"
    "schedules = [sampler.schedule(seed, step, shards) for seed, step, shards in POINTS]\n"
)


def _schedules() -> list[list[int]]:
    scope = {"POINTS": POINTS}
    exec(_SCHEDULES, scope)
    return scope["schedules"]


def test_schedule_is_a_function_of_seed_step_and_shards_only():
    """What a resumed run or another rank computes: the same schedule in a fresh interpreter with another
    hash seed, and here whatever the global random generators hold (Python, NumPy, torch)."""
    here = _schedules()
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    assert _schedules() == here
    random.seed(2), np.random.seed(2), torch.manual_seed(2)
    torch.rand(1000)
    assert _schedules() == here
    code = f"import json\nPOINTS = {POINTS!r}\n{_SCHEDULES}print(json.dumps(schedules))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == here
    assert len({tuple(x) for x in here}) > 10  # the points do not all give one schedule


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
