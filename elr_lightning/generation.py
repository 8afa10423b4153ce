"""Text generation with a looped LM at any loop count k, with a pluggable KV-cache policy (DESIGN §7).

Prefill runs the whole (left-padded) prompt through the input block, k loops of the recurrent
block and the output block; decoding then feeds one token per step and reads past keys and values
from a :class:`~elr_lightning.cache.KVCache`:

* :class:`PerLoopCache` keeps one store per (recurrent layer, loop): exact, it reproduces the
  cache-free forward, and holds ``D_eff(k) = L_in + k L_rec + L_out`` layer caches (eq. 1).
* :class:`LastLoopCache` keeps one store per recurrent layer that every loop overwrites: a new
  token's loop i attends to the past tokens' last-loop keys and values plus its own loop-i ones,
  and the attention KV memory stays at the k = 1 level, ``D_eff(1)`` layer caches.

Input and output layers keep one store each under both policies. A new policy is a subclass of
:class:`KVCache` that overrides :meth:`KVCache.key`; pass the class as ``kv_cache``.

Positions stay absolute under left padding: a prompt padded by P tokens starts at position P, and
since RoPE only sees relative offsets inside attention, its logits equal those of the prompt alone.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

import torch
from torch import Tensor

from elr_lightning.cache import KVCache, LastLoopCache, PerLoopCache
from elr_lightning.config import ModelConfig
from elr_lightning.fold import FoldedLM, fold_conditioning
from elr_lightning.model import LoopedLM
from elr_lightning.module import ELRModule
from elr_lightning.tokenizers import Tokenizer, choose_tokenizer

__all__ = [
    "CACHE_POLICIES",
    "GenerationOutput",
    "IncrementalDecoder",
    "KVCache",
    "LastLoopCache",
    "PerLoopCache",
    "filter_logits",
    "generate",
    "generate_command",
    "kv_cache_bytes",
    "layer_caches",
    "left_pad",
    "load_model",
    "resolve_policy",
    "sample_next",
    "stream_generate",
]

#: KV-cache policies by the name ``elr generate --kv_cache`` accepts.
CACHE_POLICIES: dict[str, type[KVCache]] = {"per_loop": PerLoopCache, "last_loop": LastLoopCache}

PolicyLike = Union[str, type[KVCache]]
PromptLike = Union[Tensor, Sequence[Sequence[int]]]


def resolve_policy(policy: PolicyLike) -> type[KVCache]:
    """The :class:`KVCache` subclass that ``policy`` names.

    Args:
        policy: A key of :data:`CACHE_POLICIES` or a :class:`KVCache` subclass.

    Raises:
        ValueError: ``policy`` is neither.
    """
    if isinstance(policy, str):
        if policy not in CACHE_POLICIES:
            raise ValueError(f"unknown KV-cache policy {policy!r}; choose one of {sorted(CACHE_POLICIES)}")
        return CACHE_POLICIES[policy]
    if isinstance(policy, type) and issubclass(policy, KVCache):
        return policy
    raise ValueError(f"kv_cache={policy!r} must be one of {sorted(CACHE_POLICIES)} or a KVCache subclass")


def layer_caches(config: ModelConfig, loops: int, policy: PolicyLike) -> int:
    """Number of layer caches (distinct stores) ``policy`` keeps at loop count ``loops``.

    Counts the distinct :meth:`KVCache.key` values over the attention calls of one forward pass, in
    the model's numbering: input layers at loop 0, recurrent layers at loops ``1..k``, output
    layers at loop 0. ``PerLoopCache`` gives ``D_eff(k) = L_in + k L_rec + L_out`` (eq. 1),
    ``LastLoopCache`` gives ``D_eff(1)``.

    Args:
        config: The architecture.
        loops: The loop count k.
        policy: A policy name or :class:`KVCache` subclass.
    """
    cache = resolve_policy(policy)(max_len=1)
    first_out = config.n_in + config.n_rec
    calls = [(j, 0) for j in range(config.n_in)]
    calls += [(config.n_in + j, i) for i in range(1, loops + 1) for j in range(config.n_rec)]
    calls += [(first_out + j, 0) for j in range(config.n_out)]
    return len({cache.key(layer, loop) for layer, loop in calls})


def kv_cache_bytes(
    config: ModelConfig,
    loops: int,
    policy: PolicyLike,
    tokens: int,
    dtype: torch.dtype = torch.float32,
    batch: int = 1,
) -> int:
    """Attention KV bytes ``policy`` holds for ``tokens`` tokens of ``batch`` sequences.

    Per layer cache and token: keys and values, ``2 * n_kv_heads * head_dim`` elements of
    ``dtype``; times :func:`layer_caches` (``D_eff(k)`` for per-loop, ``D_eff(1)`` for last-loop).

    Args:
        config: The architecture.
        loops: The loop count k.
        policy: A policy name or :class:`KVCache` subclass.
        tokens: Cached positions per sequence (prompt, padding included, plus decoded tokens).
        dtype: Dtype of the cached keys and values.
        batch: Sequences in the batch.
    """
    per_token = 2 * config.kv_heads * config.head_dim * torch.empty((), dtype=dtype).element_size()
    return layer_caches(config, loops, policy) * per_token * tokens * batch


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


def filter_logits(logits: Tensor, top_k: Optional[int] = None, top_p: Optional[float] = None) -> Tensor:
    """Set logits outside the top-k / nucleus (top-p) support to ``-inf``.

    Top-p keeps the smallest set of most likely tokens whose probability reaches ``top_p``; the
    most likely token is always kept.

    Args:
        logits: ``[B, V]`` logits (already divided by the temperature).
        top_k: Keep the ``top_k`` largest logits per row; ``None`` keeps all.
        top_p: Nucleus mass in ``(0, 1]``; ``None`` or 1 keeps all.
    """
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop = (mass_before >= top_p).scatter(-1, order, mass_before >= top_p)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    greedy: bool = False,
    generator: Optional[torch.Generator] = None,
) -> Tensor:
    """Pick the next token of each row of ``logits`` ``[B, V]``.

    Args:
        logits: Next-token logits.
        temperature: Softmax temperature; 0 means greedy.
        top_k: Sample among the ``top_k`` most likely tokens only.
        top_p: Sample from the nucleus of mass ``top_p`` only.
        greedy: Take the argmax (same as ``temperature=0``).
        generator: Random source for sampling.

    Returns:
        ``[B]`` int64 token ids.
    """
    if greedy or temperature == 0:
        return logits.argmax(dim=-1)
    scaled = filter_logits(logits.float() / temperature, top_k, top_p)
    return torch.multinomial(scaled.softmax(dim=-1), 1, generator=generator).squeeze(-1)


def _check_sampling(temperature: float, top_k: Optional[int], top_p: Optional[float], max_new_tokens: int) -> None:
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 means greedy)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1 (or None for no top-k filter)")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p} must be in (0, 1] (or None for no nucleus filter)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")


def _prepare_prompt(
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


def _make_cache(kv_cache: Union[PolicyLike, KVCache], need: int) -> KVCache:
    if isinstance(kv_cache, KVCache):
        if kv_cache.offset != 0:
            raise ValueError(f"the KV cache passed already holds {kv_cache.offset} tokens; pass a fresh one")
        if kv_cache.max_len < need:
            raise ValueError(f"the KV cache passed holds max_len={kv_cache.max_len} tokens; this call needs {need}")
        return kv_cache
    return resolve_policy(kv_cache)(max_len=need)


def _unwrap(model: Union[LoopedLM, ELRModule, FoldedLM]) -> Union[LoopedLM, FoldedLM]:
    if isinstance(model, ELRModule):
        return model.model
    if isinstance(model, (LoopedLM, FoldedLM)):
        return model
    raise TypeError(f"model must be a LoopedLM, an ELRModule or a FoldedLM, got {type(model).__name__}")


@dataclass
class _Job:
    """A validated generation request, ready to run."""

    model: Union[LoopedLM, FoldedLM]
    input_ids: Tensor
    mask: Optional[Tensor]
    cache: KVCache
    loops: int
    max_new_tokens: int
    sample: Callable[[Tensor], Tensor]
    eos_id: Optional[int]
    pad_id: int
    autocast_dtype: Optional[torch.dtype]


def _prepare(
    model: Union[LoopedLM, ELRModule, FoldedLM],
    prompt: PromptLike,
    *,
    loops: int,
    attention_mask: Optional[Tensor],
    max_new_tokens: int,
    kv_cache: Union[PolicyLike, KVCache],
    temperature: float,
    top_k: Optional[int],
    top_p: Optional[float],
    greedy: bool,
    eos_id: Optional[int],
    pad_id: int,
    seed: Optional[int],
    generator: Optional[torch.Generator],
    autocast_dtype: Optional[torch.dtype],
    fold: bool,
) -> _Job:
    lm = _unwrap(model)
    if loops < 1:
        raise ValueError(f"loops={loops} must be >= 1")
    _check_sampling(temperature, top_k, top_p, max_new_tokens)
    device = lm.embed.weight.device
    ids, mask = _prepare_prompt(prompt, attention_mask, pad_id, device)
    need = ids.shape[1] + max_new_tokens - 1
    if need > lm.config.max_seq_len:
        raise ValueError(
            f"a prompt of {ids.shape[1]} tokens plus max_new_tokens={max_new_tokens} needs {need} positions, more "
            f"than arch.max_seq_len={lm.config.max_seq_len}; shorten the prompt or lower max_new_tokens"
        )
    if generator is None and seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)

    def sample(logits: Tensor) -> Tensor:
        return sample_next(logits, temperature, top_k, top_p, greedy, generator)

    cache = _make_cache(kv_cache, need)
    runner = fold_conditioning(lm, loops) if fold and isinstance(lm, LoopedLM) else lm
    return _Job(runner, ids, mask, cache, loops, max_new_tokens, sample, eos_id, pad_id, autocast_dtype)


@torch.inference_mode()
def _run(job: _Job) -> Iterator[tuple[Tensor, Tensor]]:
    """Prefill, then decode one token per step; yield ``(tokens [B], logits [B, V])`` per step."""
    device = job.input_ids.device
    mask, cache = job.mask, job.cache
    amp = (
        torch.autocast(device.type, dtype=job.autocast_dtype)
        if job.autocast_dtype is not None
        else contextlib.nullcontext()
    )

    def forward(tokens: Tensor) -> Tensor:
        nonlocal mask
        if mask is not None and cache.offset > 0:
            mask = torch.cat((mask, mask.new_ones(mask.shape[0], tokens.shape[1])), dim=1)
        with amp:
            return job.model(tokens, job.loops, mask, cache)[:, -1].float()

    finished = torch.zeros(job.input_ids.shape[0], dtype=torch.bool, device=device)
    logits = forward(job.input_ids)
    for n in range(job.max_new_tokens):
        tokens = job.sample(logits)
        if job.eos_id is not None:
            tokens = tokens.masked_fill(finished, job.pad_id)
            finished |= tokens == job.eos_id
        yield tokens, logits
        if n + 1 == job.max_new_tokens or (job.eos_id is not None and bool(finished.all())):
            return
        logits = forward(tokens[:, None])


@dataclass
class GenerationOutput:
    """What :func:`generate` returns.

    Attributes:
        sequences: ``[B, T + n]``: the (left-padded) prompt followed by the ``n`` generated tokens;
            after a sequence's EOS its remaining positions hold ``pad_id``.
        new_tokens: ``[B, n]``: the generated tokens alone.
        logits: ``[B, n, V]`` fp32 next-token logits (before temperature and filtering) that each
            new token was drawn from, when ``output_logits=True``; else ``None``.
        cache: The KV cache after the last step (for memory accounting).
    """

    sequences: Tensor
    new_tokens: Tensor
    logits: Optional[Tensor]
    cache: KVCache


def stream_generate(
    model: Union[LoopedLM, ELRModule, FoldedLM],
    prompt: PromptLike,
    *,
    loops: int = 1,
    attention_mask: Optional[Tensor] = None,
    max_new_tokens: int = 32,
    kv_cache: Union[PolicyLike, KVCache] = "per_loop",
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    greedy: bool = False,
    eos_id: Optional[int] = None,
    pad_id: int = 0,
    seed: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
    autocast_dtype: Optional[torch.dtype] = None,
    fold: bool = False,
) -> Iterator[Tensor]:
    """Generate token by token, yielding each step's ``[B]`` new tokens as soon as they exist.

    The first token comes after the prefill (the whole prompt through k loops); each further one
    after a single cached decode step. Stops after ``max_new_tokens`` tokens or once every
    sequence has produced ``eos_id``; a finished sequence yields ``pad_id`` from then on. Runs under
    ``torch.inference_mode()`` and on the model's device.

    Args:
        model: The model (an :class:`ELRModule` is unwrapped to its ``LoopedLM``), or one already
            folded for ``loops`` by :func:`~elr_lightning.fold.fold_conditioning`.
        prompt: ``[B, T]`` (or ``[T]``) token ids, left-padded when ``attention_mask`` marks padding,
            or a list of token-id lists, left-padded here.
        loops: The loop count k (any k >= 1; above ``arch.max_loops`` extrapolates).
        attention_mask: ``[B, T]`` with 1 on real tokens, 0 on (left) padding; honoured in every
            loop of prefill and decode.
        max_new_tokens: Most tokens to generate per sequence.
        kv_cache: ``"per_loop"``, ``"last_loop"``, a :class:`KVCache` subclass, or a fresh instance
            with ``max_len >= T + max_new_tokens - 1`` (to inspect it afterwards).
        temperature: Softmax temperature; 0 is greedy.
        top_k: Sample among the ``top_k`` most likely tokens only.
        top_p: Sample from the nucleus of mass ``top_p`` only.
        greedy: Always take the most likely token.
        eos_id: End-of-sequence id, or ``None`` to always run ``max_new_tokens`` steps.
        pad_id: Id for padding and for the positions after a sequence's EOS.
        seed: Seed of a fresh ``torch.Generator`` on the model's device (ignored with ``generator``).
        generator: Random source for sampling.
        autocast_dtype: Run the model under ``torch.autocast(device.type, dtype)``, e.g.
            ``torch.bfloat16``; ``None`` runs in the weights' dtype.
        fold: Fold the loop conditioning into the layers' weights for this ``loops`` once, before
            the prefill (:func:`~elr_lightning.fold.fold_conditioning`): faster steps, the same
            logits up to rounding, and the recurrent weights held k times while it runs. A model
            folded already is used as it is.

    Returns:
        An iterator over ``[B]`` int64 tokens, one tensor per step. The arguments are checked
        here, before the iterator is returned; the model runs as it is consumed.

    Raises:
        ValueError: An empty or badly padded prompt, a bad sampling argument, or a sequence longer
            than ``arch.max_seq_len``.
    """
    job = _prepare(
        model,
        prompt,
        loops=loops,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        kv_cache=kv_cache,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        greedy=greedy,
        eos_id=eos_id,
        pad_id=pad_id,
        seed=seed,
        generator=generator,
        autocast_dtype=autocast_dtype,
        fold=fold,
    )
    return (tokens for tokens, _ in _run(job))


def generate(
    model: Union[LoopedLM, ELRModule, FoldedLM],
    prompt: PromptLike,
    *,
    loops: int = 1,
    attention_mask: Optional[Tensor] = None,
    max_new_tokens: int = 32,
    kv_cache: Union[PolicyLike, KVCache] = "per_loop",
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    greedy: bool = False,
    eos_id: Optional[int] = None,
    pad_id: int = 0,
    seed: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
    autocast_dtype: Optional[torch.dtype] = None,
    callback: Optional[Callable[[Tensor], None]] = None,
    output_logits: bool = False,
    fold: bool = False,
) -> GenerationOutput:
    """Generate continuations of a batch of prompts; see :func:`stream_generate` for the arguments.

    Args:
        model: The model.
        prompt: Token ids ``[B, T]`` or a list of token-id lists.
        loops: The loop count k.
        attention_mask: ``[B, T]`` left-padding mask for a tensor prompt.
        max_new_tokens: Most tokens to generate per sequence.
        kv_cache: Policy name, :class:`KVCache` subclass, or fresh instance.
        temperature: Softmax temperature; 0 is greedy.
        top_k: Top-k filter.
        top_p: Nucleus filter.
        greedy: Always take the most likely token.
        eos_id: End-of-sequence id.
        pad_id: Id for padding and for positions after EOS.
        seed: Seed of a fresh generator on the model's device.
        generator: Random source for sampling.
        autocast_dtype: Autocast dtype, or ``None``.
        callback: Called with each step's ``[B]`` tokens, in order, as they are produced.
        output_logits: Keep every step's next-token logits in :attr:`GenerationOutput.logits`.
        fold: Fold the loop conditioning into the weights before the prefill.

    Returns:
        The prompt with its continuations, the new tokens, optionally the logits, and the cache.
    """
    job = _prepare(
        model,
        prompt,
        loops=loops,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        kv_cache=kv_cache,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        greedy=greedy,
        eos_id=eos_id,
        pad_id=pad_id,
        seed=seed,
        generator=generator,
        autocast_dtype=autocast_dtype,
        fold=fold,
    )
    tokens, logits = [], []
    for step_tokens, step_logits in _run(job):
        tokens.append(step_tokens)
        if output_logits:
            logits.append(step_logits)
        if callback is not None:
            callback(step_tokens)
    new_tokens = torch.stack(tokens, dim=1)
    return GenerationOutput(
        sequences=torch.cat((job.input_ids, new_tokens), dim=1),
        new_tokens=new_tokens,
        logits=torch.stack(logits, dim=1) if output_logits else None,
        cache=job.cache,
    )


def load_model(ckpt_path: str, map_location: Union[str, torch.device] = "cpu") -> tuple[LoopedLM, ELRModule]:
    """Load a Lightning checkpoint of an :class:`ELRModule` (or subclass) for generation.

    Checkpoints are treated as trusted files: they are unpickled with ``weights_only=False``,
    because a module built in Python keeps its plug-ins (state update, conditioner) as objects in
    its hyperparameters. Only load checkpoints you made or trust.

    Args:
        ckpt_path: Path of a ``.ckpt`` file written by ``elr fit`` or ``Trainer.save_checkpoint``.
        map_location: Device to load the weights onto.

    Returns:
        ``(model, module)``: the :class:`LoopedLM` in eval mode and the module that holds it.

    Raises:
        FileNotFoundError: No file at ``ckpt_path``.
        ValueError: The file is not a readable ELR Lightning checkpoint.
    """
    if not os.path.isfile(ckpt_path):
        raise FileNotFoundError(f"checkpoint {ckpt_path!r} does not exist")
    try:
        raw = torch.load(ckpt_path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as err:  # torch.load raises many types (pickle, zip, EOF) for a bad file
        raise ValueError(f"checkpoint {ckpt_path!r} is not a readable PyTorch checkpoint ({err})") from err
    if not isinstance(raw, dict) or "state_dict" not in raw or "hyper_parameters" not in raw:
        keys = sorted(raw)[:8] if isinstance(raw, dict) else type(raw).__name__
        raise ValueError(
            f"checkpoint {ckpt_path!r} is not a Lightning ELRModule checkpoint (need 'state_dict' and "
            f"'hyper_parameters', found {keys}); use one written by `elr fit` or Trainer.save_checkpoint"
        )
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*is an instance of `nn.Module`.*")
            module = ELRModule.load_from_checkpoint(
                ckpt_path, map_location=map_location, weights_only=False, meta_init=False  # real weights to load into
            )
    except Exception as err:  # hparams that no longer match the module's signature, missing keys, ...
        raise ValueError(f"checkpoint {ckpt_path!r} could not be rebuilt as an ELRModule ({err})") from err
    if not isinstance(module, ELRModule) or not isinstance(getattr(module, "model", None), LoopedLM):
        raise ValueError(f"checkpoint {ckpt_path!r} holds a {type(module).__name__}, not an ELRModule")
    module.eval()
    return module.model, module


class IncrementalDecoder:
    """Turn a growing list of token ids into text pieces as they become printable.

    Decodes the whole id list each step and emits the new suffix, holding back a trailing
    U+FFFD (an incomplete UTF-8 character of a byte-level vocabulary) until the next token
    completes it or :meth:`flush` is called. Assumes the decoding of a prefix of ids is a prefix
    of the decoding of the whole list, as for byte and byte-level BPE tokenizers.

    Args:
        tokenizer: The tokenizer to decode with.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, token: int) -> str:
        """Add one token id; return the text that became final (possibly empty)."""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        return self._emit(text)

    def flush(self) -> str:
        """Return whatever text is still held back."""
        return self._emit(self.tokenizer.decode(self.ids))

    def _emit(self, text: str) -> str:
        piece = text[len(self.emitted) :]
        self.emitted = text
        return piece


