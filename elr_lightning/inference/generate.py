"""Text generation with a looped LM at any loop count k, or adaptive per token, with a pluggable KV-cache policy (DESIGN §7).

Each prompt is prefilled alone (the whole prompt through the input block, k loops of the
recurrent block and the output block) into its row of a :class:`~elr_lightning.inference.cache.KVCache`;
decoding then feeds one token per row and step through the
:class:`~elr_lightning.inference.decode.Decoder` that ``elr serve`` also runs, reading past keys and values
from the cache:

* :class:`~elr_lightning.inference.cache.PerLoopCache` keeps one store per (recurrent layer, loop): exact, it
  reproduces the cache-free forward, and holds ``D_eff(k) = L_in + k L_rec + L_out`` layer caches (eq. 1).
* :class:`~elr_lightning.inference.cache.LastLoopCache` keeps one store per recurrent layer that every loop
  overwrites: a new token's loop i attends to the past tokens' last-loop keys and values plus its
  own loop-i ones, and the attention KV memory stays at the k = 1 level, ``D_eff(1)`` layer caches.

Input and output layers keep one store each under both policies. A new policy is a subclass of
:class:`~elr_lightning.inference.cache.KVCache` that overrides ``key``; pass the class as ``kv_cache``.

``loops="auto"`` decodes each new token at its own depth (:class:`~elr_lightning.inference.decode.AdaptiveDepth`):
up to ``max_loops`` loops, leaving once the ``exit_criterion`` falls below ``threshold``.

Left padding of a tensor prompt is stripped per row; every row starts at position 0, so a padded
prompt's logits equal those of the prompt alone (to the fp32 round-off of batching).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor

from elr_lightning.inference.cache import KVCache, PolicyLike
from elr_lightning.checkpoints.io import is_sharded_checkpoint, read_sharded_checkpoint
from elr_lightning.inference.decode import AdaptiveDepth, Decoder, Depth, budget
from elr_lightning.checkpoints.schema import CheckpointConfigError
from elr_lightning.checkpoints.safe_load import (
    OversizedCheckpointError,
    UnsafeCheckpointError,
    check_regular_file,
    read_checkpoint,
    refuse_url,
)
from elr_lightning.inference.fold import FoldedLM
from elr_lightning.model import LoopedLM
from elr_lightning.module import ELRModule
from elr_lightning.inference.prompts import (
    PromptLike,
    check_sampling,
    make_cache,
    prepare_prompt,
    prompt_rows,
    resolve_depth,
    same_device,
    unwrap,
)
from elr_lightning.checkpoints.trust import UntrustedModuleError

__all__ = ["GenerationOutput", "filter_logits", "generate", "load_model", "sample_next", "stream_generate"]

LoopsLike = Union[int, str, AdaptiveDepth]


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


#: Temperatures below this are greedy, as in vLLM: dividing fp32 logits by a smaller one can overflow
#: them to ``inf`` (a NaN distribution), and long before that the softmax is already one-hot.
MIN_TEMPERATURE = 1e-5


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
        temperature: Softmax temperature; below :data:`MIN_TEMPERATURE` (0 included) means greedy.
        top_k: Sample among the ``top_k`` most likely tokens only.
        top_p: Sample from the nucleus of mass ``top_p`` only.
        greedy: Take the argmax (same as ``temperature=0``).
        generator: Random source for sampling.

    Returns:
        ``[B]`` int64 token ids.
    """
    if greedy or temperature < MIN_TEMPERATURE:
        return logits.argmax(dim=-1)
    scaled = filter_logits(logits.float() / temperature, top_k, top_p)
    return torch.multinomial(scaled.softmax(dim=-1), 1, generator=generator).squeeze(-1)


@dataclass
class _Job:
    """A validated generation request, ready to run."""

    decoder: Decoder
    input_ids: Tensor
    rows: list[Tensor]
    depth: Depth
    max_new_tokens: int
    sample: Callable[[Tensor], Tensor]
    eos_id: Optional[int]
    pad_id: int


