"""Loop samplers: which loop count k each shard of each optimizer step runs (DESIGN §4).

A step has ``num_shards`` shards: data-parallel ranks times ``virtual_ranks`` slices of each local
batch. A sampler's schedule is a pure function of ``(seed, step, shard, num_shards)``, so every rank
knows every shard's k without communication and a resumed run replays it exactly.
"""

from __future__ import annotations

import math
import random
from typing import Optional

from typing_extensions import override

from elr_lightning.plugin_config import RecordsInitArgs, own_attributes


def step_rng(seed: int, step: int, stream: str = "") -> random.Random:
    """A generator that depends only on ``(seed, step, stream)`` (string seeds hash with SHA-512)."""
    return random.Random(f"elr:{seed}:{step}:{stream}")


class LoopSampler(metaclass=RecordsInitArgs):
    """Seam contract for a loop sampler.

    Subclasses implement :meth:`schedule`, a pure function of its arguments returning one k in
    ``1..max_loops`` per shard. Gradient-accumulation micro-batches of one optimizer step share the
    step index, so they agree. ``max_loops`` is the largest k the sampler can draw; the module
    refuses a sampler whose ``max_loops`` exceeds the model's budget ``arch.max_loops``.
    """

    max_loops: int

    def schedule(self, seed: int, step: int, num_shards: int) -> list[int]:
        """The loop count of every shard at optimizer step ``step``."""
        raise NotImplementedError

    def loops(self, seed: int, step: int, shard: int, num_shards: int) -> int:
        """The loop count of one shard at optimizer step ``step``."""
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard={shard} must be in [0, num_shards={num_shards})")
        return self.schedule(seed, step, num_shards)[shard]

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in own_attributes(self).items())
        return f"{type(self).__name__}({args})"


def _check_max_loops(owner: str, max_loops: int) -> int:
    if not isinstance(max_loops, int) or max_loops < 1:
        raise ValueError(f"{owner}.max_loops={max_loops!r} must be an integer >= 1")
    return max_loops


class FixedLoops(LoopSampler):
    """Every shard runs k loops.

    Args:
        k: The loop count (>= 1).
    """

    def __init__(self, k: int = 1) -> None:
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"FixedLoops.k={k!r} must be an integer >= 1")
        self.k = self.max_loops = k

    def schedule(self, seed: int, step: int, num_shards: int) -> list[int]:
        return [self.k] * num_shards


class OneLoopOverride(LoopSampler):
    """One-loop overrides, eq. (3): a rotating fraction f of shards runs k = 1; the rest share one
    k drawn uniformly from 1..K for the step.

    The overridden shards rotate deterministically: by step t, ``floor(t f S)`` overrides have been
    handed out to the S shards in round-robin order, so the realised override fraction converges to
    f and every shard is overridden equally often (to within one step). Hence
    ``p_1 = 1/K + (1 - 1/K) f`` and ``mean k = f + (1 - f)(K + 1)/2``.

    Args:
        max_loops: K, the largest loop count.
        override_fraction: f in [0, 1].
    """

    def __init__(self, max_loops: int = 4, override_fraction: float = 0.15) -> None:
        self.max_loops = _check_max_loops(type(self).__name__, max_loops)
        if not 0.0 <= override_fraction <= 1.0:
            raise ValueError(
                f"{type(self).__name__}.override_fraction={override_fraction} must be in [0, 1] "
                "(the fraction f of shards forced to k = 1)"
            )
        self.override_fraction = override_fraction

    def override_rate(self) -> float:
        """Fraction of shards forced to k = 1: f."""
        return self.override_fraction

    def overridden(self, step: int, num_shards: int) -> list[int]:
        """Indices of the shards forced to k = 1 at ``step``."""
        rate = self.override_rate() * num_shards
        start = math.floor(step * rate + 1e-9)
        count = math.floor((step + 1) * rate + 1e-9) - start
        return sorted({(start + j) % num_shards for j in range(count)})

    def shared_loops(self, seed: int, step: int) -> int:
        """The k that every non-overridden shard runs at ``step``."""
        return step_rng(seed, step).randint(1, self.max_loops)

    def schedule(self, seed: int, step: int, num_shards: int) -> list[int]:
        k = self.shared_loops(seed, step)
        forced = set(self.overridden(step, num_shards))
        return [1 if shard in forced else k for shard in range(num_shards)]

    def expected_p1(self) -> float:
        """p_1 of eq. (3)."""
        k, f = self.max_loops, self.override_fraction
        return 1.0 / k + (1.0 - 1.0 / k) * f

    def expected_mean_loops(self) -> float:
        """Mean k of eq. (3)."""
        k, f = self.max_loops, self.override_fraction
        return f + (1.0 - f) * (k + 1) / 2.0


class UniformLoops(OneLoopOverride):
    """All shards share one k drawn uniformly from 1..K each step (one-loop overrides with f = 0).

    Args:
        max_loops: K, the largest loop count.
    """

    def __init__(self, max_loops: int = 4) -> None:
        super().__init__(max_loops=max_loops, override_fraction=0.0)


