"""Exact-match accuracy of a model on held-out reasoning instances at a loop count k, without the harness.

``elr eval --tasks elr_reasoning`` scores the same instances through lm-evaluation-harness; this
scorer decodes greedily with plain forward passes (no cache, no padding: prompts are batched by
token length), which is what ``elr ablate`` runs after each arm, so that the ablation needs no
optional extra. An answer is right when the generated text up to the first newline equals it.

:func:`answer_loss` is the finer probe: the teacher-forced cross-entropy of the answer and its
newline after the prompt. It moves long before exact match does, and its value against a uniform
guess over the answer's alphabet tells "learned the format" from "learned the task".
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from elr_lightning.model import LoopedLM
from elr_lightning.reasoning.generators import Instance, heldout_instances, parse_levels
from elr_lightning.tokenizers import Tokenizer


@torch.no_grad()
def greedy_answers(
    model: LoopedLM, tokenizer: Tokenizer, prompts: Sequence[str], loops: int, max_new_tokens: int, batch_size: int = 64
) -> list[str]:
    """Greedy continuation of every prompt at ``loops``, cut at the first newline.

    Prompts of equal token length are decoded together; each decoding step is one forward pass over
    the whole sequence so far (cheap at these lengths, and exactly the trained computation).
    """
    encoded = [tokenizer.encode(p) for p in prompts]
    by_length: dict[int, list[int]] = defaultdict(list)
    for index, ids in enumerate(encoded):
        by_length[len(ids)].append(index)
    device = next(model.parameters()).device
    out = [""] * len(prompts)
    for indices in by_length.values():
        for start in range(0, len(indices), batch_size):
            rows = indices[start : start + batch_size]
            ids = torch.tensor([encoded[i] for i in rows], dtype=torch.long, device=device)
            prompt_len = ids.shape[1]
            for _ in range(max_new_tokens):
                window = ids[:, -model.config.max_seq_len :]
                next_ids = model(window, loops=loops)[:, -1].argmax(-1, keepdim=True)
                ids = torch.cat([ids, next_ids], dim=1)
            for row, seq in zip(rows, ids[:, prompt_len:].tolist()):
                out[row] = tokenizer.decode(seq).split("\n", 1)[0]
    return out


def accuracy(
    model: LoopedLM, tokenizer: Tokenizer, instances: Sequence[Instance], loops: int, batch_size: int = 64
) -> float:
    """Share of ``instances`` whose answer the model generates exactly at ``loops``."""
    if not instances:
        raise ValueError("no instances to score")
    longest = max(len(tokenizer.encode(i.answer + "\n")) for i in instances)
    answers = greedy_answers(model, tokenizer, [i.prompt for i in instances], loops, longest, batch_size)
    return sum(a == i.answer for a, i in zip(answers, instances)) / len(instances)


@torch.no_grad()
def answer_loss(model: LoopedLM, tokenizer: Tokenizer, instances: Sequence[Instance], loops: int) -> float:
    """Mean cross-entropy (nats per token) of every answer and its newline, teacher-forced after its prompt.

    Each instance is one forward pass over ``prompt + answer + "\\n"`` (without the last token) at
    ``loops``; the loss is summed over the answer's tokens and divided by their count over all
    instances, so long answers weigh by their length.
    """
    if not instances:
        raise ValueError("no instances to score")
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for instance in instances:
        prompt = tokenizer.encode(instance.prompt)
        ids = torch.tensor([prompt + tokenizer.encode(instance.answer + "\n")], dtype=torch.long, device=device)
        logits = model(ids[:, :-1][:, -model.config.max_seq_len :], loops=loops)[0]
        targets = ids[0, len(prompt) :]
        total += F.cross_entropy(logits[-len(targets) :].float(), targets, reduction="sum").item()
        count += len(targets)
    return total / count


def score_levels(
    model: LoopedLM,
    tokenizer: Tokenizer,
    tasks: dict[str, object],
    loops: Sequence[int],
    n: int = 100,
    seed: int = 0,
) -> dict[str, dict[int, dict[int, float]]]:
    """Accuracy per task, difficulty level and k on ``n`` held-out instances per level.

    Args:
        model: The model (put in eval mode here).
        tokenizer: Its tokenizer.
        tasks: Task name -> levels (see :func:`~elr_lightning.reasoning.generators.parse_levels`).
        loops: Loop counts to score at.
        n: Held-out instances per level (fewer where the level has fewer).
        seed: Seed of the held-out draw.

    Returns:
        ``{task: {level: {k: accuracy}}}``.
    """
    model.eval()
    table: dict[str, dict[int, dict[int, float]]] = {}
    for task, spec in tasks.items():
        table[task] = {}
        for level in parse_levels(spec, task):
            instances = heldout_instances(task, level, n, seed)
            table[task][level] = {k: accuracy(model, tokenizer, instances, k) for k in loops}
    return table
