"""The ``elr_reasoning`` harness tasks: their dataset hook, and accuracy per difficulty level in ``elr eval``.

Each task ``elr_reasoning_<task>_d<level>`` holds the held-out instances of one synthetic reasoning
task (:mod:`elr_lightning.reasoning`) at one difficulty, built in memory from the seed (nothing is
written or downloaded). ``elr eval`` adds a view of their scores by task, level and k to
``summary.json`` (key ``reasoning``), prints it as a table and plots it to ``reasoning_vs_k.png``.
"""

from __future__ import annotations

import re
from typing import Any

from elr_lightning.reasoning import heldout_instances

#: The harness group of the reasoning tasks.
REASONING_GROUP = "elr_reasoning"

_TASK = re.compile(rf"^{REASONING_GROUP}_(?P<task>[a-z]+)_d(?P<level>\d+)$")


def load_reasoning(
    generator: str, difficulty: int, n: int = 100, seed: int = 0, **_: Any
) -> dict[str, Any]:
    """The harness's ``custom_dataset`` hook: ``{"test": Dataset}`` of ``n`` held-out instances.

    Args:
        generator: Task name (``addition``, ``variables``, ``hops``).
        difficulty: Its level.
        n: Instances (``--metadata '{"n": 200}'``); fewer where the level has fewer.
        seed: Seed of the held-out draw (``--metadata '{"seed": 1}'``).
    """
    import datasets

    instances = heldout_instances(generator, difficulty, int(n), seed)
    return {"test": datasets.Dataset.from_list([{"prompt": i.prompt, "answer": i.answer} for i in instances])}


def by_difficulty(summary: dict[str, Any]) -> dict[str, dict[int, dict[int, float]]]:
    """``{task: {level: {k: exact match}}}`` of the reasoning tasks in an ``elr eval`` summary (empty if none)."""
    table: dict[str, dict[int, dict[int, float]]] = {}
    for name, scores in summary["tasks"].items():
        match = _TASK.match(name)
        if match:
            table.setdefault(match["task"], {})[int(match["level"])] = dict(scores["scores"])
    return {task: dict(sorted(levels.items())) for task, levels in sorted(table.items())}
