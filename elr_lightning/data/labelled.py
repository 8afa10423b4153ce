"""``LabelledExamples``: fixed-length sequences with position-aligned labels, served as labelled batches."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.utils.data import Dataset

from elr_lightning.batches import INPUT_KEY, LABEL_KEY


class LabelledExamples(Dataset):
    """Sequences ``input_ids [N, T]`` with their ``labels [N, T]`` (:mod:`elr_lightning.batches`).

    Item ``i`` is ``{"input_ids": [T], "labels": [T]}`` (``int64``); a ``DataLoader``'s default
    collation stacks items into a labelled batch, and :meth:`batch` does the same for
    :class:`~elr_lightning.data.StepIndexedLoader`, which then serves them in a resumable order.

    Args:
        input_ids: Token ids, any integer dtype.
        labels: The target of each position, ``IGNORE_INDEX`` where there is none; same shape.

    Raises:
        ValueError: The two are not 2-D tensors of one shape.
    """

    def __init__(self, input_ids: Tensor, labels: Tensor) -> None:
        if input_ids.ndim != 2 or input_ids.shape != labels.shape:
            raise ValueError(
                f"input_ids {list(input_ids.shape)} and labels {list(labels.shape)} must be [N, T] of one shape"
            )
        self.input_ids = input_ids
        self.labels = labels

    @property
    def seq_len(self) -> int:
        """Positions per sequence (T)."""
        return self.input_ids.shape[1]

    def __len__(self) -> int:
        """Number of sequences."""
        return self.input_ids.shape[0]

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        """Sequence ``index``: ``{"input_ids": [T], "labels": [T]}``, ``int64``."""
        if not 0 <= index < len(self):
            raise IndexError(f"sequence {index} out of range for {len(self)} sequences")
        return {INPUT_KEY: self.input_ids[index].long(), LABEL_KEY: self.labels[index].long()}

    def batch(self, indices: Sequence[int]) -> dict[str, Tensor]:
        """The given sequences stacked: ``{"input_ids": [len(indices), T], "labels": [len(indices), T]}``."""
        rows = torch.as_tensor(list(indices), dtype=torch.long)
        return {INPUT_KEY: self.input_ids[rows].long(), LABEL_KEY: self.labels[rows].long()}
