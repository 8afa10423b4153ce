"""Offline evaluation tasks built from held-out text of the default corpus (the standard library).

``TextDataModule`` holds out the last ``val_fraction`` of its token stream for validation: with the
default corpus that is the tail of the standard-library sources in their sorted order. The builders
here read the same files in the same order (:func:`~elr_lightning.data.default_corpus_files`), keep
the lines that start inside the last ``0.9 * val_fraction`` of the corpus bytes (a margin for the
rounding to whole windows; exact for the byte tokenizer, whose tokens are bytes), and draw examples
from them with a seeded generator. Nothing is downloaded and nothing large is shipped: the JSONL
files are rebuilt on demand, identically for a seed and a Python version.

Tasks:

* ``line_end`` (multiple choice): given the preceding lines and the first half of a line, pick its
  true second half among four second halves of held-out lines. Chance is 25%. (Picking the true
  next line among lines of the same indentation was tried first: the quickstart model scored
  0.28 there, too close to chance to tell models apart.)
* ``complete_line`` (generation): given the preceding lines and the start of a line, generate the
  rest of it, a final identifier of 3 or more characters and the punctuation after it, up to the
  newline; scored by exact match. Chance is near 0.
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
from functools import lru_cache
from typing import Any, Optional

from elr_lightning.files import write_file
from elr_lightning.data import default_corpus_files, iter_documents

FORMAT = 1
"""Version of the task files; bump it when a builder changes, so cached files are rebuilt."""

#: Task name -> number of choices (``None`` for generation tasks): the chance level is ``1 / n``.
TASKS: dict[str, Optional[int]] = {"line_end": 4, "complete_line": None}

CONTEXT_CHARS = 96
"""Most characters of preceding text in a context (the quickstart trains on 128-byte windows)."""

_LINE_CHARS = (8, 48)
"""Lengths (stripped) of the lines examples are made of."""
_TAIL = re.compile(r"[A-Za-z_][A-Za-z0-9_]{2,}[^\sA-Za-z0-9_]{0,3}$")


def default_data_dir() -> str:
    """Where the task files live unless told otherwise: ``$ELR_EVAL_DATA`` or a per-user cache."""
    return os.environ.get("ELR_EVAL_DATA") or os.path.join(
        os.path.expanduser("~"), ".cache", "elr_lightning", "eval_tasks"
    )


@lru_cache(maxsize=2)
def heldout_text(val_fraction: float = 0.01) -> str:
    """The text of the default corpus that ``TextDataModule`` holds out for validation.

    Args:
        val_fraction: ``data.val_fraction`` of the training run (0.01 by default).

    Returns:
        The documents' text from the first line that starts in the last ``0.9 * val_fraction`` of
        the corpus bytes (documents joined by newlines, as the data module joins them).
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be strictly between 0 and 1")
    text = "\n".join(iter_documents(default_corpus_files()))
    data = text.encode("utf-8")
    start = int(len(data) * (1.0 - 0.9 * val_fraction))
    start = data.index(b"\n", start) + 1
    return data[start:].decode("utf-8", errors="replace")


def _context(lines: list[str], index: int, prefix: str = "") -> Optional[str]:
    """The preceding lines (cut to :data:`CONTEXT_CHARS` at a line start) plus ``prefix``; ``None`` if too short."""
    before = ""
    for line in reversed(lines[max(0, index - 12) : index]):
        if len(before) + len(line) + 1 + len(prefix) > CONTEXT_CHARS:
            break
        before = line + "\n" + before
    return before + prefix if len(before) >= 24 else None


def _candidate(line: str) -> bool:
    stripped = line.strip()
    return _LINE_CHARS[0] <= len(stripped) <= _LINE_CHARS[1] and not stripped.startswith("#")


