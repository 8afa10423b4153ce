"""``TokenDataModule``: what every data module of the library shares (tokenizer, ranks, validation size)."""

from typing import Optional

import lightning.pytorch as pl
import torch

from elr_lightning.data.windows import Batchable, StepIndexedLoader, StepLoader
from elr_lightning.tokenizers import Tokenizer


def document_separator(tokenizer: Tokenizer) -> list[int]:
    """Ids that end or join documents: ``[eos_id]``, or the encoding of ``"\\n"``."""
    eos = tokenizer.eos_id
    return [eos] if eos is not None else tokenizer.encode("\n")


class TokenDataModule(pl.LightningDataModule):
    """Base of the library's data modules: sequences of ``seq_len`` positions of one tokenizer.

    Contract for subclasses: set ``tokenizer``, ``seq_len``, ``batch_size``, ``val_batches`` and
    ``_train_loader`` (``None`` until the first training loader, and again after each setup) in
    ``__init__``; every batch is an ``int64`` tensor ``[batch_size, seq_len + 1]`` of token windows,
    or a labelled mapping ``{"input_ids": [batch_size, seq_len], "labels": [batch_size, seq_len]}``
    (:mod:`elr_lightning.batches`). The module reads ``tokenizer``, ``vocab_size``, ``token_bytes``,
    ``seq_len`` and ``batch_size`` from here.
    """

    tokenizer: Tokenizer
    seq_len: int
    batch_size: int
    val_batches: Optional[int]
    _train_loader: Optional[StepLoader]

    @property
    def vocab_size(self) -> int:
        """Vocabulary size of the tokenizer."""
        return self.tokenizer.vocab_size

    @property
    def token_bytes(self) -> torch.Tensor:
        """UTF-8 bytes per token id, ``int64 [vocab_size]`` (for bits per byte)."""
        return self.tokenizer.token_bytes()

    def _rank_and_world_size(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        return trainer.global_rank, trainer.world_size

    def validation_count(self, available: int) -> int:
        """Validation windows to use: at most ``val_batches`` global batches, a multiple of the world size.

        A global batch is ``batch_size`` windows per device, as in training, so every rank runs at
        most ``val_batches`` batches, and W devices at ``batch_size`` B / W validate the same windows
        as one device at B. Under several devices the count is cut to a multiple of W, so that
        Lightning's distributed sampler splits it without repeating windows.

        Args:
            available: Validation windows there are.
        """
        _, world_size = self._rank_and_world_size()
        count = available
        if self.val_batches is not None:
            count = min(count, self.val_batches * self.batch_size * world_size)
        if count >= world_size:
            count -= count % world_size
        return count

    def resumable_loader(self, items: Batchable, seed: int, what: str, fix: str) -> StepIndexedLoader:
        """This rank's :class:`~elr_lightning.data.StepIndexedLoader` over ``items``, kept until the next setup
        (asking again returns the same cursor, which Lightning restores on resume).

        Args:
            items: The training windows or examples.
            seed: Seed of the order.
            what: What ``items`` are, for the error (``"training windows"``).
            fix: How to get more, for the error.

        Raises:
            ValueError: ``items`` cannot fill one global batch.
        """
        rank, world_size = self._rank_and_world_size()
        loader = self._train_loader
        if loader is None or (loader.rank, loader.world_size) != (rank, world_size):
            loader = StepIndexedLoader(items, self.batch_size, seed=seed, rank=rank, world_size=world_size)
            if len(loader) == 0:
                raise ValueError(
                    f"data.batch_size: {len(items)} {what} cannot fill one global batch of "
                    f"{self.batch_size} x {world_size} device(s); {fix}"
                )
            self._train_loader = loader
        return loader