def _prepare(
    model: Union[LoopedLM, ELRModule, FoldedLM],
    prompt: PromptLike,
    *,
    loops: LoopsLike,
    max_loops: Optional[int],
    threshold: Optional[float],
    exit_criterion: Optional[str],
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
    lm = unwrap(model)
    depth = resolve_depth(loops, max_loops, threshold, exit_criterion, lm.config.max_loops)
    if isinstance(lm, FoldedLM) and (budget(depth) != lm.loops or isinstance(depth, AdaptiveDepth)):
        raise ValueError(f"this model is folded for loops={lm.loops}, called with loops={loops!r}; pass the model")
    check_sampling(temperature, top_k, top_p, max_new_tokens)
    device = lm.embed.weight.device
    ids, mask = prepare_prompt(prompt, attention_mask, pad_id, device)
    need = ids.shape[1] + max_new_tokens - 1
    if need > lm.config.max_seq_len:
        raise ValueError(
            f"a prompt of {ids.shape[1]} tokens plus max_new_tokens={max_new_tokens} needs {need} positions, more "
            f"than arch.max_seq_len={lm.config.max_seq_len}; shorten the prompt or lower max_new_tokens"
        )
    if generator is None and seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    elif generator is not None and not same_device(generator.device, device):
        raise ValueError(
            f"generator is on {generator.device} but the model on {device}; pass "
            f"torch.Generator(device={str(device)!r}), or seed=... for a fresh one there"
        )

    def sample(logits: Tensor) -> Tensor:
        return sample_next(logits, temperature, top_k, top_p, greedy, generator)

    cache = make_cache(kv_cache, need)
    decoder = Decoder(lm, ids.shape[0], need, cache, autocast_dtype, fold)
    return _Job(decoder, ids, prompt_rows(ids, mask), depth, max_new_tokens, sample, eos_id, pad_id)


@torch.inference_mode()
def _run(job: _Job) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
    """Prefill every row, then decode one token per step; yield ``(tokens [B], logits [B, V], loops [B])``.

    A row that produced ``eos_id`` stops decoding; it yields ``pad_id`` and its last logits from then on.
    """
    decoder, depth = job.decoder, job.depth
    batch = len(job.rows)
    logits = torch.stack([decoder.prefill(i, row, depth) for i, row in enumerate(job.rows)])
    used = torch.full((batch,), budget(depth), dtype=torch.long)
    finished = torch.zeros(batch, dtype=torch.bool, device=logits.device)
    for n in range(job.max_new_tokens):
        tokens = job.sample(logits)
        if job.eos_id is not None:
            tokens = tokens.masked_fill(finished, job.pad_id)
            finished |= tokens == job.eos_id
        yield tokens, logits, used
        if n + 1 == job.max_new_tokens or (job.eos_id is not None and bool(finished.all())):
            return
        slots = [i for i in range(batch) if job.eos_id is None or not finished[i]]
        step, step_used = decoder.step(slots, tokens[slots], [depth] * len(slots))
        logits, used = logits.clone(), torch.zeros(batch, dtype=torch.long)
        logits[slots], used[slots] = step, step_used


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
        loops_used: ``[B, n]``: the recurrent loops each new token's logits took (the prompt's for
            the first; 0 after a sequence's EOS).
    """

    sequences: Tensor
    new_tokens: Tensor
    logits: Optional[Tensor]
    cache: KVCache
    loops_used: Tensor


def stream_generate(
    model: Union[LoopedLM, ELRModule, FoldedLM],
    prompt: PromptLike,
    *,
    loops: LoopsLike = 1,
    max_loops: Optional[int] = None,
    threshold: Optional[float] = None,
    exit_criterion: Optional[str] = None,
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

    Under ``kv_cache="last_loop"`` at k > 1 the logits depend on how the text reached the cache: a
    prompt prefilled in one pass runs loop i over the earlier tokens' loop-i keys and values, but a
    token decoded alone reads their loop-k ones (the one entry per layer every loop overwrote). So
    the same prompt decoded token by token gives other logits than prefilled (up to 3.8 at k = 2
    and 4.3 at k = 3 on the quickstart checkpoint; 2e-5 under ``per_loop`` and at k = 1,
    ``bench/last_loop.py``), and a continuation depends on where a prompt is split between prefill
    and decoding. This function always prefills the whole prompt; ``per_loop`` is exact.

    Takes the arguments of :func:`generate` but ``callback`` and ``output_logits``.

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
        max_loops=max_loops,
        threshold=threshold,
        exit_criterion=exit_criterion,
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
    return (tokens for tokens, _, _ in _run(job))


def generate(
    model: Union[LoopedLM, ELRModule, FoldedLM],
    prompt: PromptLike,
    *,
    loops: LoopsLike = 1,
    max_loops: Optional[int] = None,
    threshold: Optional[float] = None,
    exit_criterion: Optional[str] = None,
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
    """Generate continuations of a batch of prompts at any loop count k, or with adaptive depth per token.

    Runs as :func:`stream_generate` (prefill, then one cached decode step per token) and collects its tokens.

    Args:
        model: The model (an :class:`ELRModule` is unwrapped to its ``LoopedLM``), or one already
            folded for ``loops`` by :func:`~elr_lightning.inference.fold.fold_conditioning`.
        prompt: ``[B, T]`` (or ``[T]``) token ids, left-padded when ``attention_mask`` marks padding,
            or a list of token-id lists, left-padded here.
        loops: The loop count k (any k >= 1; above ``arch.max_loops`` extrapolates), ``"auto"`` for
            adaptive depth per new token, or an :class:`~elr_lightning.inference.decode.AdaptiveDepth`.
        max_loops: Budget of ``"auto"`` (``None``: ``arch.max_loops``); the prompt runs at it.
        threshold: Exit threshold of ``"auto"``: a token leaves once its change is below it
            (``None``: 0.001).
        exit_criterion: ``"kl"`` (Huginn's, the default) or ``"delta"`` (relative state change); see
            :data:`~elr_lightning.inference.decode.EXIT_CRITERIA`. ``max_loops``, ``threshold`` and
            ``exit_criterion`` are refused with another ``loops`` (they would be ignored).
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
        callback: Called with each step's ``[B]`` tokens, in order, as they are produced.
        output_logits: Keep every step's next-token logits in :attr:`GenerationOutput.logits`.
        fold: Whether to decode with each loop's conditioning constants computed once for this
            ``loops`` and the weights shared (:func:`~elr_lightning.inference.fold.serving_model`, built
            anew in every call from the weights as they are, so no change of the weights between
            calls is missed): the same logits to fp32 round-off, without running the conditioner
            per token. ``None`` (default) follows
            ``model.serve_folded`` (on), and a model whose conditioning has no constant form decodes
            as it is, with one warning; ``True`` asks for it (``NotImplementedError`` if impossible);
            ``False`` decodes with the model as it is. A model already folded
            (:func:`~elr_lightning.inference.fold.fold_conditioning`) is used as it is.

    Returns:
        The prompt with its continuations, the new tokens, optionally the logits, and the cache.
    """
    job = _prepare(
        model,
        prompt,
        loops=loops,
        max_loops=max_loops,
        threshold=threshold,
        exit_criterion=exit_criterion,
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
    tokens, logits, used = [], [], []
    for step_tokens, step_logits, step_used in _run(job):
        tokens.append(step_tokens)
        used.append(step_used)
        if output_logits:
            logits.append(step_logits)
        if callback is not None:
            callback(step_tokens)
    new_tokens = torch.stack(tokens, dim=1)
    return GenerationOutput(
        sequences=torch.cat((job.input_ids, new_tokens), dim=1),
        new_tokens=new_tokens,
        logits=torch.stack(logits, dim=1) if output_logits else None,
        cache=job.decoder.cache,
        loops_used=torch.stack(used, dim=1),
    )


def load_model(
    ckpt_path: str, map_location: Union[str, torch.device] = "cpu", meta: bool = False
) -> tuple[LoopedLM, ELRModule]:
    """Load a Lightning checkpoint of an :class:`ELRModule` (or subclass) for generation.

    The file is data, never code: it is read with ``torch.load(..., weights_only=True)`` and a file
    that holds a pickled object is refused (:mod:`elr_lightning.checkpoints.safe_load`; a checkpoint of an
    earlier version is converted once with ``elr upgrade-checkpoint OLD NEW --trust``). What it says
    about the model is checked against the schema of :mod:`elr_lightning.checkpoints.schema` before
    anything is imported: plain data everywhere, and classes (plug-ins, layers) only in the seams'
    fields, only from the library and the modules you trust (``--trust_module``, ``ELR_TRUST_MODULES``
    or :func:`~elr_lightning.checkpoints.trust.trust_modules`); a module already imported is not trusted for
    that. Then the plug-ins are built as they describe.

    Args:
        ckpt_path: Path of a ``.ckpt`` file written by ``elr fit`` or ``Trainer.save_checkpoint``, or of a
            sharded checkpoint folder (read with :func:`~elr_lightning.checkpoints.io.read_sharded_checkpoint`).
        map_location: Device to load the weights onto.
        meta: Build the model on the meta device and read no weights: every check of a real load (the
            file, the modules it names, the plug-ins, the tensors' names and shapes) in little time and
            memory. ``elr serve`` checks a checkpoint so before it starts its workers.

    Returns:
        ``(model, module)``: the :class:`LoopedLM` in eval mode and the module that holds it.

    Raises:
        FileNotFoundError: No file at ``ckpt_path``.
        UnsafeCheckpointError: The file holds a pickled object.
        UntrustedModuleError: The checkpoint names a module that is not trusted.
        CheckpointConfigError: Its configuration breaks the schema, naming the field.
        ValueError: The file is not a readable ELR Lightning checkpoint.
    """
    refuse_url(ckpt_path)
    check_regular_file(ckpt_path)
    sharded = is_sharded_checkpoint(ckpt_path)  # written under FSDP with save_distributed_checkpoint
    if sharded:
        raw = read_sharded_checkpoint(ckpt_path, weights="meta" if meta else True)
    elif not os.path.isfile(ckpt_path):
        raise FileNotFoundError(f"checkpoint {ckpt_path!r} does not exist")
    else:
        try:
            raw = read_checkpoint(ckpt_path, "meta" if meta else "cpu", ELRModule)
        except (UnsafeCheckpointError, UntrustedModuleError, CheckpointConfigError, OversizedCheckpointError):
            raise
        except Exception as err:  # torch.load raises many types (pickle, zip, EOF) for a bad file
            raise ValueError(f"checkpoint {ckpt_path!r} is not a readable PyTorch checkpoint ({err})") from err
    if not isinstance(raw, dict) or "state_dict" not in raw or "hyper_parameters" not in raw:
        keys = sorted(raw)[:8] if isinstance(raw, dict) else type(raw).__name__
        raise ValueError(
            f"checkpoint {ckpt_path!r} is not a Lightning ELRModule checkpoint (need 'state_dict' and "
            f"'hyper_parameters', found {keys}); use one written by `elr fit` or Trainer.save_checkpoint"
        )
    if not sharded:
        del raw  # read again below, mapped where asked
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*is an instance of `nn.Module`.*")
            warnings.filterwarnings("ignore", message=r".*copying from a non-meta parameter in the checkpoint to a meta")
            if sharded:  # already read as data: built from it, no temporary file
                module = ELRModule.from_checkpoint_dict(raw, ckpt_path, meta_init=meta)
                module = module if meta else module.to(map_location)
            else:
                module = ELRModule.load_from_checkpoint(
                    ckpt_path,
                    map_location="meta" if meta else map_location,
                    weights_only=True,
                    meta_init=meta,  # real weights to load into, unless only checking
                )
    except CheckpointConfigError:
        raise
    except Exception as err:  # hparams that no longer match the module's signature, missing keys, ...
        raise ValueError(f"checkpoint {ckpt_path!r} could not be rebuilt as an ELRModule ({err})") from err
    if not isinstance(module, ELRModule) or not isinstance(getattr(module, "model", None), LoopedLM):
        raise ValueError(f"checkpoint {ckpt_path!r} holds a {type(module).__name__}, not an ELRModule")
    module.eval()
    return module.model, module
