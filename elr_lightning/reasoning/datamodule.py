"""``ReasoningTextDataModule``: a ``TextDataModule`` whose corpus starts with synthetic reasoning documents.

The synthetic training instances (:mod:`~elr_lightning.reasoning.generators`) are written once to a
JSONL file in ``cache_dir`` and put in front of ``data.sources``; everything else (tokenising,
caching, windows, the resumable loader, the validation split at the tail of the stream) is
:class:`~elr_lightning.data.TextDataModule`'s. The text sources come last, so validation still
measures the text. The file's name hashes its settings and its modification time is fixed, so every
process that writes it writes the same bytes with the same signature, and the token cache stays
valid across runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from typing import Any, Optional, Union

from typing_extensions import override

from elr_lightning.checkpoint_io import write_atomically
from elr_lightning.data import TextDataModule
from elr_lightning.reasoning.generators import GENERATORS, check_seed, parse_levels, training_instances

FORMAT = 1
"""Version of the synthetic documents; part of their file name, bumped when a generator changes."""


def reasoning_documents(
    tasks: dict[str, Any], examples_per_level: int, seed: int, per_document: int = 32
) -> list[str]:
    """The synthetic training documents: every task and level's instances, shuffled, packed in documents.

    Args:
        tasks: Task name -> difficulty levels (see :func:`~elr_lightning.reasoning.generators.parse_levels`).
        examples_per_level: Instances of each task at each level.
        seed: Seed of the draw and the shuffle.
        per_document: Instances per document (each ends with a newline).

    Returns:
        Document texts.
    """
    texts = []
    for task, spec in tasks.items():
        for level in parse_levels(spec, task):
            texts.extend(i.text for i in training_instances(task, level, examples_per_level, seed))
    random.Random(f"elr-reasoning/mix/{seed}").shuffle(texts)
    return ["".join(texts[i : i + per_document]) for i in range(0, len(texts), per_document)]


class ReasoningTextDataModule(TextDataModule):
    """Synthetic reasoning documents first, then the text of ``sources`` (the standard library by default).

    Args:
        reasoning_tasks: Task name -> difficulty levels (``null`` for all, an integer, ``"lo-hi"``
            or a list); default every task of :data:`~elr_lightning.reasoning.generators.GENERATORS`
            at every level.
        examples_per_level: Training instances per task and level.
        text_bytes: Keep only this many UTF-8 bytes of the text sources (sets ``max_bytes`` to the
            synthetic bytes plus this); ``null`` keeps all of it.
        **kwargs: :class:`~elr_lightning.data.TextDataModule`'s arguments (``sources``, ``seq_len``,
            ``seed``, ...). ``seed`` also seeds the synthetic draw.

    Raises:
        ValueError: An unknown task, a level out of range, a seed that is not an integer, a count
            below 1, or both ``text_bytes`` and ``max_bytes``.
    """

    def __init__(
        self,
        reasoning_tasks: Optional[dict[str, Any]] = None,
        examples_per_level: int = 2000,
        text_bytes: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        check_seed(self.seed, "data.seed")
        if examples_per_level < 1:
            raise ValueError(f"data.examples_per_level must be >= 1, got {examples_per_level}")
        if text_bytes is not None and (text_bytes < 1 or self.max_bytes is not None):
            raise ValueError(f"data.text_bytes={text_bytes} must be >= 1 and replaces data.max_bytes; set only one")
        tasks = dict.fromkeys(GENERATORS) if reasoning_tasks is None else dict(reasoning_tasks)
        try:
            self.reasoning_tasks = {task: parse_levels(spec, task) for task, spec in tasks.items()}
        except ValueError as err:
            raise ValueError(f"data.reasoning_tasks: {err}") from None
        self.examples_per_level = examples_per_level
        self.documents = reasoning_documents(self.reasoning_tasks, examples_per_level, self.seed)
        synthetic_bytes = sum(len(doc.encode("utf-8")) for doc in self.documents)
        if text_bytes is not None:
            self.max_bytes = synthetic_bytes + text_bytes
        settings = json.dumps([FORMAT, self.reasoning_tasks, examples_per_level, self.seed], sort_keys=True)
        name = f"reasoning-{hashlib.sha256(settings.encode()).hexdigest()[:20]}.jsonl"
        self.reasoning_path = os.path.abspath(os.path.join(self.cache_dir, name))
        text_sources: Union[list[str], str, None] = self.sources
        if text_sources is None:
            from elr_lightning.data import default_corpus_files

            text_sources = default_corpus_files()
        self.sources = [self.reasoning_path] + ([text_sources] if isinstance(text_sources, str) else list(text_sources))

    def write_documents(self) -> str:
        """Write the synthetic documents' JSONL file unless it is there; return its path."""
        if not os.path.isfile(self.reasoning_path):
            lines = "".join(json.dumps({self.text_field: doc}) + "\n" for doc in self.documents)
            os.makedirs(os.path.dirname(self.reasoning_path), exist_ok=True)
            write_atomically(self.reasoning_path, lambda f: f.write(lines.encode("utf-8")))
            os.utime(self.reasoning_path, ns=(0, 0))
        return self.reasoning_path

    @override
    def prepare_data(self) -> None:
        """Write the synthetic documents, then tokenise the corpus as ``TextDataModule`` does."""
        self.write_documents()
        super().prepare_data()

    @override
    def setup(self, stage: Optional[str] = None) -> None:
        """Write the synthetic documents if absent, then open and split the token shard."""
        self.write_documents()
        super().setup(stage)
