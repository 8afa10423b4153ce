"""``DepthDataModule``: fresh labelled instances of one depth task at every step, and held-out ones to validate on."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from elr_lightning.data.base import TokenDataModule
from elr_lightning.data.windows import StepLoader
from elr_lightning.depth.tasks import DepthTask, draw, get_task
from elr_lightning.tokenizers import CharTokenizer

#: A labelled batch of the supervised-batch contract: ``{"input_ids": [B, T], "labels": [B, T]}``.
Batch = dict[str, torch.Tensor]


def instance_rng(seed: int, split: str, index: int, row: int) -> np.random.Generator:
    """The generator of one instance: a pure function of the data seed, the split, the step (or batch) and the row."""
    return np.random.default_rng([seed, {"train": 0, "val": 1, "eval": 2}[split], index, row])


def instances(task: DepthTask, difficulty: int, rows: range, seed: int, split: str, index: int) -> Batch:
    """``len(rows)`` instances of ``difficulty``, row ``r`` drawn from :func:`instance_rng` ``(seed, split, index, r)``.

    ``split="train"`` draws training instances, any other split held-out ones (:func:`~elr_lightning.depth.tasks.draw`).
    """
    drawn = [draw(task, instance_rng(seed, split, index, r), difficulty, split != "train") for r in rows]
    ids, labels, _ = (torch.from_numpy(np.stack(parts)) for parts in zip(*drawn))
    return {"input_ids": ids, "labels": labels}


class DepthSteps(StepLoader):
    """Training batches drawn fresh at every optimizer step; resumes exactly.

    Global step ``s = epoch * steps_per_epoch + position`` holds ``batch_size * world_size``
    instances; global row ``r`` is drawn from ``(seed, "train", s, r)`` alone, so rank ``rank`` takes
    rows ``[rank * batch_size, (rank + 1) * batch_size)`` and every rank and virtual shard sees other
    instances. The difficulty of step ``s`` is ``difficulty_at(s)``.

    Args:
        task: The task.
        difficulty_at: Difficulty of a global step (a pure function).
        batch_size: Instances per batch on this rank.
        seed: Data seed.
        rank: This process' rank.
        world_size: Processes sharing each global batch.
        steps_per_epoch: Steps per (nominal) epoch.
    """

    LAYOUT_FIX = "use the same data.task, data.seed and data.batch_size x devices, or start a fresh run"

    def __init__(
        self,
        task: DepthTask,
        difficulty_at: Any,
        batch_size: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        steps_per_epoch: int = 1000,
    ) -> None:
        super().__init__(batch_size, rank, world_size)
        self.task, self.difficulty_at, self.seed, self.steps_per_epoch = task, difficulty_at, seed, steps_per_epoch

    @override
    def __len__(self) -> int:
        return self.steps_per_epoch

    @override
    def batch_at(self, epoch: int, position: int) -> Batch:
        step = epoch * self.steps_per_epoch + position
        first = self.rank * self.batch_size
        return instances(self.task, self.difficulty_at(step), range(first, first + self.batch_size), self.seed, "train", step)

    @override
    def layout(self) -> dict[str, Any]:
        """``task``, ``seed``, ``global_batch_size`` and ``steps_per_epoch``."""
        return {"task": self.task.name, "seed": self.seed, "global_batch_size": self.global_batch_size,
                "steps_per_epoch": self.steps_per_epoch}  # fmt: skip


class HeldOut(Dataset):
    """``count`` held-out instances of one difficulty, instance ``i`` drawn from ``(seed, "val", difficulty, i)``."""

    def __init__(self, task: DepthTask, difficulty: int, count: int, seed: int) -> None:
        self.batch = instances(task, difficulty, range(count), seed, "val", difficulty)

    def __len__(self) -> int:
        return self.batch["input_ids"].shape[0]

    def __getitem__(self, index: int) -> Batch:
        return {key: value[index] for key, value in self.batch.items()}


class DepthDataModule(TokenDataModule):
    """One token-level depth task (:mod:`elr_lightning.depth.tasks`) with fresh instances at every step.

    Training batches are labelled dicts ``{"input_ids", "labels"}`` (the supervised-batch contract),
    drawn from the training split at every optimizer step (:class:`DepthSteps`); validation batches
    are held-out instances of the largest difficulty. The tokenizer is the task's alphabet
    (:class:`~elr_lightning.tokenizers.CharTokenizer`), saved in every checkpoint.

    Args:
        task: ``parity``, ``root`` or ``addition``.
        difficulty: The largest training difficulty (bits, chain depth, operands).
        curriculum_steps: Raise the training difficulty linearly from the task's smallest to
            ``difficulty`` over this many steps (0: ``difficulty`` from the start).
        batch_size: Instances per batch on each device.
        seed: Seed of every draw.
        val_batches: Validation batches of held-out instances per device.
        eval_difficulties: Difficulties the accuracy table reports (:class:`~elr_lightning.callbacks.DepthAccuracy`,
            ``elr eval``); default four steps up to ``difficulty`` and two beyond it.

    Raises:
        ValueError: An unknown task, or a difficulty out of its range.
    """

    def __init__(
        self,
        task: str = "parity",
        difficulty: int = 32,
        curriculum_steps: int = 0,
        batch_size: int = 128,
        seed: int = 0,
        val_batches: int = 2,
        eval_difficulties: Optional[list[int]] = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.task = get_task(task, "data.task")
        self.difficulty = self.task.check_difficulty(difficulty, "data.difficulty")
        for name, value, low in (("curriculum_steps", curriculum_steps, 0), ("batch_size", batch_size, 1), ("val_batches", val_batches, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"data.{name}={value!r} must be an integer >= {low}")
        self.curriculum_steps, self.batch_size, self.seed, self.val_batches = curriculum_steps, batch_size, seed, val_batches
        if eval_difficulties is None:
            eval_difficulties = default_difficulties(self.task, difficulty)
        self.eval_difficulties = sorted({self.task.check_difficulty(d, "data.eval_difficulties") for d in eval_difficulties})
        self.tokenizer = CharTokenizer(self.task.alphabet)
        self.seq_len = self.task.length(max(self.eval_difficulties + [difficulty]))
        self._train_loader: Optional[DepthSteps] = None

    def difficulty_at(self, step: int) -> int:
        """The training difficulty at global step ``step`` (the curriculum, a pure function)."""
        if self.curriculum_steps == 0 or step >= self.curriculum_steps:
            return self.difficulty
        low = self.task.min_difficulty
        return low + int((self.difficulty - low) * step / self.curriculum_steps)

    @override
    def train_dataloader(self) -> DepthSteps:
        rank, world_size = self._rank_and_world_size()
        loader = self._train_loader
        if loader is None or (loader.rank, loader.world_size) != (rank, world_size):
            loader = DepthSteps(self.task, self.difficulty_at, self.batch_size, self.seed, rank, world_size)
            self._train_loader = loader
        return loader

    @override
    def val_dataloader(self) -> DataLoader:
        """Held-out instances of the largest training difficulty, ``val_batches`` global batches split over the ranks."""
        _, world_size = self._rank_and_world_size()
        data = HeldOut(self.task, self.difficulty, self.val_batches * self.batch_size * world_size, self.seed)
        return DataLoader(data, batch_size=self.batch_size, shuffle=False)


def default_difficulties(task: DepthTask, difficulty: int) -> list[int]:
    """Four even steps from the task's smallest difficulty up to ``difficulty``, then 1.5x and 2x of it where the task allows."""
    low = task.min_difficulty
    ladder = {low + round((difficulty - low) * i / 3) for i in range(4)}
    ladder |= {d for d in (3 * difficulty // 2, 2 * difficulty) if d <= task.max_difficulty}
    return sorted(ladder)
