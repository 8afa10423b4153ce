"""Prompt and cache preparation for generation: padding, checks, the depth of a call, the cache.

:func:`~elr_lightning.inference.generate.generate` and the serving engine take prompts as token lists or
left-padded tensors; these helpers validate them, strip the padding per row (the
:class:`~elr_lightning.inference.decode.Decoder` runs every row from position 0), check the sampling
arguments and build the KV cache.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional, Union

import torch
from torch import Tensor

from elr_lightning.inference.cache import KVCache, PolicyLike, resolve_policy
from elr_lightning.core import check_loops
from elr_lightning.inference.decode import AdaptiveDepth, Depth
from elr_lightning.errors import refuse_unread_flags
from elr_lightning.inference.fold import FoldedLM
from elr_lightning.model import LoopedLM
from elr_lightning.module import ELRModule

#: A prompt: ``[B, T]`` (or ``[T]``) token ids, or a list of token-id lists.
PromptLike = Union[Tensor, Sequence[Sequence[int]]]

#: The value of ``loops`` that asks for adaptive depth per token.
AUTO = "auto"


def resolve_depth(
    loops: Union[int, str, AdaptiveDepth],
    max_loops: Optional[int],
    threshold: Optional[float],
    criterion: Optional[str],
    trained: int,
) -> Depth:
    """The depth a call decodes at: ``loops`` as an integer k, or adaptive for ``"auto"``.

    Args:
        loops: k >= 1, ``"auto"``, or an :class:`~elr_lightning.inference.decode.AdaptiveDepth`.
        max_loops: Budget of ``"auto"`` (``None``: ``trained``).
        threshold: Exit threshold of ``"auto"`` (``None``: 0.001).
        criterion: Exit criterion of ``"auto"`` (:data:`~elr_lightning.inference.decode.EXIT_CRITERIA`; ``None``: ``kl``).
        trained: The model's ``arch.max_loops``.

    Raises:
        ValueError: naming ``loops`` (or the adaptive field) and what it must be, or an adaptive field
            given with another ``loops`` (it would be ignored).
    """
    if loops == AUTO:
        return AdaptiveDepth(
            trained if max_loops is None else max_loops,
            1e-3 if threshold is None else threshold,
            "kl" if criterion is None else criterion,
        )
    flags = {"max_loops": max_loops, "threshold": threshold, "exit_criterion": criterion}
    refuse_unread_flags(flags, "loops='auto'", f"pass loops='auto' instead of loops={loops!r}")
    if isinstance(loops, AdaptiveDepth):
        return loops
    if isinstance(loops, str):
        raise ValueError(f"loops={loops!r} must be an integer >= 1 or 'auto'")
    check_loops(loops)
    return loops


def left_pad(
    prompts: Sequence[Sequence[int]], pad_id: int = 0, device: Optional[torch.device] = None
) -> tuple[Tensor, Tensor]:
    """Stack token lists into a left-padded batch.

    Args:
        prompts: One list of token ids per sequence; none may be empty.
        pad_id: Id written into padding positions (masked out, so any valid id works).
        device: Device of the returned tensors.

    Returns:
        ``(input_ids, attention_mask)``, both ``[B, max_len]`` int64; the mask is 1 on real tokens.

    Raises:
        ValueError: No prompts, or an empty prompt.
    """
    if len(prompts) == 0:
        raise ValueError("no prompts given")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


def check_sampling(temperature: float, top_k: Optional[int], top_p: Optional[float], max_new_tokens: int) -> None:
    """Refuse a sampling argument out of range, naming it."""
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature={temperature} must be a finite number >= 0 (below 1e-5 means greedy)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1 (or None for no top-k filter)")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p} must be in (0, 1] (or None for no nucleus filter)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")


def prompt_rows(ids: Tensor, mask: Optional[Tensor]) -> list[Tensor]:
    """Each row of a left-padded ``[B, T]`` batch without its padding."""
    return [row if mask is None else row[mask[i].bool()] for i, row in enumerate(ids)]


def prepare_prompt(
    prompt: PromptLike, attention_mask: Optional[Tensor], pad_id: int, device: torch.device
) -> tuple[Tensor, Optional[Tensor]]:
    """``(input_ids, mask)`` on ``device``; the mask is ``None`` when nothing is padded."""
    if isinstance(prompt, Tensor):
        ids = prompt[None] if prompt.dim() == 1 else prompt
        if ids.dim() != 2:
            raise ValueError(f"prompt must be [B, T] token ids, got shape {tuple(prompt.shape)}")
        if ids.shape[0] == 0 or ids.shape[1] == 0:
            raise ValueError(f"the prompt is empty (shape {tuple(ids.shape)}); give at least one token")
        mask = None
        if attention_mask is not None:
            mask = attention_mask[None] if attention_mask.dim() == 1 else attention_mask
            if mask.shape != ids.shape:
                raise ValueError(f"attention_mask has shape {tuple(mask.shape)}; expected {tuple(ids.shape)}")
    else:
        if attention_mask is not None:
            raise ValueError("attention_mask is only accepted with a tensor prompt; token lists are padded here")
        ids, mask = left_pad(prompt, pad_id)
    ids = ids.to(device=device, dtype=torch.long)
    if mask is None:
        return ids, None
    mask = mask.to(device=device, dtype=torch.long)
    real = mask.sum(dim=1)
    if bool((real == 0).any()):
        raise ValueError(f"prompt {int((real == 0).nonzero()[0])} is empty (all padding); give at least one token")
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ValueError("attention_mask must be left-padded: zeros (padding) before ones (tokens) in every row")
    return ids, None if bool(mask.all()) else mask


def make_cache(kv_cache: Union[PolicyLike, KVCache], need: int) -> KVCache:
    """A fresh cache of ``need`` positions for the policy, or the fresh instance given (checked)."""
    if isinstance(kv_cache, KVCache):
        if kv_cache.offset != 0:
            raise ValueError(f"the KV cache passed already holds {kv_cache.offset} tokens; pass a fresh one")
        if kv_cache.max_len < need:
            raise ValueError(f"the KV cache passed holds max_len={kv_cache.max_len} tokens; this call needs {need}")
        return kv_cache
    return resolve_policy(kv_cache)(max_len=need)


def unwrap(model: Union[LoopedLM, ELRModule, FoldedLM]) -> Union[LoopedLM, FoldedLM]:
    """The model a module holds (an :class:`ELRModule` is unwrapped to its ``LoopedLM``)."""
    if isinstance(model, ELRModule):
        return model.model
    if isinstance(model, (LoopedLM, FoldedLM)):
        return model
    raise TypeError(f"model must be a LoopedLM, an ELRModule or a FoldedLM, got {type(model).__name__}")



def same_device(a: torch.device, b: torch.device) -> bool:
    """Same device type, and the same index where both name one (``cuda`` is ``cuda:0`` to a generator)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)
