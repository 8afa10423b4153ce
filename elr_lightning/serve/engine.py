"""The serving engine: continuous batching over slots, each request at its own loop count k, or adaptive.

A :class:`DecodeEngine` keeps up to ``max_batch_size`` requests in the slots of one
:class:`~elr_lightning.inference.decode.Decoder`. Every :meth:`DecodeEngine.step` decodes one token for every
running request in one step whatever their k (rows are gathered per depth and scattered back, so a
step costs sum(k) row-loops, DESIGN §7), then prefills waiting requests into the slots that are
free. A finished or cancelled request frees its slot at once; a waiting request takes it in the
same step. Memory stays bounded: the cache holds ``max_batch_size`` rows of ``max_len`` positions
whatever the traffic.

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
from typing import Optional

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
            ``"cancelled"`` (:meth:`DecodeEngine.cancel`), or ``None`` while the request runs.
        completion_tokens: Tokens generated so far.
        loops: The recurrent loops the token of this step took (0 when no token was made).
    """

    uid: str
    text: str
    finish_reason: Optional[str]
    completion_tokens: int
    loops: int = 0


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
            logits, used = self.decoder.step(slots, tokens, [row.request.loops for row in rows])
            for i, slot in enumerate(slots):
                events.append(self._sample(slot, logits[i], int(used[i])))
        while self._free:
            with self._lock:
                if not self._queue:
                    break
                uid, request = self._queue[0]  # only this thread takes from the queue
            seed = request.seed if request.seed is not None else int(torch.randint(2**62, ()).item())
            row = _Row(
                uid,
                request,
                torch.Generator(device=self.device).manual_seed(seed),
                IncrementalDecoder(self.tokenizer),
                _StopText(request.stop),
            )
            with self._lock:
                self._queue.popleft()
            slot = self._free.pop()
            self._rows[slot] = row
            ids = torch.tensor(request.prompt_ids, device=self.device)
            events.append(self._sample(slot, self.decoder.prefill(slot, ids, request.loops), budget(request.loops)))
        return events

    def _release(self, slot: int, reason: str) -> Event:
        row = self._rows.pop(slot)
        self._free.append(slot)
        return Event(row.uid, "", reason, row.generated)

    def _sample(self, slot: int, logits: torch.Tensor, loops: int) -> Event:
        row = self._rows[slot]
        req = row.request
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
        if finish is not None:
            self._rows.pop(slot)
            self._free.append(slot)
        return Event(row.uid, text, finish, row.generated, loops)
