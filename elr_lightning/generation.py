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
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor

from elr_lightning.cache import (
    CACHE_POLICIES,
    KVCache,
    LastLoopCache,
    PerLoopCache,
    PolicyLike,
    kv_cache_bytes,
    layer_caches,
    recurrent_state_bytes,
    resolve_policy,
)
from elr_lightning.checkpoint_io import is_sharded_checkpoint, read_sharded_checkpoint
from elr_lightning.core import check_loops
from elr_lightning.serving import FoldedLM, serving_model
from elr_lightning.model import LoopedLM
from elr_lightning.module import ELRModule

__all__ = [
    "CACHE_POLICIES",
    "GenerationOutput",
    "KVCache",
    "LastLoopCache",
    "PerLoopCache",
    "filter_logits",
    "generate",
    "kv_cache_bytes",
    "layer_caches",
    "left_pad",
    "load_model",
    "recurrent_state_bytes",
    "resolve_policy",
    "sample_next",
    "stream_generate",
]

PromptLike = Union[Tensor, Sequence[Sequence[int]]]


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


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Same device type, and the same index where both name one (``cuda`` is ``cuda:0`` to a generator)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


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
    fold: Optional[bool],
) -> _Job:
    lm = _unwrap(model)
    check_loops(loops)
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
    elif generator is not None and not _same_device(generator.device, device):
        raise ValueError(
            f"generator is on {generator.device} but the model on {device}; pass "
            f"torch.Generator(device={str(device)!r}), or seed=... for a fresh one there"
        )

    def sample(logits: Tensor) -> Tensor:
        return sample_next(logits, temperature, top_k, top_p, greedy, generator)

    cache = _make_cache(kv_cache, need)
    runner = serving_model(lm, loops, fold)  # chosen once per generation, never per token
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
    fold: Optional[bool] = None,
) -> Iterator[Tensor]:
    """Generate token by token, yielding each step's ``[B]`` new tokens as soon as they exist.

    The first token comes after the prefill (the whole prompt through k loops); each further one
    after a single cached decode step. Stops after ``max_new_tokens`` tokens or once every
    sequence has produced ``eos_id``; a finished sequence yields ``pad_id`` from then on. Runs under
    ``torch.inference_mode()`` and on the model's device.

    Args:
        model: The model (an :class:`ELRModule` is unwrapped to its ``LoopedLM``), or one already
            folded for ``loops`` by :func:`~elr_lightning.serving.fold_conditioning`.
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
        generator: Random source for sampling, on the model's device (``ValueError`` otherwise).
        autocast_dtype: Run the model under ``torch.autocast(device.type, dtype)``, e.g.
            ``torch.bfloat16``; ``None`` runs in the weights' dtype.
        fold: Whether to decode with each loop's conditioning constants computed once for this
            ``loops`` and the weights shared (:func:`~elr_lightning.serving.serving_model`, chosen
            once per call, kept per k while the weights are unchanged): the same logits to fp32
            round-off, without running the conditioner per token. ``None`` (default) follows
            ``model.serve_folded`` (on), and a model whose conditioning has no constant form decodes
            as it is, with one warning; ``True`` asks for it (``NotImplementedError`` if impossible);
            ``False`` decodes with the model as it is. A model already folded
            (:func:`~elr_lightning.serving.fold_conditioning`) is used as it is.

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
    fold: Optional[bool] = None,
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
        generator: Random source for sampling, on the model's device (``ValueError`` otherwise).
        autocast_dtype: Autocast dtype, or ``None``.
        callback: Called with each step's ``[B]`` tokens, in order, as they are produced.
        output_logits: Keep every step's next-token logits in :attr:`GenerationOutput.logits`.
        fold: Decode with the conditioning constants of ``loops`` (``None``: ``model.serve_folded`` decides).

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
        ckpt_path: Path of a ``.ckpt`` file written by ``elr fit`` or ``Trainer.save_checkpoint``, or of a
            sharded checkpoint folder (read with :func:`~elr_lightning.checkpoint_io.read_sharded_checkpoint`).
        map_location: Device to load the weights onto.

    Returns:
        ``(model, module)``: the :class:`LoopedLM` in eval mode and the module that holds it.

    Raises:
        FileNotFoundError: No file at ``ckpt_path``.
        ValueError: The file is not a readable ELR Lightning checkpoint.
    """
    if is_sharded_checkpoint(ckpt_path):  # written under FSDP with save_distributed_checkpoint
        with tempfile.TemporaryDirectory() as folder:
            single = os.path.join(folder, os.path.basename(os.path.normpath(ckpt_path)))
            torch.save(read_sharded_checkpoint(ckpt_path), single)
            return load_model(single, map_location)
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
