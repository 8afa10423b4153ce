"""A batched decoding engine for serving: many requests, each with its own loop count k.

Requests that arrive together with the same k form one *cohort*: one left-padded batch, one KV
cache, one forward pass per decode step. Cohorts of different k advance side by side, one token per
:meth:`DecodeEngine.step`, so a k = 1 request is never held up behind a k = 3 one for more than a
step. New requests join at the next step as new cohorts; running cohorts never change shape.

Every row samples with its own ``torch.Generator`` seeded from the request, through the same
:func:`~elr_lightning.generation.sample_next` that :func:`~elr_lightning.generation.generate` uses,
and the forward pass is the model's own with the same cache policy, so a request's tokens are those
of ``elr generate`` for its prompt, k and seed. Like ``elr generate``, a cohort decodes with its k's
conditioning constants computed once (:func:`~elr_lightning.serving.serving_model`, chosen at its
prefill; ``model.serve_folded = False`` opts out). Batching changes only the fp32 round-off of the
matrix products (measured below 1e-6 on the logits), which can move a sample only at an exact tie.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from elr_lightning.cache import KVCache
from elr_lightning.serving import FoldedLM, serving_model
from elr_lightning.generation import PolicyLike, left_pad, resolve_policy, sample_next
from elr_lightning.tokenizers import IncrementalDecoder
from elr_lightning.model import LoopedLM
from elr_lightning.tokenizers import Tokenizer


@dataclass(frozen=True)
class CompletionRequest:
    """One validated completion request, as the engine runs it.

    Attributes:
        prompt_ids: The prompt's token ids (non-empty).
        loops: Loop count k.
        max_tokens: Most tokens to generate (>= 1).
        temperature: Softmax temperature; 0 is greedy.
        top_p: Nucleus mass in (0, 1], or ``None`` for none.
        seed: Seed of the request's own sampling generator; ``None`` draws one.
        stop: Strings that end the completion; the text returned stops before the first one.
    """

    prompt_ids: tuple[int, ...]
    loops: int
    max_tokens: int
    temperature: float = 1.0
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()


@dataclass
class Event:
    """What one request produced in one step.

    Attributes:
        uid: The request's id.
        text: Newly final text (possibly empty).
        finish_reason: ``"stop"`` (a stop string or EOS), ``"length"`` (``max_tokens``), or ``None``
            while the request runs.
        completion_tokens: Tokens generated so far.
    """

    uid: str
    text: str
    finish_reason: Optional[str]
    completion_tokens: int


class _StopText:
    """Releases decoded text, holding back any tail that could still begin a stop string."""

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = [s for s in stop if s]
        self.text = ""
        self.released = 0

    def feed(self, piece: str) -> tuple[str, bool]:
        """Add ``piece``; return the text now safe to send and whether a stop string appeared."""
        self.text += piece
        search_from = max(0, self.released - max((len(s) for s in self.stop), default=0))
        hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            return self._release(min(hits)), True
        hold = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:n]):
                    hold = n
                    break
        return self._release(len(self.text) - hold), False

    def flush(self) -> str:
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        out = self.text[self.released : end]
        self.released = max(self.released, end)
        return out


@dataclass
class _Row:
    uid: str
    request: CompletionRequest
    generator: torch.Generator
    decoder: IncrementalDecoder
    stop: _StopText
    generated: int = 0
    done: bool = False


@dataclass
class _Cohort:
    """Requests of one k decoded as one batch with one KV cache."""

    loops: int
    rows: list[_Row]
    runner: LoopedLM | FoldedLM
    cache: KVCache
    mask: Optional[Tensor]
    logits: Optional[Tensor] = None
    tokens: Optional[Tensor] = field(default=None)


class DecodeEngine:
    """Runs completion requests in cohorts of equal k; thread-safe :meth:`submit`, one stepping thread.

    Args:
        model: The looped LM, in eval mode.
        tokenizer: Decodes the generated ids to text; its ``eos_id`` ends a completion.
        kv_cache: The KV-cache policy, as for :func:`~elr_lightning.generation.generate`.
        autocast_dtype: Run the model under ``torch.autocast`` with this dtype, or ``None``.
    """

    def __init__(
        self,
        model: LoopedLM,
        tokenizer: Tokenizer,
        kv_cache: PolicyLike = "last_loop",
        autocast_dtype: Optional[torch.dtype] = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.policy = resolve_policy(kv_cache)
        self.autocast_dtype = autocast_dtype
        self.device = model.embed.weight.device
        self._pending: list[tuple[str, CompletionRequest]] = []
        self._lock = threading.Lock()
        self._cohorts: list[_Cohort] = []

    def submit(self, uid: str, request: CompletionRequest) -> None:
        """Queue a request; it starts at the next :meth:`step`."""
        if request.loops < 1 or request.max_tokens < 1 or not request.prompt_ids:
            raise ValueError(f"request {uid}: loops and max_tokens must be >= 1 and the prompt non-empty")
        with self._lock:
            self._pending.append((uid, request))

    def reset(self) -> list[str]:
        """Drop every queued and running request (after a failed step); return their ids."""
        with self._lock:
            pending, self._pending = self._pending, []
        dropped = [uid for uid, _ in pending] + [r.uid for c in self._cohorts for r in c.rows if not r.done]
        self._cohorts = []
        return dropped

    @property
    def active(self) -> int:
        """Requests queued or running."""
        with self._lock:
            pending = len(self._pending)
        return pending + sum(1 for c in self._cohorts for r in c.rows if not r.done)

    def cohort_sizes(self) -> list[tuple[int, int]]:
        """``(k, rows)`` of every running cohort (for tests and metrics)."""
        return [(c.loops, len(c.rows)) for c in self._cohorts]

    def kv_cache_bytes(self) -> int:
        """Attention KV bytes the running cohorts hold for the tokens written so far."""
        return sum(c.cache.nbytes() for c in self._cohorts)

    @torch.inference_mode()
    def step(self) -> list[Event]:
        """Admit queued requests as new cohorts (prefill), decode one token in every older cohort.

        Returns:
            One :class:`Event` per running request: the text it released this step, and its finish
            reason once it is done (a finished request appears no more).
        """
        with self._lock:
            pending, self._pending = self._pending, []
        events: list[Event] = []
        for cohort in self._cohorts:
            self._forward(cohort, cohort.tokens[:, None])
            events += self._sample(cohort)
        by_k: dict[int, list[tuple[str, CompletionRequest]]] = {}
        for uid, request in pending:
            by_k.setdefault(request.loops, []).append((uid, request))
        for loops, group in by_k.items():
            cohort = self._prefill(loops, group)
            self._cohorts.append(cohort)
            events += self._sample(cohort)
        self._cohorts = [c for c in self._cohorts if not all(r.done for r in c.rows)]
        return events

    def _prefill(self, loops: int, group: list[tuple[str, CompletionRequest]]) -> _Cohort:
        ids, mask = left_pad([r.prompt_ids for _, r in group], device=self.device)
        need = ids.shape[1] + max(r.max_tokens for _, r in group) - 1
        rows = []
        for uid, request in group:
            seed = request.seed if request.seed is not None else int(torch.randint(2**62, ()).item())
            rows.append(
                _Row(
                    uid,
                    request,
                    torch.Generator(device=self.device).manual_seed(seed),
                    IncrementalDecoder(self.tokenizer),
                    _StopText(request.stop),
                )
            )
        runner = serving_model(self.model, loops)
        cohort = _Cohort(loops, rows, runner, self.policy(max_len=need), None if bool(mask.all()) else mask)
        self._forward(cohort, ids)
        return cohort

    def _forward(self, cohort: _Cohort, tokens: Tensor) -> None:
        """One forward pass of the cohort, as :func:`~elr_lightning.generation.generate` runs it."""
        if cohort.mask is not None and cohort.cache.offset > 0:
            cohort.mask = torch.cat((cohort.mask, cohort.mask.new_ones(cohort.mask.shape[0], tokens.shape[1])), dim=1)
        amp = (
            torch.autocast(self.device.type, dtype=self.autocast_dtype)
            if self.autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with amp:
            cohort.logits = cohort.runner(tokens, cohort.loops, cohort.mask, cohort.cache)[:, -1].float()

    def _sample(self, cohort: _Cohort) -> list[Event]:
        tokens = []
        events = []
        eos = self.tokenizer.eos_id
        for i, row in enumerate(cohort.rows):
            if row.done:
                tokens.append(0)
                continue
            req = row.request
            token = int(
                sample_next(cohort.logits[i : i + 1], req.temperature, None, req.top_p, generator=row.generator)[0]
            )
            tokens.append(token)
            row.generated += 1
            finish = None
            if eos is not None and token == eos:
                text, finish = row.stop.feed(row.decoder.flush())[0], "stop"
            else:
                text, stopped = row.stop.feed(row.decoder.push(token))
                if stopped:
                    finish = "stop"
                elif row.generated >= req.max_tokens:
                    tail, stopped = row.stop.feed(row.decoder.flush())
                    text += tail if stopped else tail + row.stop.flush()
                    finish = "stop" if stopped else "length"
            if finish is not None:
                row.done = True
            events.append(Event(row.uid, text, finish, row.generated))
        cohort.tokens = torch.tensor(tokens, dtype=torch.long, device=self.device)
        return events