class IndependentRank(LoopSampler):
    """Independent-rank sampling (ablation, §6): every shard draws its own k uniformly from 1..K.

    Shard ``s`` at step ``t`` draws from a generator seeded by ``(seed, t, s)`` only, so its k does
    not depend on the number of shards. It mixes depths most evenly but the step waits for the
    deepest shard (1.36x step time at scale in the paper). ``p_1 = 1/K`` and ``mean k = (K + 1)/2``.

    Args:
        max_loops: K, the largest loop count.
    """

    def __init__(self, max_loops: int = 4) -> None:
        self.max_loops = _check_max_loops(type(self).__name__, max_loops)

    def schedule(self, seed: int, step: int, num_shards: int) -> list[int]:
        return [step_rng(seed, step, f"shard{shard}").randint(1, self.max_loops) for shard in range(num_shards)]

    def expected_p1(self) -> float:
        """Probability of k = 1: 1/K."""
        return 1.0 / self.max_loops

    def expected_mean_loops(self) -> float:
        """Mean k: (K + 1)/2."""
        return (self.max_loops + 1) / 2.0


class Synchronized(LoopSampler):
    """Synchronized sampling (ablation, §6): all shards share one k per step, drawn from ``weights``.

    With ``weights=None`` the draw is uniform and identical to :class:`UniformLoops` (and to the
    shared k of :class:`OneLoopOverride`) for the same seed, so the ablations differ only in how
    depths are assigned to shards. Weights give any marginal, e.g. the one of eq. (3) with
    ``weights = [p_1] + [(1 - p_1)/(K - 1)] * (K - 1)``, which the paper finds still loses the
    one-loop endpoint because depths are not mixed within the step.

    Args:
        max_loops: K, the largest loop count.
        weights: Relative probability of k = 1..K (``max_loops`` non-negative numbers, not all zero;
            normalised here), or ``None`` for uniform.
    """

    def __init__(self, max_loops: int = 4, weights: Optional[list[float]] = None) -> None:
        self.max_loops = _check_max_loops(type(self).__name__, max_loops)
        self.weights = None if weights is None else _normalised_weights(type(self).__name__, weights, max_loops)

    def shared_loops(self, seed: int, step: int) -> int:
        """The k of every shard at ``step``."""
        rng = step_rng(seed, step)
        if self.weights is None:
            return rng.randint(1, self.max_loops)
        return rng.choices(range(1, self.max_loops + 1), weights=self.weights)[0]

    def schedule(self, seed: int, step: int, num_shards: int) -> list[int]:
        return [self.shared_loops(seed, step)] * num_shards

    def probabilities(self) -> list[float]:
        """P(k) for k = 1..K."""
        return list(self.weights) if self.weights is not None else [1.0 / self.max_loops] * self.max_loops

    def expected_p1(self) -> float:
        """Probability of k = 1."""
        return self.probabilities()[0]

    def expected_mean_loops(self) -> float:
        """Mean k."""
        return sum(k * p for k, p in enumerate(self.probabilities(), start=1))


def _normalised_weights(owner: str, weights: list[float], max_loops: int, field: str = "weights") -> list[float]:
    if isinstance(weights, (str, bytes)) or len(weights) != max_loops:
        raise ValueError(
            f"{owner}.{field}={weights!r} must list {max_loops} weights, one per loop count it draws"
        )
    values = [float(w) for w in weights]
    if any(not math.isfinite(w) or w < 0 for w in values):
        raise ValueError(f"{owner}.{field}={weights!r} must be finite and >= 0")
    total = sum(values)
    if total <= 0:
        raise ValueError(f"{owner}.{field}={weights!r} must not all be zero")
    return [w / total for w in values]