def _command_parser() -> Any:
    from jsonargparse import ActionYesNo, ArgumentParser

    parser = ArgumentParser(
        prog="elr generate",
        description="Stream a continuation of a prompt from an ELR checkpoint at any loop count.",
    )
    parser.add_argument("--ckpt_path", type=str, required=True, help="Checkpoint written by `elr fit`.")
    parser.add_argument("--prompt", type=Optional[str], default=None, help="Prompt text.")
    parser.add_argument("--prompt_file", type=Optional[str], default=None, help="Read the prompt from this file.")
    parser.add_argument("--loops", type=int, default=1, help="Loop count k.")
    parser.add_argument(
        "--kv_cache", type=Literal["per_loop", "last_loop"], default="per_loop", help="KV-cache policy."
    )
    parser.add_argument(
        "--max_new_tokens",
        type=Optional[int],
        default=None,
        help="Tokens to generate; default: up to arch.max_seq_len.",
    )
    parser.add_argument("--temperature", type=float, default=1.0, help="Softmax temperature; 0 is greedy.")
    parser.add_argument("--top_k", type=Optional[int], default=None, help="Top-k filter.")
    parser.add_argument("--top_p", type=Optional[float], default=None, help="Nucleus (top-p) filter.")
    parser.add_argument("--seed", type=Optional[int], default=None, help="Sampling seed.")
    parser.add_argument(
        "--tokenizer",
        type=Optional[str],
        default=None,
        help="'byte' or a tokenizer.json path; default: the one saved in the checkpoint (bytes if none).",
    )
    parser.add_argument(
        "--allow_extrapolation",
        action=ActionYesNo,
        default=False,
        help="Allow --loops above the checkpoint's max_loops (with a warning).",
    )
    parser.add_argument(
        "--fold",
        action=ActionYesNo,
        default=False,
        help="Fold the loop conditioning into the weights for --loops before generating (faster decoding).",
    )
    parser.add_argument("--stats", action=ActionYesNo, default=False, help="Print KV memory and tokens/s to stderr.")
    parser.add_argument("--device", type=str, default="cpu", help="Device to run on, e.g. cpu or cuda.")
    parser.add_argument(
        "--dtype", type=Literal["float32", "bfloat16"], default="float32", help="bfloat16 runs under autocast."
    )
    parser.add_argument(
        "--echo_prompt", action=ActionYesNo, default=True, help="Print the prompt before the continuation."
    )
    return parser


