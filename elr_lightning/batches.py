"""Training batches: token windows, or ``input_ids`` with position-aligned ``labels`` and an ignore index.

A batch takes one of two forms:

* a ``LongTensor [B, T + 1]`` of token windows: inputs ``batch[:, :-1]``, next-token targets
  ``batch[:, 1:]`` (language modelling; every position is a target);
* a mapping ``{"input_ids": LongTensor[B, T], "labels": LongTensor[B, T]}``: ``labels[b, t]`` is the
  target of the prediction made at position ``t``. A label equal to :data:`IGNORE_INDEX` contributes
  neither loss nor gradient. Position-aligned targets (e.g. the parity of bits ``0..t`` at position
  ``t``) are given as they are; next-token targets with a mask (prompt/completion fine-tuning) are
  ``labels[:, t] = input_ids[:, t + 1]`` with :data:`IGNORE_INDEX` on the prompt, the padding and
  the last position. Other keys are left to callbacks and subclasses, except ``attention_mask``,
  which the model does not read yet and is refused rather than silently dropped.

:class:`TokenBatch` reads either form into inputs and labels, splits both alike into shards, and
counts the labelled tokens that the losses divide by.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Union

import torch
from torch import Tensor

Batch = Union[Tensor, Mapping[str, Tensor]]
"""A training, validation or prediction batch in either form."""

IGNORE_INDEX = -100
"""A label that contributes neither loss nor gradient (``torch.nn.functional.cross_entropy``'s default)."""

#: The keys of a labelled batch.
INPUT_KEY, LABEL_KEY = "input_ids", "labels"

#: Keys a labelled batch may not carry: the model would silently ignore them.
UNSUPPORTED_KEYS = ("attention_mask",)

#: How labels line up with the inputs, quoted by the errors about a labelled batch.
ALIGNMENT = (
    "labels are position-aligned: labels[b, t] is the target of position t (for next-token targets, "
    f"labels[:, t] = input_ids[:, t + 1] and {IGNORE_INDEX} at the last position)"
)


@dataclass(frozen=True)
class TokenBatch:
    """A batch as the model reads it: ``inputs [B, T]`` and the target of every position, ``labels [B, T]``.

    Attributes:
        inputs: Token ids the model reads.
        labels: Target of each position; :data:`IGNORE_INDEX` where there is none.
        masked: Whether ``labels`` may hold :data:`IGNORE_INDEX` (a labelled batch). A batch of token
            windows is not masked: every position is a target and counts are plain integers, so
            its losses are computed exactly as they always were.
    """

    inputs: Tensor
    labels: Tensor
    masked: bool

    @classmethod
    def of(cls, batch: Batch) -> TokenBatch:
        """Read ``batch`` in either form (see the module docstring).

        Raises:
            ValueError: A mapping lacks ``input_ids`` or ``labels``, carries ``attention_mask``, or
                its tensors are not integer ids of one shape ``[B, T]``; each naming the keys.
        """
        if isinstance(batch, Tensor):
            return cls(batch[:, :-1], batch[:, 1:], masked=False)
        if not isinstance(batch, Mapping):
            raise ValueError(
                f"a batch is a LongTensor [B, T + 1] of token windows or a mapping with {INPUT_KEY!r} and "
                f"{LABEL_KEY!r}; got {type(batch).__name__}"
            )
        missing = [key for key in (INPUT_KEY, LABEL_KEY) if key not in batch]
        if missing:
            raise ValueError(
                f"a labelled batch needs the keys {INPUT_KEY!r} and {LABEL_KEY!r}; it lacks {missing} "
                f"(keys: {sorted(map(str, batch))})"
            )
        unsupported = [key for key in UNSUPPORTED_KEYS if key in batch]
        if unsupported:
            raise ValueError(
                f"batch[{unsupported[0]!r}] is not supported: the model attends causally over every position; "
                f"drop the key and mark padding with labels = {IGNORE_INDEX}"
            )
        inputs, labels = batch[INPUT_KEY], batch[LABEL_KEY]
        for key, value in ((INPUT_KEY, inputs), (LABEL_KEY, labels)):
            if not isinstance(value, Tensor) or value.ndim != 2 or value.is_floating_point() or value.is_complex():
                what = type(value).__name__
                if isinstance(value, Tensor):
                    what = f"shape {list(value.shape)}, dtype {value.dtype}"
                raise ValueError(f"batch[{key!r}] must be an integer tensor [B, T]; got {what}")
        if inputs.shape != labels.shape:
            raise ValueError(
                f"batch[{INPUT_KEY!r}] has shape {list(inputs.shape)} and batch[{LABEL_KEY!r}] {list(labels.shape)}; "
                f"{ALIGNMENT}"
            )
        return cls(inputs, labels, masked=True)

    @property
    def rows(self) -> int:
        """Sequences in the batch (B)."""
        return self.inputs.shape[0]

    @property
    def seq_len(self) -> int:
        """Positions per sequence (T)."""
        return self.inputs.shape[1]

    def mask(self) -> Tensor:
        """``bool [B, T]``: the positions that have a target."""
        return self.labels != IGNORE_INDEX

    def labelled_tokens(self) -> Union[int, Tensor]:
        """Positions with a target, at least 1 (so a batch without any gives loss 0, not 0/0).

        An ``int`` for token windows (``B * T``, no device read), a 0-dim tensor for a labelled batch.
        """
        if not self.masked:
            return self.labels.numel()
        return self.mask().sum().clamp_min(1)

    def labelled_per_row(self) -> Union[int, Tensor]:
        """Positions with a target in each sequence, at least 1: ``T``, or ``[B]`` for a labelled batch."""
        if not self.masked:
            return self.seq_len
        return self.mask().sum(dim=1).clamp_min(1)

    def shards(self, count: int) -> list[TokenBatch]:
        """Split into ``count`` shards of consecutive sequences (``Tensor.tensor_split``), inputs and labels alike."""
        parts = zip(self.inputs.tensor_split(count), self.labels.tensor_split(count))
        return [TokenBatch(inputs, labels, self.masked) for inputs, labels in parts]

    def check_ids(self, vocab_size: int) -> None:
        """Refuse ids outside ``[0, vocab_size)`` (labels may also be :data:`IGNORE_INDEX`).

        Reads the tensors back: call it where they are still on the host (``ELRModule`` does, before
        moving a labelled batch to the device). Token windows are not checked.

        Raises:
            ValueError: Naming the key, the position, the value and the fix.
        """
        if not self.masked:
            return
        checks = (
            (INPUT_KEY, self.inputs, (self.inputs < 0) | (self.inputs >= vocab_size)),
            (LABEL_KEY, self.labels, (self.labels != IGNORE_INDEX) & ((self.labels < 0) | (self.labels >= vocab_size))),
        )
        for key, values, bad in checks:
            if bad.any():
                b, t = (int(i) for i in bad.nonzero()[0])
                allowed = f"ids in [0, {vocab_size})"
                if key == LABEL_KEY:
                    allowed += f" or {IGNORE_INDEX} for no target"
                raise ValueError(
                    f"batch[{key!r}][{b}, {t}] = {int(values[b, t])} is outside arch.vocab_size={vocab_size}; "
                    f"give {allowed}, or raise model.init_args.arch.vocab_size"
                )


def batch_dims(batch: Batch) -> tuple[int, int]:
    """``(B, T)``: the sequences of ``batch`` and the positions the model reads in each, in either form."""
    if isinstance(batch, Tensor):
        return batch.shape[0], batch.shape[1] - 1
    rows, seq_len = batch[INPUT_KEY].shape
    return rows, seq_len


def next_token_labels(input_ids: Tensor, targets: Tensor) -> Tensor:
    """Position-aligned labels of next-token targets: ``labels[:, t] = input_ids[:, t + 1]`` where
    ``targets[:, t + 1]`` is true, :data:`IGNORE_INDEX` elsewhere and at the last position.

    Args:
        input_ids: ``[B, T]`` token ids.
        targets: ``bool [B, T]``: the tokens that are to be learned (predicted from the one before).
    """
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, :-1] = torch.where(targets[:, 1:], input_ids[:, 1:], IGNORE_INDEX)
    return labels
