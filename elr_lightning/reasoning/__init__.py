"""Synthetic reasoning tasks where depth matters: generators, a training mix, and exact-match scoring.

* :mod:`~elr_lightning.reasoning.generators`: the tasks (``addition``, ``variables``, ``hops``), each
  with a difficulty knob, deterministic from a seed, with disjoint training and held-out instances.
* :mod:`~elr_lightning.reasoning.datamodule`: :class:`ReasoningTextDataModule`, the synthetic
  documents mixed in front of a text corpus.
* :mod:`~elr_lightning.reasoning.score`: accuracy per task, level and k by greedy decoding (what
  ``elr ablate`` reports) and the teacher-forced answer loss (:func:`answer_loss`); ``elr eval
  --tasks elr_reasoning`` scores the same instances in the harness.
"""

from elr_lightning.reasoning.datamodule import ReasoningTextDataModule, pack_windows, reasoning_documents, reasoning_texts
from elr_lightning.reasoning.generators import (
    GENERATORS,
    Generator,
    Instance,
    check_seed,
    get_generator,
    heldout_instances,
    is_heldout,
    parse_levels,
    training_instances,
)
from elr_lightning.reasoning.score import accuracy, answer_loss, score_levels

__all__ = [
    "GENERATORS",
    "Generator",
    "Instance",
    "ReasoningTextDataModule",
    "accuracy",
    "answer_loss",
    "check_seed",
    "get_generator",
    "heldout_instances",
    "is_heldout",
    "parse_levels",
    "pack_windows",
    "reasoning_documents",
    "reasoning_texts",
    "score_levels",
    "training_instances",
]
