"""Fine-tuning with the prompt masked out against the full-sequence loss, on the bundled pairs.

Two arms train the same seeded model for the same steps on ``config/finetune_example.jsonl``
(``PromptCompletionDataModule``): ``masked`` (the data module's labels: completion and end mark
only) and ``full`` (the baseline: every next token of prompt and completion is a target, padding
still ignored). Both are scored on the held-out pairs at every k: the mean loss over completion
tokens, and exact match of the greedy completion (cut at the end mark, a newline). The table gives
the masked arm's figures beside the baseline's, measured in the same run.

    python bench/finetune.py                    # prints a table, writes bench/results/finetune.json
    python bench/finetune.py --steps 400 --d_model 128
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import lightning.pytorch as pl
import torch

from elr_lightning import IGNORE_INDEX
from elr_lightning.conditioning import LoopConditioner
from elr_lightning.config import ModelConfig
from elr_lightning.data import PromptCompletionDataModule
from elr_lightning.module import ELRModule
from elr_lightning.reasoning.score import greedy_answers
from elr_lightning.sampling import OneLoopOverride

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAIRS = os.path.join(ROOT, "config", "finetune_example.jsonl")


class FullSequence(PromptCompletionDataModule):
    """The baseline's data: every next token a target (the prompt's too), padding still ignored."""

    def on_before_batch_transfer(self, batch: dict[str, torch.Tensor], dataloader_idx: int) -> dict[str, torch.Tensor]:
        if self.trainer is None or not self.trainer.training:
            return batch
        ids, labels = batch["input_ids"], batch["labels"].clone()
        # a position predicts a prompt token when its next id is not padding and it is not already a target
        last = (labels != IGNORE_INDEX).long().cumsum(1).argmax(1)  # the end mark's target position
        before = torch.arange(ids.shape[1])[None] < last[:, None]
        labels[:, :-1] = torch.where(before[:, :-1] & (labels[:, :-1] == IGNORE_INDEX), ids[:, 1:], labels[:, :-1])
        return {"input_ids": ids, "labels": labels}


def train(arm: str, args: argparse.Namespace) -> tuple[ELRModule, PromptCompletionDataModule, float]:
    pl.seed_everything(args.seed)
    cls = FullSequence if arm == "full" else PromptCompletionDataModule
    data = cls(PAIRS, seq_len=args.seq_len, batch_size=args.batch_size, val_fraction=0.1, seed=args.seed)
    arch = ModelConfig(vocab_size=256, d_model=args.d_model, n_heads=max(1, args.d_model // 32), n_in=1, n_rec=1,
                       n_out=1, max_seq_len=args.seq_len, max_loops=args.max_loops)  # fmt: skip
    module = ELRModule(arch=arch, sampler=OneLoopOverride(args.max_loops, 0.15), virtual_ranks=2,
                       conditioner=LoopConditioner(d_cond=16, rank=4), lr=args.lr, warmup_steps=20)  # fmt: skip
    trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)  # fmt: skip
    start = time.process_time()
    trainer.fit(module, datamodule=data)
    return module, data, time.process_time() - start


@torch.no_grad()
def score(module: ELRModule, data: PromptCompletionDataModule, loops: int) -> dict[str, float]:
    """Completion loss and exact match on the held-out pairs at ``loops``."""
    model = module.model.eval()
    val = data.val_examples
    batch = val.batch(range(len(val)))
    nll = module.sequence_nll(batch, loops).sum()
    loss = float(nll / (batch["labels"] != IGNORE_INDEX).sum())
    pairs = data.val_pairs
    answers = greedy_answers(model, data.tokenizer, [p.prompt for p in pairs], loops, max_new_tokens=data.seq_len // 2)
    exact = sum(a == p.completion for a, p in zip(answers, pairs)) / len(pairs)
    return {"completion_loss": loss, "exact_match": exact}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--d_model", type=int, default=64)
    parser.add_argument("--max_loops", type=int, default=3)
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "finetune.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    results: dict[str, Any] = {"args": vars(args), "arms": {}}
    for arm in ("masked", "full"):
        module, data, cpu_s = train(arm, args)
        per_k = {k: score(module, data, k) for k in range(1, args.max_loops + 1)}
        results["arms"][arm] = {"cpu_s": cpu_s, "per_k": per_k, "held_out": len(data.val_examples)}
    print(f"{args.steps} steps, d = {args.d_model}, {results['arms']['masked']['held_out']} held-out pairs")
    print("| k | completion loss, masked | full (baseline) | ratio | exact match, masked | full |")
    print("|---|---|---|---|---|---|")
    for k in range(1, args.max_loops + 1):
        m, f = results["arms"]["masked"]["per_k"][k], results["arms"]["full"]["per_k"][k]
        print(f"| {k} | {m['completion_loss']:.3f} | {f['completion_loss']:.3f} | "
              f"{m['completion_loss'] / f['completion_loss']:.2f} | {m['exact_match']:.1%} | {f['exact_match']:.1%} |")  # fmt: skip
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
