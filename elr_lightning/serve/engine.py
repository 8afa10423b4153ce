"""The serving engine: continuous batching over slots, each request at its own loop count k, or adaptive.

A :class:`DecodeEngine` keeps up to ``max_batch_size`` requests in the slots of one
:class:`~elr_lightning.inference.decode.Decoder`. Every :meth:`DecodeEngine.step` decodes one token for every
running request in one step whatever their k (rows are gathered per depth and scattered back, so a
step costs sum(k) row-loops, DESIGN §7), then prefills waiting requests into the slots that are
free. A finished or cancelled request frees its slot at once; a waiting request takes it in the
same step. Memory stays bounded: the cache holds ``max_batch_size`` rows of ``max_len`` positions
whatever the traffic.

A request that fails fails alone. Its sampling, detokenising and prefill run per row, and an
error there ends that request with ``finish_reason="error"``; a decode step that fails is run again
row by row (the failed pass's recurrent-state writes discarded first, its key/value writes
overwritten), so only the rows that fail on their own are ended. Only a step in which every row
fails alone raises, for the caller to :meth:`DecodeEngine.reset`.

Every row samples with its own ``torch.Generator`` seeded from the request, through the same
:func:`~elr_lightning.inference.generate.sample_next` and the same decoder as
:func:`~elr_lightning.inference.generate.generate`, so a request's tokens are those of ``elr generate`` for
its prompt, k and seed. Batching changes only the fp32 round-off of the products and of the masked
attention over the longest row (measured below 1e-5 on the logits), which can move a sample only
at a near tie.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Union

import torch

from elr_lightning.inference.cache import PolicyLike
from elr_lightning.inference.decode import Decoder, Depth, budget
from elr_lightning.inference.generate import sample_next
from elr_lightning.model import LoopedLM
from elr_lightning.tokenizers import IncrementalDecoder, Tokenizer


@dataclass(frozen=True)
class CompletionRequest:
    """One validated completion request, as the engine runs it.

    Attributes:
        prompt_ids: The prompt's token ids (non-empty).
        loops: Loop count k, or an :class:`~elr_lightning.inference.decode.AdaptiveDepth` for per-token depth.
        max_tokens: Most tokens to generate (>= 1).
        temperature: Softmax temperature; 0 is greedy.
        top_p: Nucleus mass in (0, 1], or ``None`` for none.
        seed: Seed of the request's own sampling generator; ``None`` draws one.
        stop: Strings that end the completion; the text returned stops before the first one.
    """

    prompt_ids: tuple[int, ...]
    loops: Depth
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
        finish_reason: ``"stop"`` (a stop string or EOS), ``"length"`` (``max_tokens``),
            ``"cancelled"`` (:meth:`DecodeEngine.cancel`), ``"error"`` (this request alone failed:
            see ``error``), or ``None`` while the request runs.
        completion_tokens: Tokens generated so far.
        loops: The recurrent loops the token of this step took (0 when no token was made).
        error: One line saying why the request failed, with ``finish_reason="error"``.
    """

    uid: str
    text: str
    finish_reason: Optional[str]
    completion_tokens: int
    loops: int = 0
    error: Optional[str] = None


