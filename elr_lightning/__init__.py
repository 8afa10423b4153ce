"""Elastic Latent Recurrence (ELR) for training and serving looped language models."""

from elr_lightning import _moved
from elr_lightning.batches import IGNORE_INDEX
from elr_lightning.config import ModelConfig
from elr_lightning.model import LoopedLM
from elr_lightning.module import ELRModule

_moved.install()  # the 0.1 import paths of the modules that moved into packages, for one more release

__all__ = ["IGNORE_INDEX", "ELRModule", "LoopedLM", "ModelConfig"]
__version__ = "0.1.0"
