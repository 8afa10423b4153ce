"""``ELRLM``: an lm-evaluation-harness model over an ELR checkpoint, at any loop count k.

The harness hands the adapter three kinds of requests (``lm_eval.api.model.LM``):

* ``loglikelihood``: ``(context, continuation)`` -> the continuation's summed log-probability and
  whether greedy decoding would have produced it;
* ``loglikelihood_rolling``: a whole text's log-probability, in disjoint windows of the model's
  context (the harness's own windowing);
* ``generate_until``: greedy (or sampled) text from a context, cut at the first stop string and at
  ``max_gen_toks`` tokens.

Requests are sorted by length, longest first, and batched with padding, as the harness's own HF
adapter does (its ``Collator``). Scores follow the KV-cache policy the model is served with: the
context is prefilled and each continuation token is then decoded through the cache, so with
``kv_cache=last_loop`` the score is that of the approximate cache. Under ``per_loop`` this equals
one cache-free forward pass over context and continuation (the policy is exact), which is what the
adapter runs then. ``per_loop`` is the default (here and in ``elr eval``): a score is then
independent of where the harness splits context from continuation, while under ``last_loop`` at
k > 1 the continuation's tokens decoded one at a time read the context's loop-k keys only
(``bench/last_loop.py``), so the same text scores differently for another split. At ``loops=auto`` the scores are those of :mod:`elr_lightning.eval.adaptive`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, Optional, Union

import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch import Tensor
from tqdm import tqdm
from typing_extensions import override

from elr_lightning.inference.cache import CACHE_POLICIES, KVCache, PerLoopCache, resolve_policy
from elr_lightning.eval.adaptive import AdaptiveScoring
from elr_lightning.inference.generate import load_model, stream_generate
from elr_lightning.loop_points import check_loops
from elr_lightning.inference.prompts import left_pad
from elr_lightning.model import LoopedLM
from elr_lightning.inference.fold import serving_model
from elr_lightning.checkpoints.tokenizer import choose_tokenizer
from elr_lightning.tokenizers import Tokenizer

#: ``dtype`` model argument -> autocast dtype (``None``: the weights' own fp32).
DTYPES: dict[str, Optional[torch.dtype]] = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: A request's context and continuation token ids.
Pair = tuple[list[int], list[int]]


def resolve_device(device: Optional[str]) -> torch.device:
    """The device to run on: ``device``, or CUDA when available if ``None``.

    The harness's command line asks for ``cuda:0`` unless told otherwise; on a machine without CUDA
    that falls back to the CPU with a warning, as the harness's HF adapter does.
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        warnings.warn(f"device={device!r} but CUDA is not available; running on the CPU", stacklevel=3)
        return torch.device("cpu")
    return resolved


