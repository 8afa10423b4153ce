"""``PromptCompletionDataModule``: fine-tuning on prompt/completion JSONL, the prompt masked out of the loss.

Each line of the file is a JSON object ``{"prompt": ..., "completion": ...}`` (the keys are
configurable). An example is tokenised as the prompt's ids followed by the completion's ids and the
tokenizer's end mark (:func:`~elr_lightning.data.base.document_separator`: its end-of-sequence id,
or a newline for the byte tokenizer), each part encoded on its own, as ``elr generate`` encodes a
prompt before generating. Only the completion and the end mark are targets: the batch is labelled
(:mod:`elr_lightning.batches`) with ``labels[t] = ids[t + 1]`` where ``ids[t + 1]`` belongs to the
completion and ``IGNORE_INDEX`` on the prompt, the padding and the last position.

Every example is one sequence of ``seq_len`` positions (``seq_len + 1`` tokens less the last), padded
on the right; padding is never a target and, attention being causal, never seen by the positions
before it. Examples are not packed together: without an attention mask, a packed example would
attend to the ones before it in its row.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from lightning_utilities.core.rank_zero import rank_zero_info
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from elr_lightning.batches import INPUT_KEY, LABEL_KEY, next_token_labels
from elr_lightning.data.base import TokenDataModule, document_separator
from elr_lightning.data.sources import record_strings
from elr_lightning.data.windows import StepIndexedLoader
from elr_lightning.tokenizers import Tokenizer, load_tokenizer

#: Buckets of an example's hash; ``val_fraction`` of them hold the validation examples.
HASH_BUCKETS = 1 << 32


def is_validation(prompt: str, completion: str, val_fraction: float) -> bool:
    """Whether the example falls in the held-out split: a hash of its text, so duplicates land together."""
    digest = hashlib.sha256(prompt.encode("utf-8") + b"\0" + completion.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") < val_fraction * HASH_BUCKETS


@dataclass(frozen=True)
class Pair:
    """One prompt/completion example and the line it came from."""

    prompt: str
    completion: str
    line: int


def read_pairs(path: str, prompt_field: str, completion_field: str, option: str) -> list[Pair]:
    """Every example of a prompt/completion JSONL file; blank lines are skipped.

    Args:
        path: The file.
        prompt_field: Key of the prompt.
        completion_field: Key of the completion.
        option: How errors name the option that gave ``path`` (``data.path``, ``data.validation``).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: The file is not UTF-8 or holds no example, or a line is not a JSON object with
            both keys as strings; naming the file, the line and the key.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{option}: {path!r} does not exist; give the path of a prompt/completion .jsonl file")
    fields = {"data.prompt_field": prompt_field, "data.completion_field": completion_field}
    pairs = []
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if line.strip():
                    prompt, completion = record_strings(line, path, lineno, fields, option)
                    pairs.append(Pair(prompt, completion, lineno))
    except UnicodeDecodeError as err:
        raise ValueError(f"{option}: {path!r} is not UTF-8 text ({err.reason}); convert it to UTF-8") from err
    if not pairs:
        raise ValueError(
            f"{option}: {path!r} holds no example; give one JSON object per line with {list(fields.values())}"
        )
    return pairs


class PromptCompletionExamples(Dataset):
    """Tokenised examples, padded to ``seq_len`` positions when served; a labelled batch per :meth:`batch`.

    Args:
        prompts: Each example's prompt ids.
        completions: Each example's completion ids, end mark included (the targets).
        seq_len: Positions per sequence; ``len(prompt) + len(completion) <= seq_len + 1``.
        pad_id: Id placed after an example (never a target, never attended to by it).
    """

    def __init__(
        self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], seq_len: int, pad_id: int
    ) -> None:
        lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
        if max(lengths, default=0) > seq_len + 1:
            raise ValueError(f"an example of {max(lengths)} tokens exceeds seq_len + 1 = {seq_len + 1}")
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.offsets = np.cumsum([0] + lengths, dtype=np.int64)
        self.prompt_lengths = np.asarray([len(p) for p in prompts], dtype=np.int64)
        self.tokens = np.asarray([t for p, c in zip(prompts, completions) for t in (*p, *c)], dtype=np.int64)

    def __len__(self) -> int:
        """Number of examples."""
        return len(self.prompt_lengths)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        """Example ``index``: ``{"input_ids": [seq_len], "labels": [seq_len]}``."""
        if not 0 <= index < len(self):
            raise IndexError(f"example {index} out of range for {len(self)} examples")
        return {key: value[0] for key, value in self.batch([index]).items()}

    def batch(self, indices: Sequence[int]) -> dict[str, Tensor]:
        """The given examples as one labelled batch ``{"input_ids": [B, seq_len], "labels": [B, seq_len]}``."""
        rows = torch.full((len(indices), self.seq_len + 1), self.pad_id, dtype=torch.long)
        learn = torch.zeros(rows.shape, dtype=torch.bool)
        for row, i in enumerate(indices):
            start, stop = int(self.offsets[i]), int(self.offsets[i + 1])
            rows[row, : stop - start] = torch.from_numpy(self.tokens[start:stop])
            learn[row, int(self.prompt_lengths[i]) : stop - start] = True
        return {INPUT_KEY: rows[:, :-1], LABEL_KEY: next_token_labels(rows, learn)[:, :-1]}


