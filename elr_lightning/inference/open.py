"""Opening a checkpoint for a command: the sequence ``elr generate`` and ``elr export`` share.

Trust the modules a ``--trust_module`` names (:func:`~elr_lightning.checkpoints.trust.apply_trust_argument`),
check the path with the one message every command gives
(:func:`~elr_lightning.checkpoints.io.verify_checkpoint_path`), load the model and its module as data
(:func:`~elr_lightning.inference.generate.load_model`), and choose the tokenizer: ``--tokenizer``, else
the checkpoint's, else bytes (:func:`~elr_lightning.checkpoints.tokenizer.choose_tokenizer`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from elr_lightning.checkpoints.io import verify_checkpoint_path
from elr_lightning.checkpoints.tokenizer import choose_tokenizer
from elr_lightning.checkpoints.trust import apply_trust_argument
from elr_lightning.inference.generate import load_model
from elr_lightning.model import LoopedLM
from elr_lightning.module import ELRModule
from elr_lightning.tokenizers import Tokenizer

__all__ = ["OpenedCheckpoint", "open_checkpoint"]


@dataclass(frozen=True)
class OpenedCheckpoint:
    """A checkpoint opened for a command.

    Attributes:
        model: The :class:`~elr_lightning.model.LoopedLM`, in eval mode.
        module: The module that holds it.
        tokenizer: The tokenizer to run it with.
    """

    model: LoopedLM
    module: ELRModule
    tokenizer: Tokenizer


def open_checkpoint(
    ckpt_path: str,
    trust_module: Optional[str] = None,
    tokenizer: Optional[str] = None,
    map_location: Union[str, torch.device] = "cpu",
    field: str = "--ckpt_path",
) -> OpenedCheckpoint:
    """Open ``ckpt_path`` as a command does: trust, check the path, load as data, choose the tokenizer.

    Args:
        ckpt_path: The checkpoint file or sharded folder.
        trust_module: The parsed ``--trust_module`` (comma-separated modules), or ``None``.
        tokenizer: The parsed ``--tokenizer`` override, or ``None`` for the checkpoint's own.
        map_location: The device to load the weights onto.
        field: The option that gave ``ckpt_path``, for the messages.

    Raises:
        FileNotFoundError: Nothing is at ``ckpt_path``, or no tokenizer file where ``tokenizer`` says.
        ValueError: A damaged checkpoint, one that holds a pickled object, names an untrusted module or
            breaks the schema, or a tokenizer whose vocabulary does not fit the model.
    """
    apply_trust_argument(trust_module)
    verify_checkpoint_path(ckpt_path, field)
    model, module = load_model(ckpt_path, map_location=map_location)
    return OpenedCheckpoint(model, module, choose_tokenizer(module.tokenizer, tokenizer, model.config.vocab_size))
