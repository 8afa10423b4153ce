"""``ReasoningTextDataModule``: a ``TextDataModule`` whose corpus starts with synthetic reasoning documents.

The synthetic training instances (:mod:`~elr_lightning.reasoning.generators`) are written once to a
JSONL file in ``cache_dir`` and put in front of ``data.sources``; everything else (tokenising,
caching, windows, the resumable loader, the validation split at the tail of the stream) is
:class:`~elr_lightning.data.TextDataModule`'s. The text sources come last, so validation still
measures the text. The file's name hashes its settings and its modification time is fixed, so every
process that writes it writes the same bytes with the same signature, and the token cache stays
valid across runs.

Packing (the default): each synthetic document holds whole instances and is padded with newlines to
exactly one window of the token stream (``seq_len`` tokens with the separator that follows it), so
every training window over the synthetic part starts at an instance and no instance is cut in two
(:func:`pack_windows`). Unpacked, a window boundary falls inside about one instance in five at
64-byte windows of addition and one in three at 128-byte windows of ``hops``.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import warnings
from typing import Any, Callable, Optional, Union

from typing_extensions import override

from elr_lightning.files import write_atomically
from elr_lightning.data import TextDataModule
from elr_lightning.reasoning.generators import GENERATORS, check_seed, parse_levels, training_instances

FORMAT = 2
"""Version of the synthetic documents; part of their file name, bumped when a generator or the packing changes."""

FILLER = "\n"
"""Text that pads a packed document to its window: an empty line, what follows every answer anyway."""


def reasoning_texts(tasks: dict[str, Any], examples_per_level: int, seed: int) -> list[str]:
    """Every task and level's training instances as texts (prompt, answer, newline), shuffled.

    Args:
        tasks: Task name -> difficulty levels (see :func:`~elr_lightning.reasoning.generators.parse_levels`).
        examples_per_level: Instances of each task at each level.
        seed: Seed of the draw and the shuffle.
    """
    texts = []
    for task, spec in tasks.items():
        for level in parse_levels(spec, task):
            texts.extend(i.text for i in training_instances(task, level, examples_per_level, seed))
    random.Random(f"elr-reasoning/mix/{seed}").shuffle(texts)
    return texts


def reasoning_documents(
    tasks: dict[str, Any], examples_per_level: int, seed: int, per_document: int = 32
) -> list[str]:
    """The synthetic training documents unpacked: :func:`reasoning_texts` joined ``per_document`` at a time."""
    texts = reasoning_texts(tasks, examples_per_level, seed)
    return ["".join(texts[i : i + per_document]) for i in range(0, len(texts), per_document)]


def pack_windows(texts: list[str], size: int, count: Callable[[str], int]) -> list[str]:
    """Whole instance texts packed, in order, into documents of exactly ``size`` tokens each.

    A document takes instances while their token counts sum to at most ``size`` (each text is
    counted once), then :data:`FILLER` up to ``size`` tokens of the whole document. With
    ``size = seq_len - len(separator)`` every document and the separator after it fill one stride of
    the token stream, so window ``i`` (tokens ``[i * seq_len, i * seq_len + seq_len + 1)``) starts
    at document ``i``'s first instance.

    Args:
        texts: Instance texts, each ending with a newline.
        size: Tokens per document.
        count: Tokens of a text under the data's tokenizer.

    Returns:
        The documents. One that the tokenizer cannot pad to exactly ``size`` tokens (a merge of
        filler with its neighbours) stays shorter, with a warning: later windows then start
        mid-instance again.

    Raises:
        ValueError: One instance alone takes more than ``size`` tokens.
    """
    docs: list[str] = []
    inexact = 0

    def close(doc: str) -> None:
        nonlocal inexact
        pad = max(0, size - count(doc))
        while pad and count(doc + FILLER * pad) > size:  # tokens that join across texts: never past size
            pad -= 1
        docs.append(doc + FILLER * pad)
        inexact += count(docs[-1]) != size

    doc, used = "", 0
    for text in texts:
        n = count(text)
        if n > size:
            raise ValueError(
                f"data.seq_len: a reasoning instance of {n} tokens does not fit a window of {size} "
                "(seq_len less the document separator); raise data.seq_len or set data.pack: false"
            )
        if doc and used + n > size:
            close(doc)
            doc, used = "", 0
        doc, used = doc + text, used + n
    if doc:
        close(doc)
    if inexact:
        warnings.warn(
            f"data.pack: the tokenizer merges the newline filler, so {inexact} of {len(docs)} reasoning "
            "documents are not exactly one window; windows after them may cut instances",
            stacklevel=2,
        )
    return docs


class ReasoningTextDataModule(TextDataModule):
    """Synthetic reasoning documents first, then the text of ``sources`` (the standard library by default).

    Args:
        reasoning_tasks: Task name -> difficulty levels (``null`` for all, an integer, ``"lo-hi"``
            or a list); default every task of :data:`~elr_lightning.reasoning.generators.GENERATORS`
            at every level.
        examples_per_level: Training instances per task and level.
        text_bytes: Keep only this many UTF-8 bytes of the text sources (sets ``max_bytes`` to the
            synthetic bytes plus this); ``null`` keeps all of it.
        pack: Pack whole instances into documents of one window each, padded with newlines
            (:func:`pack_windows`), so no training window cuts an instance; ``false`` joins 32
            instances per document and lets windows fall anywhere.
        **kwargs: :class:`~elr_lightning.data.TextDataModule`'s arguments (``sources``, ``seq_len``,
            ``seed``, ...). ``seed`` also seeds the synthetic draw.

    Raises:
        ValueError: An unknown task, a level out of range, a seed that is not an integer, a count
            below 1, both ``text_bytes`` and ``max_bytes``, or (packed) an instance longer than a window.
    """

    def __init__(
        self,
        reasoning_tasks: Optional[dict[str, Any]] = None,
        examples_per_level: int = 2000,
        text_bytes: Optional[int] = None,
        pack: bool = True,
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
        self.pack = pack
        if pack:
            size = self.seq_len - len(self.separator())
            texts = reasoning_texts(self.reasoning_tasks, examples_per_level, self.seed)
            self.documents = pack_windows(texts, size, lambda text: len(self.tokenizer.encode(text)))
        else:
            self.documents = reasoning_documents(self.reasoning_tasks, examples_per_level, self.seed)
        synthetic_bytes = sum(len(doc.encode("utf-8")) for doc in self.documents)
        if text_bytes is not None:
            self.max_bytes = synthetic_bytes + text_bytes
        layout = [self.seq_len, self.tokenizer.fingerprint()] if pack else None
        settings = json.dumps([FORMAT, self.reasoning_tasks, examples_per_level, self.seed, layout], sort_keys=True)
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
