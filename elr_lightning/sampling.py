"""Loop samplers: which loop count k each shard of each optimizer step runs (DESIGN §4).

A step has ``num_shards`` shards: data-parallel ranks times ``virtual_ranks`` slices of each local
batch. A sampler's schedule is a pure function of ``(seed, step, shard, num_shards)``, so every rank
knows every shard's k without communication and a resumed run replays it exactly.
"""

from __future__ import annotations

import math
import random


def step_rng(seed: int, step: int, stream: str = "") -> random.Random:
    """A generator that depends only on ``(seed, step, stream)`` (string seeds hash with SHA-512)."""
    return random.Random(f"elr:{seed}:{step}:{stream}")


class LoopSampler:
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
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
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

    def overridden(self, step: int, num_shards: int) -> list[int]:
        """Indices of the shards forced to k = 1 at ``step``."""
        rate = self.override_fraction * num_shards
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
