"""``StepProgressBar``: Lightning's rich progress bar, with a description that fits a run limited by steps."""

from __future__ import annotations

from lightning.pytorch.callbacks import RichProgressBar
from typing_extensions import override


class StepProgressBar(RichProgressBar):
    """Lightning's :class:`~lightning.pytorch.callbacks.RichProgressBar`, reading ``Epoch 0 · step limit 1000``.

    A run limited by ``trainer.max_steps`` has ``max_epochs = -1``, which Lightning's bar prints as
    ``Epoch 0/-2``. This bar prints the step limit instead; a run limited by epochs reads as in
    Lightning (``Epoch 2/9``). ``elr fit`` uses it wherever Lightning would pick its rich bar and no
    progress bar is configured.
    """

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs >= 0:
            return super()._get_train_description(current_epoch)
        description = f"Epoch {current_epoch}"
        if self.trainer.max_steps >= 0:
            description += f" · step limit {self.trainer.max_steps}"
        # Padded as Lightning pads it, so the bar does not flicker against "Validation".
        return f"{description:{len(self.validation_description)}}"
