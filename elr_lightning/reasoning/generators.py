"""Synthetic reasoning tasks with a difficulty knob, deterministic from a seed, offline.

Every task draws instances ``(prompt, answer)``: the text a model reads and the short answer it must
produce after it (exact match). An instance written for training is ``prompt + answer``; a model is
scored by generating from ``prompt`` until a newline.

Training and held-out instances never overlap: an instance is *held out* when a hash of its task
name and prompt falls in one of :data:`HELDOUT_BUCKETS` of :data:`BUCKETS` buckets, and training
draws reject those (:func:`is_heldout`). The split depends on the text alone, so no seed, count or
difficulty of a training run can reach an evaluation instance.

Tasks (:data:`GENERATORS`):

* ``addition``: ``4821+937=`` -> ``5758``; difficulty = digits of each operand. The first answer
  digit depends on the carry chain through every lower digit.
* ``variables``: a program of single-letter assignments, three copy chains interleaved in execution
  order, then a query: ``e=4;k=e;u=7;r=k;z=u;r?`` -> ``4``; difficulty = copies between the constant
  and the queried variable (hops to follow).
* ``hops``: a random cycle over eight letters as a lookup table, then "where do h steps from x
  lead": ``a>c c>d b>a d>b a@3=`` -> ``b``; difficulty = h, the lookups in sequence. The table has the
  same size at every difficulty, so only the depth of the computation grows.
"""

from __future__ import annotations

import hashlib
import random
import string
from dataclasses import dataclass
from typing import Any

from typing_extensions import override

BUCKETS = 8
"""Buckets of the prompt hash that split instances into training and held-out."""

HELDOUT_BUCKETS = 1
"""Buckets (of :data:`BUCKETS`) reserved for held-out instances: 1/8 of every task's instance space."""

MAX_ATTEMPTS = 50
"""Draws per requested instance before a held-out set of a small instance space stops short."""


def check_seed(seed: Any, field: str = "seed") -> int:
    """``seed`` if it is an integer (not a bool), else a one-line ``ValueError`` naming ``field``."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"{field}={seed!r} is not an integer; give a whole number such as 0")
    return seed


def is_heldout(task: str, prompt: str) -> bool:
    """Whether the instance ``prompt`` of ``task`` belongs to the held-out split."""
    digest = hashlib.sha256(f"{task}\0{prompt}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % BUCKETS < HELDOUT_BUCKETS


class Generator:
    """A task: draws one instance of a given difficulty from a ``random.Random``.

    Contract: :meth:`draw` uses only ``rng`` for randomness (so a seed fixes every instance), returns
    a prompt that ends where the answer starts and an answer without a newline, and accepts every
    difficulty in ``[min_difficulty, max_difficulty]``. Subclasses set :attr:`name`,
    :attr:`min_difficulty`, :attr:`max_difficulty` and :attr:`chance` (the accuracy of guessing at
    the easiest level, for reports) and implement :meth:`draw`.
    """

    name: str = ""
    min_difficulty: int = 1
    max_difficulty: int = 1
    chance: float = 0.0

    def draw(self, difficulty: int, rng: random.Random) -> tuple[str, str]:
        """One ``(prompt, answer)`` of ``difficulty``."""
        raise NotImplementedError

    def difficulties(self) -> list[int]:
        """Every difficulty level, easiest first."""
        return list(range(self.min_difficulty, self.max_difficulty + 1))

    def check_difficulty(self, difficulty: Any) -> int:
        """``difficulty`` if it is an integer level of this task, else a one-line ``ValueError``."""
        lo, hi = self.min_difficulty, self.max_difficulty
        if isinstance(difficulty, bool) or not isinstance(difficulty, int) or not lo <= difficulty <= hi:
            raise ValueError(f"difficulty {difficulty!r} of reasoning task {self.name!r} is out of range; choose {lo}..{hi}")
        return difficulty


class Addition(Generator):
    """``a+b=`` -> ``a + b`` for two operands of ``difficulty`` digits each (no leading zero)."""

    name = "addition"
    max_difficulty = 8
    chance = 0.0

    @override
    def draw(self, difficulty: int, rng: random.Random) -> tuple[str, str]:
        lo = 10 ** (difficulty - 1) if difficulty > 1 else 0
        a, b = rng.randrange(lo, 10**difficulty), rng.randrange(lo, 10**difficulty)
        return f"{a}+{b}=", str(a + b)


class Variables(Generator):
    """Three copy chains of ``difficulty`` copies each, interleaved; query the end of one chain."""

    name = "variables"
    max_difficulty = 6
    chains = 3
    chance = 1.0 / 3.0

    @override
    def draw(self, difficulty: int, rng: random.Random) -> tuple[str, str]:
        names = rng.sample(string.ascii_lowercase, self.chains * (difficulty + 1))
        values = rng.sample(string.digits, self.chains)
        chains = []
        for c in range(self.chains):
            var = names[c * (difficulty + 1) : (c + 1) * (difficulty + 1)]
            chains.append([f"{var[0]}={values[c]}"] + [f"{var[i]}={var[i - 1]}" for i in range(1, difficulty + 1)])
        order = [c for c in range(self.chains) for _ in range(difficulty + 1)]
        rng.shuffle(order)
        heads = [0] * self.chains
        program = []
        for c in order:
            program.append(chains[c][heads[c]])
            heads[c] += 1
        target = rng.randrange(self.chains)
        query = names[target * (difficulty + 1) + difficulty]
        return ";".join(program) + f";{query}?", values[target]


class Hops(Generator):
    """Follow a random 8-cycle of letters ``difficulty`` steps from a start letter."""

    name = "hops"
    max_difficulty = 6
    letters = 8
    chance = 1.0 / 7.0

    @override
    def draw(self, difficulty: int, rng: random.Random) -> tuple[str, str]:
        cycle = rng.sample(string.ascii_lowercase, self.letters)
        step = {cycle[i]: cycle[(i + 1) % self.letters] for i in range(self.letters)}
        table = [f"{x}>{step[x]}" for x in cycle]
        rng.shuffle(table)
        start = rng.choice(cycle)
        end = start
        for _ in range(difficulty):
            end = step[end]
        return " ".join(table) + f" {start}@{difficulty}=", end


#: Every task by name.
GENERATORS: dict[str, Generator] = {g.name: g for g in (Addition(), Variables(), Hops())}


def get_generator(name: Any) -> Generator:
    """The task called ``name``, or a one-line ``ValueError`` listing the names there are."""
    if not isinstance(name, str) or name not in GENERATORS:
        raise ValueError(f"unknown reasoning task {name!r}; choose one of {', '.join(GENERATORS)}")
    return GENERATORS[name]


@dataclass(frozen=True)
class Instance:
    """One drawn instance."""

    task: str
    difficulty: int
    prompt: str
    answer: str

    @property
    def text(self) -> str:
        """The training text: prompt, answer and a newline."""
        return f"{self.prompt}{self.answer}\n"


def _stream(task: str, difficulty: int, n: int, seed: int, split: str, least: int) -> tuple[Generator, random.Random]:
    """The task's generator and the random stream of one split, after checking every argument."""
    generator = get_generator(task)
    generator.check_difficulty(difficulty)
    check_seed(seed)
    if n < least:
        raise ValueError(f"n={n} must be >= {least}")
    # Seeding with a string hashes it (SHA-512): the same stream on every platform and Python 3 version.
    return generator, random.Random(f"elr-reasoning/{split}/{task}/{difficulty}/{seed}")


