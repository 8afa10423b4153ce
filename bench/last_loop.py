"""Prefill against token-by-token decoding under each KV-cache policy: where the prompt is split matters under last_loop.

A prompt prefilled in one pass runs loop i of every token over the loop-i keys and values of the
tokens before it, exactly as the cache-free forward does. Decoded one token at a time, a token's
loop i attends, under ``per_loop``, to the same loop-i entries (the policy is exact), but under
``last_loop`` to the one entry per layer that every loop overwrote: the earlier tokens' loop-k keys
and values. So at k > 1 the logits of a prompt depend on how it reached the cache, and a
continuation depends on where the prompt was split between prefill and decoding. At k = 1 there is
one loop and the two agree.

For held-out sequences of the default corpus (the validation split of ``TextDataModule``), per k in
1..K and policy, this measures:

* ``max_logit_gap``: the largest absolute difference between the prefill logits and those of
  decoding the same tokens one at a time (teacher-forced, batch of all prompts);
* ``nll_prefill`` / ``nll_decoded``: the mean next-token loss (nats) of each;
* ``argmax_agreement``: the share of positions where both predict the same token;
* ``same_continuation``: the share of prompts whose greedy continuation of ``--new_tokens`` tokens
  is the same after prefilling the whole prompt as after prefilling its first half and decoding
  the rest one token at a time.

Writes ``bench/results/last_loop.json``.

    python bench/last_loop.py --ckpt_path runs/quickstart/version_0/checkpoints/last.ckpt
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Any

import torch
import torch.nn.functional as F

from elr_lightning.inference.cache import CACHE_POLICIES
from elr_lightning.data import TextDataModule
from elr_lightning.inference.generate import load_model
from elr_lightning.model import LoopedLM


@torch.inference_mode()
def prefill_and_decoded_logits(model: LoopedLM, ids: torch.Tensor, loops: int, policy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``[B, T, V]`` of ``ids`` ``[B, T]`` at ``loops``: prefilled in one pass, and decoded one token per pass."""
    prefill = model(ids, loops, cache=CACHE_POLICIES[policy](max_len=ids.shape[1]))
    cache = CACHE_POLICIES[policy](max_len=ids.shape[1])
    decoded = torch.cat([model(ids[:, t : t + 1], loops, cache=cache) for t in range(ids.shape[1])], dim=1)
    return prefill, decoded


@torch.inference_mode()
def greedy_after(model: LoopedLM, ids: torch.Tensor, split: int, loops: int, policy: str, new_tokens: int) -> torch.Tensor:
    """Greedy ``[B, new_tokens]`` after ``ids[:, :split]`` prefilled and ``ids[:, split:]`` decoded one token per pass."""
    cache = CACHE_POLICIES[policy](max_len=ids.shape[1] + new_tokens)
    logits = model(ids[:, :split], loops, cache=cache)[:, -1]
    for t in range(split, ids.shape[1]):
        logits = model(ids[:, t : t + 1], loops, cache=cache)[:, -1]
    out = []
    for _ in range(new_tokens):
        out.append(logits.argmax(-1))
        logits = model(out[-1][:, None], loops, cache=cache)[:, -1]
    return torch.stack(out, dim=1)


def measure(model: LoopedLM, batch: torch.Tensor, loops: int, policy: str, new_tokens: int) -> dict[str, float]:
    """The figures of the module docstring for one k and policy; ``batch`` ``[B, T + 1]`` holds the prompts and targets."""
    ids, targets = batch[:, :-1], batch[:, 1:]
    prefill, decoded = prefill_and_decoded_logits(model, ids, loops, policy)
    whole = greedy_after(model, ids, ids.shape[1], loops, policy, new_tokens)
    split = greedy_after(model, ids, ids.shape[1] // 2, loops, policy, new_tokens)
    return {
        "max_logit_gap": float((prefill - decoded).abs().max()),
        "nll_prefill": float(F.cross_entropy(prefill.flatten(0, 1), targets.flatten())),
        "nll_decoded": float(F.cross_entropy(decoded.flatten(0, 1), targets.flatten())),
        "argmax_agreement": float((prefill.argmax(-1) == decoded.argmax(-1)).float().mean()),
        "same_continuation": float((whole == split).all(dim=1).float().mean()),
    }


def main() -> None:
    """Measure every k and policy on the checkpoint, print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--ckpt_path", required=True, help="Checkpoint written by elr fit.")
    parser.add_argument("--prompts", type=int, default=16, help="Held-out sequences.")
    parser.add_argument("--prompt_len", type=int, default=96, help="Tokens per prompt.")
    parser.add_argument("--new_tokens", type=int, default=32, help="Greedy tokens compared after the two splits.")
    parser.add_argument("--threads", type=int, default=1, help="torch threads.")
    parser.add_argument("--out", default="bench/results/last_loop.json", help="JSON output path.")
    args = parser.parse_args()

    torch.set_flush_denormal(True)
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.ckpt_path)
    data = TextDataModule(seq_len=args.prompt_len, batch_size=args.prompts, val_batches=1)
    data.setup("validate")
    batch = next(iter(data.val_dataloader()))
    start = time.process_time()
    table = {
        f"{policy}/k{k}": measure(model, batch, k, policy, args.new_tokens)
        for policy in CACHE_POLICIES
        for k in range(1, model.config.max_loops + 1)
    }
    cpu = time.process_time() - start
    print(f"{args.ckpt_path}: {args.prompts} held-out prompts of {args.prompt_len} tokens; prefill vs token by token")
    header = f"{'policy':>9} {'k':>2} {'max logit gap':>13} {'nll prefill':>11} {'nll decoded':>11} {'argmax same':>11} {'same cont.':>10}"
    print(header)
    print("-" * len(header))
    for name, row in table.items():
        policy, k = name.split("/k")
        print(
            f"{policy:>9} {k:>2} {row['max_logit_gap']:>13.3g} {row['nll_prefill']:>11.4f} {row['nll_decoded']:>11.4f} "
            f"{row['argmax_agreement']:>11.3f} {row['same_continuation']:>10.3f}"
        )
    report = {
        "ckpt_path": args.ckpt_path,
        "settings": {**vars(args), "torch": torch.__version__, "machine": platform.machine(), "cpu_s": cpu},
        "results": table,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out} ({cpu:.0f} s CPU)")


if __name__ == "__main__":
    main()