class PromptCompletionDataModule(TokenDataModule):
    """Prompt/completion JSONL -> labelled batches that train the completion only (see the module docstring).

    Split: an example is held out for validation when a hash of its prompt and completion falls in
    the first ``val_fraction`` of the hash range, so the split depends on the text alone (a duplicate
    lands on the same side as its twin). With ``validation``, that file is the validation set and
    every example of ``path`` trains.

    Length: an example takes ``len(prompt) + len(completion) + 1`` tokens (the end mark) and must
    fit ``seq_len + 1``. A longer one has its prompt cut from the left (its end, next to the
    completion, is kept; the count is logged), unless ``truncate_prompt`` is false. Examples whose
    completion alone (with the end mark and one prompt token) does not fit are refused with their
    count and the first line, as are all too-long examples when ``truncate_prompt`` is false.

    Order: training batches come from a :class:`~elr_lightning.data.StepIndexedLoader`, a pure
    function of (``seed``, step, rank), so a resumed run sees exactly the batches it would have seen.

    Args:
        path: The training ``.jsonl`` file.
        tokenizer: ``"byte"`` or the path of a HF ``tokenizer.json`` (the model's: after
            ``elr retrofit``, the ``tokenizer.json`` it wrote).
        seq_len: Positions per sequence (T).
        batch_size: Sequences per batch on each device.
        prompt_field: Key of the prompt in each record.
        completion_field: Key of the completion in each record.
        validation: A separate validation ``.jsonl`` file; ``None`` holds out ``val_fraction`` of ``path``.
        val_fraction: Share of ``path`` held out by hash when ``validation`` is not given, in [0, 1).
        truncate_prompt: Cut too-long prompts from the left (else refuse too-long examples).
        seed: Seed of the training order.
        val_batches: Use at most this many validation batches per device.

    Raises:
        ValueError: A number is out of range, or a field name is empty.
        FileNotFoundError: The tokenizer file does not exist.
    """

    def __init__(
        self,
        path: str,
        tokenizer: str = "byte",
        seq_len: int = 256,
        batch_size: int = 8,
        prompt_field: str = "prompt",
        completion_field: str = "completion",
        validation: Optional[str] = None,
        val_fraction: float = 0.05,
        truncate_prompt: bool = True,
        seed: int = 0,
        val_batches: Optional[int] = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
            if value < 1:
                raise ValueError(f"data.{name} must be >= 1, got {value}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
        if val_batches is not None and val_batches < 1:
            raise ValueError(f"data.val_batches must be >= 1 or null, got {val_batches}")
        for name, value in (("prompt_field", prompt_field), ("completion_field", completion_field)):
            if not value:
                raise ValueError(f"data.{name} must be a non-empty key")
        self.path = path
        self.validation = validation
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.prompt_field = prompt_field
        self.completion_field = completion_field
        self.val_fraction = val_fraction
        self.truncate_prompt = truncate_prompt
        self.seed = seed
        self.val_batches = val_batches
        self.tokenizer: Tokenizer = load_tokenizer(tokenizer)
        self.train_examples: Optional[PromptCompletionExamples] = None
        self.val_examples: Optional[PromptCompletionExamples] = None
        #: The validation examples' text, in the order of :attr:`val_examples` (for scoring generations).
        self.val_pairs: list[Pair] = []
        self._train_loader: Optional[StepIndexedLoader] = None

    def _read(self, path: str, option: str) -> list[Pair]:
        return read_pairs(path, self.prompt_field, self.completion_field, option)

    def encode(self, pairs: Sequence[Pair], option: str, path: str) -> PromptCompletionExamples:
        """Tokenise ``pairs`` (read from ``path``, given by ``option``), fitting each to ``seq_len + 1`` tokens.

        Raises:
            ValueError: Examples that cannot fit (see the class docstring), with their count and first line.
        """
        end = document_separator(self.tokenizer)
        limit = self.seq_len + 1
        prompts, completions, cut, refused = [], [], 0, []
        for pair in pairs:
            prompt = self.tokenizer.encode(pair.prompt)
            completion = self.tokenizer.encode(pair.completion) + end
            room = limit - len(completion)
            if len(prompt) > room:
                if not self.truncate_prompt or room < min(1, len(prompt)):
                    refused.append(pair.line)
                    continue
                prompt, cut = prompt[len(prompt) - room :], cut + 1
            prompts.append(prompt)
            completions.append(completion)
        if refused:
            what = "are longer than" if not self.truncate_prompt else "have a completion that alone does not fit"
            fix = "set data.truncate_prompt: true, " if not self.truncate_prompt else ""
            raise ValueError(
                f"{option}: {len(refused)} of {len(pairs)} examples in {path!r} {what} seq_len + 1 = {limit} tokens "
                f"(the first at line {refused[0]}); {fix}raise data.seq_len or shorten them"
            )
        if cut:
            rank_zero_info(f"{option}: {cut} of {len(pairs)} prompts in {path!r} were cut from the left to fit seq_len")
        pad = self.tokenizer.eos_id if self.tokenizer.eos_id is not None else 0
        return PromptCompletionExamples(prompts, completions, self.seq_len, pad)

    @override
    def setup(self, stage: Optional[str] = None) -> None:
        """Read and tokenise the examples, and split them into training and validation.

        Raises:
            FileNotFoundError: A file does not exist.
            ValueError: A file or a line is malformed, examples do not fit, or the split leaves no
                training example.
        """
        pairs = self._read(self.path, "data.path")
        val_option, val_path = "data.path", self.path
        if self.validation is not None:
            val_option, val_path = "data.validation", self.validation
            train, val = pairs, self._read(self.validation, val_option)
        else:
            held = [is_validation(p.prompt, p.completion, self.val_fraction) for p in pairs]
            train = [p for p, h in zip(pairs, held) if not h]
            val = [p for p, h in zip(pairs, held) if h]
        if not train:
            raise ValueError(
                f"data.val_fraction={self.val_fraction} holds out all {len(pairs)} examples of {self.path!r}; "
                "lower it or add examples"
            )
        self.train_examples = self.encode(train, "data.path", self.path)
        self.val_examples = self.encode(val, val_option, val_path)
        self.val_pairs = val
        self._train_loader = None

    def _require_setup(self) -> tuple[PromptCompletionExamples, PromptCompletionExamples]:
        if self.train_examples is None or self.val_examples is None:
            raise RuntimeError("PromptCompletionDataModule.setup() must run before asking for a dataloader")
        return self.train_examples, self.val_examples

    @override
    def train_dataloader(self) -> StepIndexedLoader:
        """The resumable training loader (one per setup; asking again returns the same cursor).

        Raises:
            ValueError: There are fewer training examples than one global batch.
        """
        train, _ = self._require_setup()
        return self.resumable_loader(train, self.seed, "training examples", "lower data.batch_size or add examples")

    @override
    def val_dataloader(self) -> DataLoader:
        """Validation examples in file order, at most ``val_batches`` global batches.

        Raises:
            ValueError: There is no validation example while validation is requested.
        """
        _, val = self._require_setup()
        if len(val) == 0 and getattr(self.trainer, "limit_val_batches", 1) != 0:
            raise ValueError(
                f"data.val_fraction={self.val_fraction} holds out none of the examples of {self.path!r}; raise it, "
                "give data.validation, or set trainer.limit_val_batches: 0"
            )
        count = self.validation_count(len(val))
        return DataLoader(torch.utils.data.Subset(val, range(count)), batch_size=self.batch_size, shuffle=False)

    @override
    def test_dataloader(self) -> DataLoader:
        """The validation examples."""
        return self.val_dataloader()

    @override
    def predict_dataloader(self) -> DataLoader:
        """The validation examples, for per-example losses at every k."""
        return self.val_dataloader()
