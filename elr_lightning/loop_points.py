"""The ``--loops`` grammar of every ``elr`` command, and the adaptive-depth points of ``elr eval``.

One grammar, :class:`LoopSpec`: a loop count ``3``, a list ``1,2,3``, a range ``1-4``, ``auto``
(depth per token), or a mix such as ``1-3,auto``. Each command says which forms it takes
(:func:`elr_lightning.arguments.add_loops`).
"""

from __future__ import annotations

import math
import warnings
from typing import Literal, Union

__all__ = ["LoopSpec", "auto_label", "parse_loops", "parse_points", "parse_thresholds"]


class LoopSpec(str):
    """A value of ``--loops``: the loop counts and whether adaptive depth (``auto``) is asked for.

    ``LoopSpec("1-3,auto")`` reads the grammar; the string itself is the normal form (``"1,2,3,auto"``),
    which :func:`parse_points` reads again.

    Attributes:
        counts: Distinct loop counts, sorted.
        auto: ``auto`` was given: depth chosen per token.

    Raises:
        ValueError: A part that is neither a loop count >= 1, a range nor ``auto``, naming it.
    """

    counts: tuple[int, ...]
    auto: bool

    def __new__(cls, text: Union[str, int]) -> LoopSpec:
        counts, auto = parse_points(str(text))
        spec = super().__new__(cls, ",".join([*map(str, counts), *(["auto"] if auto else [])]))
        spec.counts, spec.auto = tuple(counts), auto
        return spec

    @property
    def single(self) -> Union[int, Literal["auto"]]:
        """The one loop count, or ``"auto"``, of a spec that holds one of them.

        Raises:
            ValueError: The spec holds several.
        """
        if len(self.counts) + self.auto != 1:
            raise ValueError(f"--loops {self}: give one loop count or auto, e.g. --loops 2")
        return "auto" if self.auto else self.counts[0]


def parse_loops(spec: str) -> list[int]:
    """``"1,2,4"`` or ``"1-4"`` -> sorted distinct loop counts.

    Raises:
        ValueError: A part is not an integer, or a count is below 1.
    """
    loops: set[int] = set()
    for part in str(spec).split(","):
        part = part.strip()
        bounds = part.split("-", 1) if "-" in part[1:] and not part.startswith("-") else (part, part)
        try:
            lo, hi = int(bounds[0]), int(bounds[1])
        except ValueError:
            raise ValueError(f"--loops {spec!r}: {part!r} is not a loop count; write e.g. --loops 1,2,4 or 1-4") from None
        if hi < lo:
            raise ValueError(f"--loops {spec!r}: the range {part!r} is empty; write the smaller count first")
        loops.update(range(lo, hi + 1))
    if not loops or min(loops) < 1:
        raise ValueError(f"--loops {spec!r}: every loop count must be >= 1")
    return sorted(loops)


def parse_points(spec: str) -> tuple[list[int], bool]:
    """``"1-3,auto"`` -> the loop counts (:func:`parse_loops`) and whether adaptive depth (``auto``) is asked for.

    Raises:
        ValueError: A part is neither a loop count nor ``auto``.
    """
    parts = [part.strip() for part in str(spec).split(",")]
    fixed = ",".join(part for part in parts if part != "auto")
    return (parse_loops(fixed) if fixed else []), "auto" in parts


def parse_thresholds(spec: str) -> list[float]:
    """``"0.01,1e-3"`` -> distinct exit thresholds in the order given.

    Raises:
        ValueError: A part is not a finite number >= 0.
    """
    out: list[float] = []
    for part in str(spec).split(","):
        try:
            value = float(part)
        except ValueError:
            value = float("nan")
        if not (value >= 0 and math.isfinite(value)):
            raise ValueError(f"--threshold {spec!r}: {part.strip()!r} is not a number >= 0; write e.g. --threshold 0.01,0.001")
        if value not in out:
            out.append(value)
    return out


def auto_label(criterion: str, threshold: float) -> str:
    """The name of an adaptive point in ``summary.json`` and the table, e.g. ``auto:kl:0.001``."""
    return f"auto:{criterion}:{threshold:g}"


def check_loops(
    loops: int, max_loops: int, allow_extrapolation: bool, field: str = "loops", flag: str = "allow_extrapolation=true"
) -> None:
    """Refuse a loop count below 1, or above the trained budget unless extrapolation is allowed.

    Args:
        loops: The loop count k.
        max_loops: The checkpoint's ``arch.max_loops``.
        allow_extrapolation: Accept ``loops > max_loops`` (with a warning).
        field: Name of the argument, for the message.
        flag: How the caller allows extrapolation, for the message.

    Raises:
        ValueError: Naming the field and the fix.
    """
    if loops < 1:
        raise ValueError(f"{field}={loops} must be >= 1")
    if loops > max_loops:
        message = f"{field}={loops} is above the checkpoint's arch.max_loops={max_loops}, the loop budget it was trained for"
        if not allow_extrapolation:
            raise ValueError(f"{message}; pass {flag} to run it anyway")
        warnings.warn(f"{message}; extrapolating", stacklevel=3)