def _one_line(err: BaseException) -> str:
    """``err`` as one line: its type and the first line of its message."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


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
        return self._release(len(self.text) - self._held()), False

    def _held(self) -> int:
        """Length of the longest tail of the text that begins some stop string (shorter than it).

        Only the tails that start with the stop string's first character and end with the
        character it has there are compared: a long stop string costs about the length of the text
        it could still begin per token, not its square.
        """
        text, hold = self.text, 0
        for s in self.stop:
            i = text.find(s[0], max(0, len(text) - len(s) + 1))
            while i != -1 and len(text) - i > hold:
                if s[len(text) - i - 1] == text[-1] and s.startswith(text[i:]):
                    hold = len(text) - i
                    break
                i = text.find(s[0], i + 1)
        return hold

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
    token: int = 0
    generated: int = 0


class DecodeEngine:
    """Continuous batching of completion requests; thread-safe :meth:`submit` and :meth:`cancel`, one stepping thread.

    Args:
        model: The looped LM, in eval mode.
        tokenizer: Decodes the generated ids to text; its ``eos_id`` ends a completion.
        kv_cache: The KV-cache policy, as for :func:`~elr_lightning.inference.generate.generate`.
        autocast_dtype: Run the model under ``torch.autocast`` with this dtype, or ``None``.
        max_batch_size: Slots: most requests decoded at once, all k together; more wait in a queue.
        max_len: Positions per slot (prompt plus generated tokens); ``None`` for ``arch.max_seq_len``.
    """

    def __init__(
        self,
        model: LoopedLM,
        tokenizer: Tokenizer,
        kv_cache: PolicyLike = "last_loop",
        autocast_dtype: Optional[torch.dtype] = None,
        max_batch_size: int = 8,
        max_len: Optional[int] = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 1")
        self.model, self.tokenizer = model, tokenizer
        self.max_len = model.config.max_seq_len if max_len is None else max_len
        if not 1 <= self.max_len <= model.config.max_seq_len:
            raise ValueError(f"max_len={self.max_len} must be in 1..arch.max_seq_len ({model.config.max_seq_len})")
        self.decoder = Decoder(model, max_batch_size, self.max_len, kv_cache, autocast_dtype)
        self.device = self.decoder.device
        self._lock = threading.Lock()
        self._queue: deque[tuple[str, CompletionRequest]] = deque()
        self._cancelled: set[str] = set()
        self._rows: dict[int, _Row] = {}
        self._free = list(range(max_batch_size - 1, -1, -1))

    def submit(self, uid: str, request: CompletionRequest) -> None:
        """Queue a request; it starts at the first :meth:`step` with a free slot."""
        if budget(request.loops) < 1 or request.max_tokens < 1 or not request.prompt_ids:
            raise ValueError(f"request {uid}: loops and max_tokens must be >= 1 and the prompt non-empty")
        if len(request.prompt_ids) + request.max_tokens - 1 > self.max_len:
            raise ValueError(f"request {uid}: the prompt plus max_tokens exceeds the engine's max_len={self.max_len}")
        with self._lock:
            self._queue.append((uid, request))

    def cancel(self, uid: str) -> None:
        """Stop request ``uid`` at the next :meth:`step` (its client went away); unknown ids are ignored there."""
        with self._lock:
            self._cancelled.add(uid)

    def reset(self) -> list[str]:
        """Drop every queued and running request (after a failed step); return their ids.

        Wherever the step failed, the engine starts again empty: every slot free, and the decoder's
        slots emptied (:meth:`Decoder.reset`: no recurrent-state write of the failed pass reaches the
        next commit).
        """
        with self._lock:
            queued, self._queue = [uid for uid, _ in self._queue], deque()
            self._cancelled.clear()
        dropped = queued + [row.uid for row in self._rows.values()]
        self._rows = {}
        self._free = list(range(len(self.decoder.lengths) - 1, -1, -1))
        self.decoder.reset()
        return dropped

    @property
    def active(self) -> int:
        """Requests queued or running."""
        with self._lock:
            return len(self._queue) + len(self._rows)

    @property
    def running(self) -> dict[str, Depth]:
        """The depth of every request that holds a slot, by id."""
        return {row.uid: row.request.loops for row in self._rows.values()}

    def kv_cache_bytes(self) -> int:
        """Attention KV bytes the cache has allocated (fixed by the slots and ``max_len``)."""
        return self.decoder.cache.nbytes(used=False)

    def step(self) -> list[Event]:
        """Cancel, decode one token for every running request, then fill free slots from the queue.

        Returns:
            One :class:`Event` per request touched: the text it released this step, and its finish
            reason once it is done or cancelled (a finished request appears no more).
        """
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            waiting = [uid for uid, _ in self._queue if uid in cancelled]
            self._queue = deque((uid, r) for uid, r in self._queue if uid not in cancelled)
        events = [Event(uid, "", "cancelled", 0) for uid in waiting]
        events += [self._release(slot, "cancelled") for slot, row in list(self._rows.items()) if row.uid in cancelled]
        if self._rows:
            slots = list(self._rows)
            rows = [self._rows[s] for s in slots]
            tokens = torch.tensor([row.token for row in rows], device=self.device)
            depths = [row.request.loops for row in rows]
            try:
                logits, used = self.decoder.step(slots, tokens, depths)
            except Exception:
                if len(slots) == 1:
                    raise
                events += self._step_rows_alone(slots, tokens, depths)
            else:
                for i, slot in enumerate(slots):
                    events.append(self._sample(slot, logits[i], int(used[i])))
        while self._free:
            with self._lock:
                if not self._queue:
                    break
                uid, request = self._queue.popleft()  # only this thread takes from the queue
            events.append(self._admit(uid, request))
        return events

    def _step_rows_alone(self, slots: list[int], tokens: torch.Tensor, depths: list[Depth]) -> list[Event]:
        """After a failed decode step: run each row alone, ending only the rows that fail alone.

        Raises:
            Exception: Every row failed alone (the model, not a request, is at fault): the first error.
        """
        results: list[Union[Exception, tuple[torch.Tensor, int]]] = []
        for i, slot in enumerate(slots):
            self.decoder.cache.discard()  # the failed pass's recurrent-state writes must not reach a commit
            try:
                logits, used = self.decoder.step([slot], tokens[i : i + 1], [depths[i]])
                results.append((logits[0], int(used[0])))
            except Exception as err:
                results.append(err)
        self.decoder.cache.discard()
        if all(isinstance(result, Exception) for result in results):
            raise results[0]
        return [
            self._fail(slot, result) if isinstance(result, Exception) else self._sample(slot, *result)
            for slot, result in zip(slots, results)
        ]

    def _admit(self, uid: str, request: CompletionRequest) -> Event:
        """Give a queued request a free slot and prefill its prompt; a failure ends this request alone."""
        slot = self._free.pop()
        try:
            seed = request.seed if request.seed is not None else int(torch.randint(2**62, ()).item())
            self._rows[slot] = _Row(
                uid,
                request,
                torch.Generator(device=self.device).manual_seed(seed),
                IncrementalDecoder(self.tokenizer),
                _StopText(request.stop),
            )
            ids = torch.tensor(request.prompt_ids, device=self.device)
            logits = self.decoder.prefill(slot, ids, request.loops)
        except Exception as err:
            self.decoder.cache.discard()
            self.decoder.lengths[slot] = 0
            self.decoder.cache.offset = max(self.decoder.lengths)
            if slot not in self._rows:
                self._free.append(slot)
                return Event(uid, "", "error", 0, error=_one_line(err))
            return self._fail(slot, err)
        return self._sample(slot, logits, budget(request.loops))

    def _fail(self, slot: int, err: BaseException) -> Event:
        """End the request in ``slot`` alone, with ``err`` as its reason."""
        event = self._release(slot, "error")
        event.error = _one_line(err)
        return event

    def _release(self, slot: int, reason: str) -> Event:
        row = self._rows.pop(slot)
        self._free.append(slot)
        return Event(row.uid, "", reason, row.generated)

    def _sample(self, slot: int, logits: torch.Tensor, loops: int) -> Event:
        """Sample and detokenise the next token of the request in ``slot``; a failure ends this request alone."""
        row = self._rows[slot]
        req = row.request
        try:
            if bool(torch.isnan(logits).any() or torch.isposinf(logits).any()):
                raise ValueError("the model's logits for this request are NaN or +inf")
            token = int(sample_next(logits[None], req.temperature, None, req.top_p, generator=row.generator)[0])
            row.token = token
            row.generated += 1
            finish = None
            at_eos = token == self.tokenizer.eos_id
            text, stopped = ("", False) if at_eos else row.stop.feed(row.decoder.push(token))
            if stopped:
                finish = "stop"
            elif at_eos or row.generated >= req.max_tokens:
                # The completion ends here: release what the decoder and the stop matcher still hold back.
                tail, stopped = row.stop.feed(row.decoder.flush())
                text += tail if stopped else tail + row.stop.flush()
                finish = "stop" if stopped or at_eos else "length"
        except Exception as err:
            return self._fail(slot, err)
        if finish is not None:
            self._rows.pop(slot)
            self._free.append(slot)
        return Event(row.uid, text, finish, row.generated, loops)