def training_instances(task: str, difficulty: int, n: int, seed: int = 0) -> list[Instance]:
    """``n`` training instances of ``task`` at ``difficulty`` (repeats allowed, held-out ones never).

    Raises:
        ValueError: Unknown task, difficulty out of range, ``n`` below 0 or a seed that is not an integer.
    """
    generator, rng = _stream(task, difficulty, n, seed, "train", least=0)
    out = []
    while len(out) < n:
        prompt, answer = generator.draw(difficulty, rng)
        if not is_heldout(task, prompt):
            out.append(Instance(task, difficulty, prompt, answer))
    return out


def heldout_instances(task: str, difficulty: int, n: int, seed: int = 0) -> list[Instance]:
    """Up to ``n`` distinct held-out instances of ``task`` at ``difficulty``.

    Fewer come back when the level's held-out space is smaller than ``n`` (one-digit addition has
    100 instances, 14 of them held out): drawing stops after ``MAX_ATTEMPTS * n`` draws.

    Raises:
        ValueError: Unknown task, difficulty out of range, ``n`` below 1 or a seed that is not an integer.
    """
    generator, rng = _stream(task, difficulty, n, seed, "heldout", least=1)
    seen: dict[str, Instance] = {}
    for _ in range(MAX_ATTEMPTS * n):
        prompt, answer = generator.draw(difficulty, rng)
        if prompt not in seen and is_heldout(task, prompt):
            seen[prompt] = Instance(task, difficulty, prompt, answer)
            if len(seen) == n:
                break
    return list(seen.values())


def parse_levels(spec: Any, task: str) -> list[int]:
    """Difficulty levels of ``task`` from ``None`` (all), an integer, ``"lo-hi"`` or a list of integers.

    Raises:
        ValueError: A level out of the task's range, or a spec of another form.
    """
    generator = get_generator(task)
    if spec is None:
        return generator.difficulties()
    if isinstance(spec, str) and "-" in spec[1:]:
        lo, _, hi = spec.partition("-")
        try:
            spec = list(range(int(lo), int(hi) + 1))
        except ValueError:
            raise ValueError(f"difficulty {spec!r} of reasoning task {task!r} is not a range like 1-4") from None
    levels = spec if isinstance(spec, list) else [spec]
    if not levels:
        raise ValueError(f"difficulty of reasoning task {task!r} is an empty list; give levels or null for all")
    return sorted({generator.check_difficulty(level) for level in levels})