def generate_command(argv: list[str]) -> None:
    """``elr generate``: stream a checkpoint's continuation of a prompt to stdout.

    Args:
        argv: The arguments after ``generate``; see ``elr generate --help``.

    Raises:
        ValueError: No or empty prompt, ``--loops`` above the checkpoint's ``arch.max_loops``
            without ``--allow_extrapolation``, a bad checkpoint, or a too-long request.
        FileNotFoundError: A missing checkpoint, prompt file or tokenizer file.
    """
    args = _command_parser().parse_args(argv)
    if (args.prompt is None) == (args.prompt_file is None):
        raise ValueError("give exactly one of --prompt and --prompt_file")
    if args.prompt_file is not None:
        with open(args.prompt_file, encoding="utf-8") as f:
            text = f.read()
    else:
        text = args.prompt
    if not text:
        raise ValueError("the prompt is empty; pass some text with --prompt or --prompt_file")
    device = torch.device(args.device)
    model, module = load_model(args.ckpt_path, map_location=device)
    config = model.config
    tokenizer = choose_tokenizer(module.tokenizer, args.tokenizer, config.vocab_size)
    if args.loops < 1:
        raise ValueError(f"--loops {args.loops} must be >= 1")
    if args.loops > config.max_loops:
        message = (
            f"--loops {args.loops} is above the checkpoint's arch.max_loops={config.max_loops}, the loop budget "
            "it was trained for"
        )
        if not args.allow_extrapolation:
            raise ValueError(f"{message}; pass --allow_extrapolation to run it anyway")
        warnings.warn(f"{message}; extrapolating", stacklevel=2)
    ids = tokenizer.encode(text)
    if not ids:
        raise ValueError("the prompt encodes to no tokens; pass some text with --prompt or --prompt_file")
    max_new = args.max_new_tokens
    if max_new is None:
        max_new = config.max_seq_len - len(ids) + 1
        if max_new < 1:
            raise ValueError(
                f"the prompt has {len(ids)} tokens, more than arch.max_seq_len={config.max_seq_len}; shorten it"
            )
    cache = resolve_policy(args.kv_cache)(max_len=max(1, len(ids) + max_new - 1))
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else None
    decoder = IncrementalDecoder(tokenizer)
    if args.echo_prompt:
        sys.stdout.write(text)
        sys.stdout.flush()
    stream = stream_generate(
        model,
        torch.tensor([ids]),
        loops=args.loops,
        max_new_tokens=max_new,
        kv_cache=cache,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        eos_id=tokenizer.eos_id,
        seed=args.seed,
        autocast_dtype=dtype,
        fold=args.fold,
    )
    start = time.perf_counter()
    first_at, generated = start, 0
    for tokens in stream:
        if generated == 0:
            first_at = time.perf_counter()
        generated += 1
        token = int(tokens[0])
        if token == tokenizer.eos_id:
            break
        sys.stdout.write(decoder.push(token))
        sys.stdout.flush()
    end = time.perf_counter()
    sys.stdout.write(decoder.flush() + "\n")
    sys.stdout.flush()
    if args.stats:
        _print_stats(config, args.loops, args.kv_cache, cache, len(ids), generated, first_at - start, end - first_at)


