"""Token-level depth tasks: a label at (almost) every position, a difficulty knob, samples from a seed.

Every task has its own small alphabet (one character per token id) and draws a batch of instances
of one difficulty as ``(input_ids, labels, levels)``, each ``[B, T]``: ``labels[b, t]`` is the target
of the prediction made at position t (position-aligned, the supervised-batch contract), or
``IGNORE_INDEX``; ``levels[b, t]`` is that label's own difficulty (how many steps it needs), 0 where
there is no label. An instance of difficulty D holds labels of every level 1..D.
"""

from __future__ import annotations

import hashlib

import numpy as np

from elr_lightning.batches import IGNORE_INDEX


class DepthTask:
    """Seam contract for a token-level depth task.

    Subclasses set :attr:`name`, :attr:`alphabet` (token id ``i`` is ``alphabet[i]``),
    :attr:`min_difficulty` (an instance of it has at least :attr:`key_length` tokens, the prefix
    that decides the held-out split, :func:`is_heldout`), :attr:`chance` (accuracy of a guess per
    label) and implement
    :meth:`length` and :meth:`draw`. ``draw`` uses only ``rng`` for randomness, returns sequences of
    exactly ``length(difficulty)`` tokens and labels every level from 1 to ``difficulty``.
    """

    name: str = ""
    alphabet: str = ""
    min_difficulty: int = 1
    max_difficulty: int = 1
    key_length: int = 1
    chance: float = 0.0

    @property
    def vocab_size(self) -> int:
        """Tokens in the alphabet."""
        return len(self.alphabet)

    def check_difficulty(self, difficulty: object, field: str = "difficulty") -> int:
        """``difficulty`` if it is an integer in this task's range, else a one-line ``ValueError`` naming ``field``."""
        lo, hi = self.min_difficulty, self.max_difficulty
        if isinstance(difficulty, bool) or not isinstance(difficulty, int) or not lo <= difficulty <= hi:
            raise ValueError(f"{field}={difficulty!r} is out of range for depth task {self.name!r}; choose {lo}..{hi}")
        return difficulty

    def length(self, difficulty: int) -> int:
        """Tokens of an instance of ``difficulty``."""
        raise NotImplementedError

    def draw(self, rng: np.random.Generator, batch: int, difficulty: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(input_ids, labels, levels)``, each ``int64 [batch, length(difficulty)]``."""
        raise NotImplementedError


class PrefixParity(DepthTask):
    """A start mark, then bits; the parity of every prefix out: the label at bit t is the xor of bits 0..t.

    Difficulty n: n bits after the start mark ``^``, which has no label. The label at bit t has level
    t + 1 (the bits it sums). Labels are the bits ``0``/``1`` themselves, so after a prompt ``^`` +
    bits the next token a model generates is the prompt's parity bit. The mark is what lets softmax
    attention count: without it, a row of equal bits at the start (``11``, ``111``, ...) gives every
    position the same average of the same values, so ``11`` (parity 0) reads as ``1`` (parity 1), and
    the quarter of all strings that start with ``11`` can never be solved (measured: exact match held
    at 78.9% for every k on 8-bit held-out strings, every error at bit 1).
    """

    name = "parity"
    alphabet = "01^"
    min_difficulty = 8
    key_length = 9
    max_difficulty = 1024
    chance = 0.5

    def length(self, difficulty: int) -> int:
        return difficulty + 1

    def draw(self, rng: np.random.Generator, batch: int, difficulty: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        bits = rng.integers(0, 2, size=(batch, difficulty), dtype=np.int64)
        start = np.full((batch, 1), self.alphabet.index("^"), dtype=np.int64)
        ids = np.concatenate([start, bits], axis=1)
        labels = np.concatenate([np.full_like(start, IGNORE_INDEX), np.cumsum(bits, axis=1) % 2], axis=1)
        levels = np.broadcast_to(np.arange(difficulty + 1), ids.shape).copy()
        return ids, labels, levels


class FindRoot(DepthTask):
    """Find the root: a forest of chains written as relative pointers; the label at every node is its root's colour.

    ``roots`` chains, each of a random depth in 1..D (one of depth D exactly), interleaved at random
    over the positions. A root is written as its colour (``A``..``D``); every other node as the
    distance back to its parent, ``1``..``9`` (interleavings with a longer gap are drawn again). The
    label at each node is its root's colour, with the node's depth (pointers to follow) as level;
    roots have none; a shorter forest is padded at the end with ``A``, unlabelled. Difficulty D: the
    deepest chain. One pass of attention reads a parent at a given distance, so a node of depth d
    needs d lookups in sequence; following pointers reaches a fixed point at the root, so more steps
    than needed change nothing. After a prompt, the next token a model generates is the colour of
    the last node's root. Difficulties go up to 24, four times the depth quickstart's training
    depth; beyond it the interleavings whose gaps all fit in one digit get rare (a forest of depth
    24 takes about 20 ms to draw, one of 32 over a second).
    """

    name = "root"
    alphabet = "123456789ABCD"
    roots = 4
    max_difficulty = 24
    key_length = 8
    chance = 1.0 / 4

    def length(self, difficulty: int) -> int:
        return self.roots * (difficulty + 1)

    def draw(self, rng: np.random.Generator, batch: int, difficulty: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        t = self.length(difficulty)
        colour = self.alphabet.index("A")
        ids = np.zeros((batch, t), dtype=np.int64)
        labels = np.full((batch, t), IGNORE_INDEX, dtype=np.int64)
        levels = np.zeros((batch, t), dtype=np.int64)
        for b in range(batch):
            depths = rng.integers(1, difficulty + 1, size=self.roots)
            depths[rng.integers(self.roots)] = difficulty
            order = np.concatenate([np.full(d + 1, c) for c, d in enumerate(depths)])
            while True:
                rng.shuffle(order)
                starts = np.flatnonzero(np.r_[True, np.diff(np.sort(order, kind="stable")) != 0])
                by_chain = np.argsort(order, kind="stable")  # positions of chain 0, then chain 1, ...
                gaps = np.diff(by_chain)
                gaps[starts[1:] - 1] = 0  # the step from one chain's last node to the next chain's root
                if gaps.max(initial=0) <= 9:
                    break
            colours = rng.permutation(self.roots)
            last, depth = {}, {}
            for pos, c in enumerate(order):
                if c not in last:
                    ids[b, pos] = colour + colours[c]
                    depth[c] = 0
                else:
                    ids[b, pos] = pos - last[c] - 1  # id of the digit "pos - last[c]"
                    depth[c] += 1
                    labels[b, pos] = colour + colours[c]
                    levels[b, pos] = depth[c]
                last[c] = pos
            ids[b, len(order) :] = colour  # padding after a shorter forest: a lone root, unlabelled
        return ids, labels, levels


class MultiAddition(DepthTask):
    """Operands of ``width`` digits, least significant first, joined by ``+``; labels: the running sum.

    The label at each digit of operand j is the same digit of ``a_1 + ... + a_j`` mod 10^width, with
    level j; ``+`` has none. Difficulty m: m operands.
    """

    name = "addition"
    alphabet = "0123456789+"
    width = 2
    min_difficulty = 2
    max_difficulty = 256
    key_length = 5
    chance = 0.1

    def length(self, difficulty: int) -> int:
        return difficulty * (self.width + 1) - 1

    def draw(self, rng: np.random.Generator, batch: int, difficulty: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        w, mod = self.width, 10**self.width
        operands = rng.integers(0, mod, size=(batch, difficulty), dtype=np.int64)
        sums = np.cumsum(operands, axis=1) % mod
        powers = 10 ** np.arange(w)
        digits = operands[:, :, None] // powers % 10  # [B, m, w], least significant first
        sum_digits = sums[:, :, None] // powers % 10
        plus = np.full((batch, difficulty, 1), self.alphabet.index("+"), dtype=np.int64)
        ids = np.concatenate([digits, plus], axis=2).reshape(batch, -1)[:, :-1]
        labels = np.concatenate([sum_digits, np.full_like(plus, IGNORE_INDEX)], axis=2).reshape(batch, -1)[:, :-1]
        level = np.broadcast_to(np.arange(1, difficulty + 1)[None, :, None], (batch, difficulty, w + 1))
        levels = np.where(labels != IGNORE_INDEX, np.concatenate([level[..., :w], np.zeros_like(plus)], axis=2).reshape(batch, -1)[:, :-1], 0)
        return ids, labels, levels


#: Every task by name.
TASKS: dict[str, DepthTask] = {t.name: t for t in (PrefixParity(), FindRoot(), MultiAddition())}


def get_task(name: object, field: str = "task") -> DepthTask:
    """The task called ``name``, or a one-line ``ValueError`` naming ``field`` and the tasks there are."""
    if name not in TASKS:
        raise ValueError(f"{field}={name!r} is not a depth task; choose one of {', '.join(TASKS)}")
    return TASKS[name]  # type: ignore[index]


BUCKETS = 8
"""Buckets of an instance's key hash: bucket 0 is held out for evaluation, the rest is training data."""


def is_heldout(task: DepthTask, ids: np.ndarray) -> bool:
    """Whether the instance ``ids`` (one row) of ``task`` belongs to the held-out split.

    The split hashes the task's name and the instance's first :attr:`DepthTask.key_length` tokens,
    so it depends on the text alone: training draws reject held-out keys (:func:`draw`), so no
    training sequence starts like an evaluation instance, at any difficulty.
    """
    key = np.ascontiguousarray(ids[: task.key_length], dtype=np.int64).tobytes()
    digest = hashlib.blake2b(task.name.encode() + b"\0" + key, digest_size=8).digest()
    return int.from_bytes(digest, "big") % BUCKETS == 0


def draw(task: DepthTask, rng: np.random.Generator, difficulty: int, heldout: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One instance ``(ids, labels, levels)`` (rows of :meth:`DepthTask.draw`) from the training or held-out split."""
    while True:
        ids, labels, levels = task.draw(rng, 1, difficulty)
        if is_heldout(task, ids[0]) == heldout:
            return ids[0], labels[0], levels[0]