class DeepLoopOverride(OneLoopOverride):
    """One-loop overrides at the full p_1 of eq. (3), so every step mixes depths; the other shards
    share one k drawn from 2..K with ``weights`` (loop-count reweighting, the paper's open question).

    :class:`OneLoopOverride` overrides a fraction f of shards and draws the shared k from 1..K, so a
    step whose shared draw is 1 runs k = 1 everywhere, and with ``f * S < 1`` many steps mix no
    depths at all. Here the rotating overrides hand out k = 1 at the rate
    ``p_1 = 1/K + (1 - 1/K) f`` itself (eq. 3), and the shared k never is 1. With the default
    uniform weights the marginal over k equals :class:`OneLoopOverride`'s
    (``P(k) = (1 - p_1)/(K - 1)`` for k >= 2), only rearranged so that every step with
    ``p_1 * S >= 1`` holds a one-loop shard; weights toward deep loops move the remaining
    ``1 - p_1`` toward k = K while the one-loop endpoint keeps eq. (3)'s share.

    Args:
        max_loops: K, the largest loop count (>= 2).
        override_fraction: f in [0, 1] of eq. (3); the realised k = 1 rate is p_1, not f.
        weights: Relative probability of the shared k = 2..K (``max_loops - 1`` non-negative numbers,
            not all zero; normalised here), or ``None`` for uniform.
    """

    def __init__(
        self, max_loops: int = 4, override_fraction: float = 0.15, weights: Optional[list[float]] = None
    ) -> None:
        super().__init__(max_loops=max_loops, override_fraction=override_fraction)
        if max_loops < 2:
            raise ValueError(f"DeepLoopOverride.max_loops={max_loops} must be >= 2 (it draws the shared k from 2..K); "
                "for K = 1 use elr_lightning.sampling.FixedLoops")
        self.weights = None if weights is None else _normalised_weights(type(self).__name__, weights, max_loops - 1)

    @override
    def override_rate(self) -> float:
        """Fraction of shards forced to k = 1: p_1 of eq. (3)."""
        return self.expected_p1()

    @override
    def shared_loops(self, seed: int, step: int) -> int:
        """The k in 2..K that every non-overridden shard runs at ``step``."""
        rng = step_rng(seed, step)
        if self.weights is None:
            return rng.randint(2, self.max_loops)
        return rng.choices(range(2, self.max_loops + 1), weights=self.weights)[0]

    def probabilities(self) -> list[float]:
        """P(k) for k = 1..K: p_1 of eq. (3), then ``(1 - p_1)`` times the shared-k weights."""
        p1 = self.expected_p1()
        shared = self.weights if self.weights is not None else [1.0 / (self.max_loops - 1)] * (self.max_loops - 1)
        return [p1] + [(1.0 - p1) * w for w in shared]

    @override
    def expected_mean_loops(self) -> float:
        """Mean k under :meth:`probabilities` (eq. 3's value with uniform weights)."""
        return sum(k * p for k, p in enumerate(self.probabilities(), start=1))


class LoopCurriculum(DeepLoopOverride):
    """:class:`DeepLoopOverride` whose shared-k weights move from ``weights`` to ``final_weights``.

    At optimizer step t the shared k (2..K) is drawn with ``(1 - a) weights + a final_weights``,
    ``a = min(1, t / ramp_steps)``; the one-loop shards keep eq. (3)'s p_1 at every step. A pure
    function of ``(seed, step)``, so a resumed run replays it. :meth:`probabilities` and
    :meth:`expected_mean_loops` are the training average over ``ramp_steps`` plus
    ``hold_steps`` at the final weights.

    Args:
        max_loops: K, the largest loop count (>= 2).
        override_fraction: f in [0, 1] of eq. (3).
        weights: Relative probability of the shared k = 2..K at step 0 (``None``: uniform).
        final_weights: The same from step ``ramp_steps`` on.
        ramp_steps: Steps over which the weights move (>= 1).
        hold_steps: Steps at ``final_weights`` after the ramp, for the training-average figures only.
    """

    def __init__(
        self,
        max_loops: int = 4,
        override_fraction: float = 0.15,
        weights: Optional[list[float]] = None,
        final_weights: Optional[list[float]] = None,
        ramp_steps: int = 1000,
        hold_steps: int = 0,
    ) -> None:
        super().__init__(max_loops=max_loops, override_fraction=override_fraction, weights=weights)
        if not isinstance(ramp_steps, int) or ramp_steps < 1:
            raise ValueError(f"LoopCurriculum.ramp_steps={ramp_steps!r} must be an integer >= 1")
        if not isinstance(hold_steps, int) or hold_steps < 0:
            raise ValueError(f"LoopCurriculum.hold_steps={hold_steps!r} must be an integer >= 0")
        uniform = [1.0 / (max_loops - 1)] * (max_loops - 1)
        self.weights = uniform if self.weights is None else self.weights
        self.final_weights = (
            uniform if final_weights is None else _normalised_weights(type(self).__name__, final_weights, max_loops - 1, "final_weights")
        )
        self.ramp_steps, self.hold_steps = ramp_steps, hold_steps

    def weights_at(self, step: int) -> list[float]:
        """The shared-k weights (2..K, summing to one) at optimizer step ``step``."""
        a = min(1.0, max(0, step) / self.ramp_steps)
        return [(1.0 - a) * w0 + a * w1 for w0, w1 in zip(self.weights, self.final_weights)]

    @override
    def shared_loops(self, seed: int, step: int) -> int:
        return step_rng(seed, step).choices(range(2, self.max_loops + 1), weights=self.weights_at(step))[0]

    @override
    def probabilities(self) -> list[float]:
        """P(k) for k = 1..K averaged over ``ramp_steps + hold_steps`` steps of training."""
        # The mix a = t / ramp_steps averages (ramp_steps - 1) / 2 over the ramp's steps and 1 over the hold.
        a = ((self.ramp_steps - 1) / 2 + self.hold_steps) / (self.ramp_steps + self.hold_steps)
        shared = [(1.0 - a) * w0 + a * w1 for w0, w1 in zip(self.weights, self.final_weights)]
        p1 = self.expected_p1()
        return [p1] + [(1.0 - p1) * w for w in shared]