def _print_stats(
    config: ModelConfig,
    loops: int,
    policy: str,
    cache: KVCache,
    prompt_tokens: int,
    generated: int,
    prefill_s: float,
    decode_s: float,
) -> None:
    dtype = cache.dtype or torch.float32
    tokens = max(cache.offset, 1)

    def mib(n: int) -> str:
        return f"{n / 2**20:.3f} MiB"

    lines = [
        f"loops k={loops}  D_eff={config.effective_depth(loops)}  kv_cache={policy}  dtype={dtype}",
        f"KV cache: {mib(cache.nbytes())} used for {cache.offset} tokens, {mib(cache.nbytes(used=False))} allocated",
    ]
    for name in CACHE_POLICIES:
        n = kv_cache_bytes(config, loops, name, tokens, dtype)
        lines.append(
            f"  {name:9s}: {layer_caches(config, loops, name)} layer caches, {n // tokens} B/token, "
            f"{mib(n)} for {tokens} tokens"
        )
    prefill_rate = prompt_tokens / max(prefill_s, 1e-9)
    lines.append(f"prefill: {prompt_tokens} tokens in {prefill_s:.3f} s ({prefill_rate:.1f} tok/s)")
    decoded = generated - 1
    if decoded > 0:
        lines.append(f"decode: {decoded} tokens in {decode_s:.3f} s ({decoded / max(decode_s, 1e-9):.1f} tok/s)")
    sys.stderr.write("\n".join(lines) + "\n")