def build_line_end(lines: list[str], n: int, rng: random.Random) -> list[dict[str, Any]]:
    """Multiple-choice examples: the true second half of a line among the second halves of other lines."""
    n_choices = TASKS["line_end"] or 0
    split = []
    for i, line in enumerate(lines):
        if _candidate(line) and len(line.strip()) >= 16:
            cut = len(line) - len(line.lstrip()) + len(line.strip()) // 2
            split.append((i, line[:cut], line[cut:]))
    pool = sorted({rest for _, _, rest in split})
    rng.shuffle(split)
    examples = []
    for i, prefix, rest in split:
        context = _context(lines, i, prefix)
        if context is None:
            continue
        choices = rng.sample([r for r in pool if r != rest], n_choices - 1)
        label = rng.randrange(n_choices)
        choices.insert(label, rest)
        examples.append({"context": context, "choices": choices, "label": label})
        if len(examples) == n:
            break
    return examples


def build_complete_line(lines: list[str], n: int, rng: random.Random) -> list[dict[str, Any]]:
    """Generation examples: the final identifier (and closing punctuation) of a line, up to the newline."""
    order = [i for i, line in enumerate(lines) if _candidate(line) and _TAIL.search(line)]
    rng.shuffle(order)
    examples = []
    for i in order:
        match = _TAIL.search(lines[i])
        assert match is not None
        prefix, target = lines[i][: match.start()], match.group()
        context = _context(lines, i, prefix)
        if context is None or not prefix.strip():
            continue
        examples.append({"context": context, "target": target})
        if len(examples) == n:
            break
    return examples


def build_tasks(out_dir: str, seed: int = 0, n: int = 500, val_fraction: float = 0.01) -> dict[str, str]:
    """Write ``<task>.jsonl`` for every task of :data:`TASKS` into ``out_dir``.

    Args:
        out_dir: Folder to write into (created if needed).
        seed: Seed of the example draw; the same seed gives the same files.
        n: Examples per task (fewer if the held-out text has fewer candidates).
        val_fraction: ``data.val_fraction`` of the run being evaluated.

    Returns:
        Task name -> path of its file.
    """
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    lines = heldout_text(val_fraction).split("\n")
    builders = {"line_end": build_line_end, "complete_line": build_complete_line}
    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    for offset, (name, build) in enumerate(builders.items()):
        examples = build(lines, n, random.Random(seed * 1000 + offset))
        path = os.path.join(out_dir, f"{name}.jsonl")
        write_file(path, "".join(json.dumps(example, ensure_ascii=False) + "\n" for example in examples))
        paths[name] = path
    write_file(os.path.join(out_dir, "meta.json"), json.dumps(_meta(seed, n, val_fraction)))
    return paths


def _meta(seed: int, n: int, val_fraction: float) -> dict[str, Any]:
    return {"format": FORMAT, "seed": seed, "n": n, "val_fraction": val_fraction, "python": sys.version.split()[0]}


def _built(folder: str, seed: int, n: int, val_fraction: float) -> bool:
    """Whether ``folder`` holds every task's file, built by this version with these settings."""
    try:
        with open(os.path.join(folder, "meta.json"), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return False
    files = all(os.path.isfile(os.path.join(folder, f"{name}.jsonl")) for name in TASKS)
    return files and meta == _meta(seed, n, val_fraction)


def load_task(
    name: str, data_dir: Optional[str] = None, seed: int = 0, n: int = 500, val_fraction: float = 0.01, **_: Any
) -> Any:
    """The harness's ``custom_dataset`` hook: ``{"test": Dataset}`` of a task, built first if needed.

    The files are (re)built when missing or written with other settings or by another version.

    Args:
        name: A key of :data:`TASKS`.
        data_dir: Folder of the JSONL files (``--metadata '{"data_dir": ...}'``); default
            :func:`default_data_dir`.
        seed: Seed used when the files must be built.
        n: Examples per task when the files must be built.
        val_fraction: ``data.val_fraction`` of the evaluated run.
    """
    import datasets

    if name not in TASKS:
        raise ValueError(f"unknown local task {name!r}; choose one of {sorted(TASKS)}")
    folder = data_dir or default_data_dir()
    if not _built(folder, int(seed), int(n), float(val_fraction)):
        build_tasks(folder, seed=int(seed), n=int(n), val_fraction=float(val_fraction))
    with open(os.path.join(folder, f"{name}.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return {"test": datasets.Dataset.from_list(records)}