@register_model("elr")
class ELRLM(AdaptiveScoring, TemplateLM):
    """lm-evaluation-harness adapter for ELR checkpoints (registered as ``elr``).

    ``lm_eval --model elr --model_args ckpt_path=last.ckpt,loops=4,kv_cache=last_loop ...`` once
    :mod:`elr_lightning.eval` is imported; :meth:`from_model` wraps a model already in memory.
    :attr:`loops` may be changed between evaluations (``elr eval`` does), the model is loaded once.

    Args:
        ckpt_path: Checkpoint written by ``elr fit``.
        loops: The loop count k, or ``auto`` for adaptive depth per token up to ``arch.max_loops``
            (contexts are prefilled at the budget; continuation tokens choose their depth).
        kv_cache: ``per_loop`` or ``last_loop``: the cache the scores and generations go through.
        threshold: Exit threshold of ``loops=auto``.
        exit_criterion: ``kl`` or ``delta``, the exit criterion of ``loops=auto``.
        max_loops: Loop budget of ``loops=auto`` (default ``arch.max_loops``).
        batch_size: Requests per forward pass.
        device: Device to run on (``cpu``, ``cuda``, ``cuda:1``...); see :func:`resolve_device`.
        dtype: ``float32``, or ``bfloat16``/``float16`` under autocast.
        tokenizer: Override of the checkpoint's saved tokenizer (``byte`` or a ``tokenizer.json``).
        max_gen_toks: Default token budget of ``generate_until`` when a task sets none.
        allow_extrapolation: Accept ``loops`` above the checkpoint's ``arch.max_loops``.
        fold: ``true`` scores and generates with each k's conditioning constants computed once
            (:func:`~elr_lightning.inference.fold.serving_model`: the same scores to fp32 round-off,
            faster), ``false`` runs the conditioner per forward pass; unset follows
            ``model.serve_folded`` (on).
        max_batch_size: Accepted for the harness's CLI, unused (no automatic batch size).

    Raises:
        ValueError: A bad argument, naming it.
        FileNotFoundError: No checkpoint at ``ckpt_path``.
    """

    def __init__(
        self,
        ckpt_path: Optional[str] = None,
        loops: Union[int, str] = 1,
        kv_cache: str = "per_loop",
        batch_size: Union[int, str, None] = 16,
        device: Optional[str] = None,
        dtype: str = "float32",
        tokenizer: Optional[str] = None,
        max_gen_toks: int = 256,
        allow_extrapolation: Union[bool, str] = False,
        fold: Union[bool, str, None] = None,
        max_batch_size: Optional[int] = None,
        threshold: Union[float, str] = 1e-3,
        exit_criterion: str = "kl",
        max_loops: Union[int, str, None] = None,
        **unknown: Any,
    ) -> None:
        super().__init__()
        if unknown:
            raise ValueError(
                f"model_args: unknown argument(s) {', '.join(sorted(unknown))}; the elr model takes ckpt_path, loops, "
                "kv_cache, batch_size, device, dtype, tokenizer, max_gen_toks, allow_extrapolation, fold, threshold, "
                "exit_criterion, max_loops"
            )
        if ckpt_path is None:
            raise ValueError("model_args: ckpt_path is required, e.g. --model_args ckpt_path=last.ckpt,loops=2")
        model, module = load_model(ckpt_path, map_location=resolve_device(device))
        self._setup(model, choose_tokenizer(module.tokenizer, tokenizer, model.config.vocab_size), loops,
                    kv_cache, batch_size, dtype, max_gen_toks, allow_extrapolation, fold, threshold,
                    exit_criterion, max_loops)  # fmt: skip

    @classmethod
    def from_model(
        cls,
        model: LoopedLM,
        tokenizer: Tokenizer,
        loops: int = 1,
        kv_cache: str = "per_loop",
        batch_size: int = 16,
        dtype: str = "float32",
        max_gen_toks: int = 256,
        allow_extrapolation: bool = False,
        fold: Optional[bool] = None,
        threshold: float = 1e-3,
        exit_criterion: str = "kl",
        max_loops: Optional[int] = None,
    ) -> "ELRLM":
        """Wrap a model already in memory (on its device, in eval mode); see the class for the arguments."""
        lm = cls.__new__(cls)
        TemplateLM.__init__(lm)
        lm._setup(model, tokenizer, loops, kv_cache, batch_size, dtype, max_gen_toks, allow_extrapolation, fold,
                  threshold, exit_criterion, max_loops)  # fmt: skip
        return lm

    def _setup(
        self,
        model: LoopedLM,
        tokenizer: Tokenizer,
        loops: Union[int, str],
        kv_cache: str,
        batch_size: Union[int, str, None],
        dtype: str,
        max_gen_toks: int,
        allow_extrapolation: Union[bool, str],
        fold: Union[bool, str, None],
        threshold: Union[float, str] = 1e-3,
        exit_criterion: str = "kl",
        max_loops: Union[int, str, None] = None,
    ) -> None:
        if tokenizer.vocab_size > model.config.vocab_size:
            raise ValueError(
                f"tokenizer has {tokenizer.vocab_size} ids but arch.vocab_size is {model.config.vocab_size}; "
                "use the tokenizer the model was trained with"
            )
        if batch_size in (None, "auto") or str(batch_size).startswith("auto"):
            raise ValueError("batch_size: automatic batch sizes are not supported; give a number, e.g. batch_size=16")
        if int(batch_size) < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        if kv_cache not in CACHE_POLICIES:
            raise ValueError(f"kv_cache={kv_cache!r} must be one of {sorted(CACHE_POLICIES)}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} must be one of {sorted(DTYPES)}")
        if int(max_gen_toks) < 1:
            raise ValueError(f"max_gen_toks={max_gen_toks} must be >= 1")
        self.model = model.eval()
        self.tok = tokenizer
        self.policy: type[KVCache] = resolve_policy(kv_cache)
        self.kv_cache = kv_cache
        self.batch_size = int(batch_size)
        self.autocast_dtype = DTYPES[dtype]
        self.max_gen_toks = int(max_gen_toks)
        self.allow_extrapolation = str(allow_extrapolation).lower() in ("true", "1", "yes")
        self.fold: Optional[bool] = None if fold is None or fold == "" else str(fold).lower() in ("true", "1", "yes")
        budget = model.config.max_loops if max_loops in (None, "") else int(max_loops)
        check_loops(budget, model.config.max_loops, self.allow_extrapolation, field="max_loops")
        self._setup_adaptive(budget, float(threshold), exit_criterion)
        self.loops = loops
        separator = tokenizer.encode("\n")
        # Training joined documents with EOS, or with a newline when there is none (TextDataModule).
        self._prefix = tokenizer.eos_id if tokenizer.eos_id is not None else separator[-1]
        self._device = next(model.parameters()).device

    @property
    def loops(self) -> Union[int, str]:
        """The loop count k every request runs at, or ``"auto"``."""
        return self._loops

    @loops.setter
    def loops(self, value: Union[int, str]) -> None:
        if value != "auto":
            try:
                value = int(value)
            except ValueError:
                raise ValueError(f"loops={value!r} must be an integer >= 1 or 'auto'") from None
            check_loops(value, self.model.config.max_loops, self.allow_extrapolation)
        self._loops = value

    @property
    def max_length(self) -> int:
        """Longest sequence the model takes (``arch.max_seq_len``)."""
        return self.model.config.max_seq_len

    @property
    @override
    def eot_token_id(self) -> int:
        """EOS id, or the newline id that separated documents in training when there is no EOS."""
        return self._prefix

    @property
    def tokenizer_name(self) -> str:
        """Fingerprint of the tokenizer (the harness keys its request cache on it)."""
        return self.tok.fingerprint()

    @override
    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs: Any) -> list[int]:
        """Token ids of ``string`` (the library's tokenizers add no special tokens)."""
        return self.tok.encode(string)

    def tok_decode(self, tokens: Sequence[int], **kwargs: Any) -> str:
        """Text of ``tokens``."""
        return self.tok.decode(tokens)

    def get_model_info(self) -> dict[str, Any]:
        """What the harness records about the model in its results."""
        return {
            "elr_loops": self.loops,
            **({"elr_max_loops": self.max_loops, "elr_threshold": self.threshold,
                "elr_exit_criterion": self.exit_criterion} if self.loops == "auto" else {}),  # fmt: skip
            "elr_kv_cache": self.kv_cache,
            "elr_fold": self.fold,
            "elr_arch": dataclasses.asdict(self.model.config),
        }

    # ---- scoring ---------------------------------------------------------------------------------
    def _amp(self) -> Any:
        if self.autocast_dtype is None:
            return torch.autocast(self._device.type, enabled=False)
        return torch.autocast(self._device.type, dtype=self.autocast_dtype)

    @torch.inference_mode()
    def score(self, pairs: Sequence[Pair]) -> list[tuple[Tensor, Tensor]]:
        """Log-probabilities of each continuation given its context, in one padded batch.

        Args:
            pairs: ``(context, continuation)`` token lists, each context non-empty and the two
                together at most ``max_length + 1`` tokens.

        Returns:
            Per pair, ``(log_probs [n], greedy [n])``: each continuation token's fp32
            log-probability and the model's argmax at that position.
        """
        if self.loops == "auto":
            return [self._pick(lp, cont) for lp, (_, cont) in zip(self._adaptive_log_probs(pairs), pairs)]
        if issubclass(self.policy, PerLoopCache):  # exact policy: one forward equals prefill + decoding
            # Right padding needs no mask under causal attention: the rows' real tokens never see it.
            inputs = [(ctx + cont)[:-1] for ctx, cont in pairs]
            ids = torch.zeros((len(inputs), max(map(len, inputs))), dtype=torch.long)
            for row, tokens in enumerate(inputs):
                ids[row, : len(tokens)] = torch.tensor(tokens)
            with self._amp():
                logits = serving_model(self.model, self.loops, self.fold)(ids.to(self._device), self.loops)
            out = []
            for row, (tokens, (_, cont)) in enumerate(zip(inputs, pairs)):
                step = logits[row, len(tokens) - len(cont) : len(tokens)].float().log_softmax(dim=-1)
                out.append(self._pick(step, cont))
            return out
        return self._score_decoding(pairs)

    def _score_decoding(self, pairs: Sequence[Pair]) -> list[tuple[Tensor, Tensor]]:
        """Score ``pairs`` through the cache, in runs whose left-padded layout fits ``max_length``.

        A batch holds the longest context plus the longest continuation; a row with a long context
        beside one with a long continuation would overrun the RoPE table, so such rows go to the
        next run (each pair alone fits: :meth:`_truncate`).
        """
        out: list[tuple[Tensor, Tensor]] = []
        run: list[Pair] = []
        for pair in pairs:
            widest = max([len(ctx) for ctx, _ in run] + [len(pair[0])]) + max([len(c) for _, c in run] + [len(pair[1])])
            if run and widest - 1 > self.max_length:
                out += self._score_run(run)
                run = []
            run.append(pair)
        return out + self._score_run(run)

    def _score_run(self, pairs: Sequence[Pair]) -> list[tuple[Tensor, Tensor]]:
        """Prefill the contexts, then decode the continuations one token per step through the cache."""
        ids, mask = left_pad([ctx for ctx, _ in pairs], device=self._device)
        longest = max(len(cont) for _, cont in pairs)
        cache = self.policy(max_len=ids.shape[1] + longest - 1)
        runner = serving_model(self.model, self.loops, self.fold)  # once per batch, not per token
        steps = []
        with self._amp():
            logits = runner(ids, self.loops, mask, cache)[:, -1:]
            steps.append(logits.float())
            for j in range(longest - 1):
                column = torch.tensor([cont[j] if j < len(cont) else 0 for _, cont in pairs], device=self._device)
                mask = torch.cat((mask, mask.new_ones(mask.shape[0], 1)), dim=1)
                steps.append(runner(column[:, None], self.loops, mask, cache).float())
        logits = torch.cat(steps, dim=1).log_softmax(dim=-1)
        return [self._pick(logits[row, : len(cont)], cont) for row, (_, cont) in enumerate(pairs)]

    def _pick(self, log_probs: Tensor, cont: list[int]) -> tuple[Tensor, Tensor]:
        target = torch.tensor(cont, device=log_probs.device)
        return log_probs.gather(-1, target[:, None]).squeeze(-1), log_probs.argmax(dim=-1)

    def _truncate(self, ctx: list[int], cont: list[int]) -> Pair:
        """Keep the last ``max_length + 1`` tokens of context and continuation, as the HF adapter does."""
        if len(cont) > self.max_length:
            raise ValueError(f"a continuation of {len(cont)} tokens is longer than arch.max_seq_len={self.max_length}")
        whole = (ctx + cont)[-(self.max_length + 1) :]
        return whole[: len(whole) - len(cont)], cont

    @override
    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str], list[int], list[int]]], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        def by_length(req: tuple[tuple[str, str], list[int], list[int]]) -> tuple[int, tuple[int, ...]]:
            toks = req[1] + req[2]
            return -len(toks), tuple(toks)

        order = Collator(requests, sort_fn=by_length)
        results: list[tuple[float, bool]] = []
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc=f"loglikelihood k={self.loops}")
        for chunk in order.get_batched(n=self.batch_size):
            pairs = [self._truncate(ctx, cont) for _, ctx, cont in chunk]
            for (request, _, _), (cont_ids, (log_probs, greedy)) in zip(
                chunk, zip([cont for _, cont in pairs], self.score(pairs))
            ):
                answer = (float(log_probs.sum()), bool((greedy == torch.tensor(cont_ids, device=greedy.device)).all()))
                results.append(answer)
                if request is not None:
                    self.cache_hook.add_partial("loglikelihood", request, answer)
                bar.update(1)
        bar.close()
        return order.get_original(results)

    @override
    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Log-probability of whole texts, scored in the harness's disjoint rolling windows."""
        windows: list[tuple[int, tuple[None, list[int], list[int]]]] = []
        for index, (text,) in enumerate(req.args for req in requests):
            tokens = self.tok_encode(text)
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(tokens, self.eot_token_id, self.max_length, 1)):
                windows.append((index, (None, ctx, cont)))
        scores = self._loglikelihood_tokens([w for _, w in windows], disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for (index, _), (log_prob, _) in zip(windows, scores):
            totals[index] += log_prob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ---- generation ------------------------------------------------------------------------------
    @override
    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Generate from each context until a stop string, EOS or ``max_gen_toks`` tokens."""
        order = Collator(
            [req.args for req in requests],
            sort_fn=lambda req: (-len(self.tok_encode(req[0])), req[0]),
            group_by="gen_kwargs",
            group_fn=lambda req: req[1],
        )
        eos = None if self.tok.eos_id is None else self.tok_decode([self.tok.eos_id])
        results: list[str] = []
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc=f"generate_until k={self.loops}")
        for chunk in order.get_batched(n=self.batch_size):
            contexts, all_kwargs = zip(*chunk)
            kwargs = normalize_gen_kwargs(dict(all_kwargs[0]), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            for context, text in zip(contexts, self.generate_texts(list(contexts), until, **kwargs)):
                results.append(text)
                self.cache_hook.add_partial("generate_until", (context, all_kwargs[0]), text)
                bar.update(1)
        bar.close()
        return order.get_original(results)

    def generate_texts(
        self,
        contexts: list[str],
        until: Sequence[str],
        max_gen_toks: int,
        do_sample: bool = False,
        temperature: float = 0.0,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        seed: Optional[int] = None,
        **unused: Any,
    ) -> list[str]:
        """One padded batch through :func:`~elr_lightning.inference.generate.stream_generate`, cut at stop strings.

        Contexts are cut from the left to leave room for ``max_gen_toks`` tokens; decoding stops
        once every sequence has produced a stop string (or EOS), or after ``max_gen_toks`` tokens.

        Returns:
            Each continuation up to (without) its first stop string.
        """
        budget = min(int(max_gen_toks), self.max_length - 1)
        prompts = [self.tok_encode(c)[-(self.max_length - budget + 1) :] or [self.eot_token_id] for c in contexts]
        greedy = not do_sample or temperature == 0
        stream = stream_generate(
            self.model,
            prompts,
            loops=self.depth,
            max_new_tokens=budget,
            kv_cache=self.policy,
            temperature=temperature if not greedy else 1.0,
            top_k=top_k,
            top_p=top_p,
            greedy=greedy,
            eos_id=self.tok.eos_id,
            seed=seed,
            autocast_dtype=self.autocast_dtype,
            fold=self.fold,
        )
        return list(_until_stopped(stream, self.tok, len(prompts), list(until)))


def _cut(text: str, until: Sequence[str]) -> tuple[str, bool]:
    """``text`` up to its first stop string, and whether one was found."""
    cuts = [text.find(stop) for stop in until if stop and stop in text]
    return (text[: min(cuts)], True) if cuts else (text, False)


def _until_stopped(stream: Iterator[Tensor], tokenizer: Tokenizer, rows: int, until: list[str]) -> Iterator[str]:
    """Consume ``stream`` until every row has a stop string (or EOS); yield each row's text, cut."""
    ids: list[list[int]] = [[] for _ in range(rows)]
    done = [False] * rows
    for tokens in stream:
        for row, token in enumerate(tokens.tolist()):
            if done[row]:
                continue
            if token == tokenizer.eos_id:
                done[row] = True
                continue
            ids[row].append(token)
            done[row] = _cut(tokenizer.decode(ids[row]), until)[1]
        if all(done):
            break
    for row_ids in ids:
        yield _cut(tokenizer.decode(row_ids), until)[0]
