"""Token data for language-model training: a cached token shard cut into fixed windows.

:class:`TextDataModule` reads text files (by default the Python standard library of the running
interpreter, which is on every machine), tokenises them once into a ``numpy.memmap`` shard under
``cache_dir`` and serves windows of ``seq_len + 1`` tokens. Training batches come from a
:class:`StepIndexedLoader`, which resumes exactly from a checkpoint; validation batches come in a
fixed order.

Modules: :mod:`~elr_lightning.data.sources` (which files, which documents),
:mod:`~elr_lightning.data.windows` (windows and the resumable loader) and
:mod:`~elr_lightning.data.datamodule` (the token cache and the ``LightningDataModule``).

Fine-tuning: :class:`PromptCompletionDataModule` (:mod:`~elr_lightning.data.finetune`) reads
prompt/completion JSONL into labelled batches (:mod:`elr_lightning.batches`) that train the
completion only; :class:`LabelledExamples` serves any fixed sequences with position-aligned labels.

At pretraining scale, ``elr prepare`` (:mod:`~elr_lightning.data.prepare`, reading through
:mod:`~elr_lightning.data.readers`) tokenises a corpus in parallel into a prepared folder of
shards, and :class:`PreparedDataModule` trains on one or a weighted mixture of such folders
(:mod:`~elr_lightning.data.prepared`, :mod:`~elr_lightning.data.mixture`) with memory flat in
corpus size.
"""

from elr_lightning.data.datamodule import CACHE_FORMAT, TextDataModule, token_dtype
from elr_lightning.data.finetune import PromptCompletionDataModule, PromptCompletionExamples
from elr_lightning.data.labelled import LabelledExamples
from elr_lightning.data.mixture import MixtureLoader, MixtureSchedule
from elr_lightning.data.prepare import prepare_corpus
from elr_lightning.data.prepared import FeistelPermutation, PreparedFolder, TokenStream
from elr_lightning.data.prepared_module import PreparedDataModule
from elr_lightning.data.sources import (
    STDLIB_EXCLUDED_DIRS,
    TEXT_SUFFIXES,
    default_corpus_files,
    iter_documents,
    resolve_sources,
)
from elr_lightning.data.windows import StepIndexedLoader, StepLoader, TokenWindows, epoch_seed

__all__ = [
    "CACHE_FORMAT",
    "STDLIB_EXCLUDED_DIRS",
    "TEXT_SUFFIXES",
    "FeistelPermutation",
    "LabelledExamples",
    "MixtureLoader",
    "MixtureSchedule",
    "PreparedDataModule",
    "PreparedFolder",
    "PromptCompletionDataModule",
    "PromptCompletionExamples",
    "StepIndexedLoader",
    "StepLoader",
    "TokenStream",
    "TextDataModule",
    "TokenWindows",
    "default_corpus_files",
    "epoch_seed",
    "iter_documents",
    "prepare_corpus",
    "resolve_sources",
    "token_dtype",
]
