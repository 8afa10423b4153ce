"""``ModelCheckpoint`` whose files, ``last.ckpt`` included, are never left half-written by a kill."""

from __future__ import annotations

import os
import shutil

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_utilities.core.rank_zero import rank_zero_warn
from typing_extensions import override

from elr_lightning.checkpoints.io import install_safe_checkpoint_io
from elr_lightning.files import remove_orphans, replace_atomically


class AtomicModelCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` with crash-safe files; takes the same arguments.

    * In ``setup`` it installs :class:`~elr_lightning.checkpoints.io.AtomicCheckpointIO` in place of
      the strategy's default ``TorchCheckpointIO``: every checkpoint is written to a temporary file
      beside it and renamed over it, and a damaged file is refused with a clear error on resume. A
      strategy with its own checkpoint IO (e.g. sharded checkpoints written as folders) keeps it,
      with a warning.
    * ``save_last="link"`` makes ``last.ckpt`` a hard link made under a temporary name and renamed
      over ``last.ckpt``. Lightning's symbolic link is removed and recreated, and points at a file
      that the top-k bookkeeping deletes just before relinking, so a kill in between leaves
      ``last.ckpt`` missing or dangling; a hard link keeps the old data alive and the rename is
      atomic. ``save_last=True`` writes ``last.ckpt`` as a file through the atomic writer.
    * In ``setup``, the temporary files that a kill during a save left in ``dirpath`` are removed.

    The guarantees hold for checkpoints that are single files. Sharded checkpoints that a strategy
    writes as folders (``save_distributed_checkpoint=True``) are written and linked as Lightning
    does.
    """

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if trainer.is_global_zero and self.dirpath is not None:
            removed = remove_orphans(str(self.dirpath))  # a killed write's leftovers; no writer runs yet
            if removed:
                rank_zero_warn(f"AtomicModelCheckpoint: removed {len(removed)} temporary file(s) of a killed save")
        if not install_safe_checkpoint_io(trainer.strategy):
            name = type(trainer.strategy.checkpoint_io).__name__
            rank_zero_warn(
                f"AtomicModelCheckpoint: the strategy writes checkpoints with {name}, whose writes "
                "may not be atomic; a kill mid-save can leave a damaged checkpoint"
            )

    @staticmethod
    @override
    def _link_checkpoint(trainer: "pl.Trainer", filepath: str, linkpath: str) -> None:
        if os.path.isdir(filepath):
            ModelCheckpoint._link_checkpoint(trainer, filepath, linkpath)
            return
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):

            def link(tmp: str) -> None:
                try:
                    os.link(filepath, tmp)
                except OSError:
                    shutil.copy2(filepath, tmp)
                if os.path.isdir(linkpath) and not os.path.islink(linkpath):
                    shutil.rmtree(linkpath)

            replace_atomically(linkpath, link)
        trainer.strategy.barrier()
