"""``elr serve``: an OpenAI-compatible completions server over one checkpoint, with a per-request k.

Built on LitServe (``pip install "elr-lightning[serve]"``). The HTTP side (:class:`CompletionsSpec`)
validates every request before it is queued, so a bad request gets a 400 with an OpenAI-style JSON
error naming the field and never reaches the model. The inference worker (:class:`ELRServeAPI`)
runs LitServe's continuous-batching loop over a :class:`~elr_lightning.serve.engine.DecodeEngine`:
every running request advances one token per step in one batch whatever its k, a finished one
frees its slot at once and a waiting one takes it.

LitServe passes the worker nothing when a client goes away, so the HTTP side does: when a client
disconnects (a stream closed early, or a plain request whose connection dropped, polled every
:data:`DISCONNECT_POLL_S`), it queues a :class:`Cancel` on the same request queue, and the engine
drops the request at its next step.

Endpoints: ``POST /v1/completions`` (``prompt``, ``max_tokens``, ``temperature``, ``top_p``,
``stop``, ``stream``, ``seed``, ``loops`` (k or ``"auto"``), and for ``"auto"`` ``max_loops``,
``threshold`` and ``exit_criterion``), ``POST /v1/chat/completions`` (``messages`` through the chat template,
then the same fields; :mod:`elr_lightning.serve.chat`), ``GET /v1/models`` (the loop counts served and their
relative cost D_eff(k) / D_eff(1), eq. 1) and LitServe's ``GET /health``. The ``usage`` block
reports ``loops_per_token`` (the recurrent loops each completion token took) and their mean.

The worker logs one line per finished request at INFO on the ``elr_lightning.serve`` logger
(``elr serve --log_level info``): its id, why it ended (``stop``, ``length`` or ``cancelled``) and
the tokens it decoded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

import litserve as ls
import torch
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from litserve.loops.continuous_batching_loop import ContinuousBatchingLoop, Output
from litserve.specs.base import LitSpec
from litserve.utils import LitAPIStatus, ResponseBufferItem
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import ClientDisconnect
from typing_extensions import override

from elr_lightning.config import ModelConfig
from elr_lightning.inference.decode import AdaptiveDepth, Depth
from elr_lightning.serve.chat import ChatError, ChatTemplate, PreRead, chat_response, completion_body
from elr_lightning.serve.engine import CompletionRequest, DecodeEngine
from elr_lightning.serve.limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_REQUEST_BYTES
from elr_lightning.tokenizers import Tokenizer


class CompletionBody(BaseModel):
    """The JSON body of ``POST /v1/completions``: OpenAI's completion fields plus ``loops``."""

    # strict: a wrong JSON type (``"max_tokens": "5"``, ``"loops": true``) is refused, not coerced.
    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str = Field(min_length=1)
    model: Optional[str] = None
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    seed: Optional[int] = Field(None, ge=-(2**63), lt=2**64)  # what torch.Generator.manual_seed takes
    loops: Optional[Union[int, Literal["auto"]]] = None
    max_loops: Optional[int] = None
    threshold: Optional[float] = Field(None, ge=0.0, allow_inf_nan=False)
    exit_criterion: Optional[Literal["kl", "delta"]] = None
    n: int = Field(1, ge=1, le=1)
    user: Optional[str] = None


#: The server's logger; ``elr serve --log_level info`` logs every finished request.
log = logging.getLogger("elr_lightning.serve")

#: Exit threshold of ``loops: "auto"`` when a request gives none (see ``bench/adaptive.py``).
DEFAULT_THRESHOLD = 1e-3

#: Seconds between checks of whether the client of a plain (non-streamed) request is still connected.
DISCONNECT_POLL_S = 0.1


@dataclass(frozen=True)
class Cancel:
    """Queued by the HTTP side when the client of request ``uid`` went away."""

    uid: str


class RequestError(Exception):
    """A request the server refuses: HTTP ``status`` with an OpenAI error body naming ``param``."""

    def __init__(
        self,
        message: str,
        param: Optional[str],
        status: int = 400,
        kind: str = "invalid_request_error",
        code: Optional[str] = None,
    ) -> None:
        super().__init__(message)
        self.param, self.status, self.kind, self.code = param, status, kind, code

    def response(self) -> JSONResponse:
        """The OpenAI-style error body, with the HTTP ``status``."""
        return error_response(str(self), self.kind, self.status, self.param, self.code)


def error_response(
    message: str, kind: str, status: int, param: Optional[str] = None, code: Optional[str] = None
) -> JSONResponse:
    """An OpenAI-style error: ``{"error": {"message", "type", "param", "code"}}`` with HTTP ``status``."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


def parse_json(raw: bytes) -> Any:
    """A request body's JSON, refused with a :class:`RequestError` naming the problem.

    Nesting deeper than Python's recursion limit and an integer longer than Python converts
    (``sys.get_int_max_str_digits``) are a 400 naming the problem, not a server error.
    """
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RequestError(f"the request body is not valid JSON ({err}); send a JSON object", "body") from err
    except RecursionError as err:
        raise RequestError("the request body nests arrays or objects too deeply; send a flat JSON object", "body") from err
    except ValueError as err:  # an integer of more digits than Python converts
        raise RequestError(f"the request body cannot be read ({_first_line(err)}); send smaller numbers", "body") from err


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def relative_costs(config: ModelConfig, loops_max: int) -> dict[str, float]:
    """D_eff(k) / D_eff(1) for k = 1..``loops_max`` (eq. 1), keyed by ``str(k)``."""
    return {str(k): config.effective_depth(k) / config.effective_depth(1) for k in range(1, loops_max + 1)}


class CompletionsSpec(LitSpec):
    """The HTTP side: request validation, ``/v1/completions`` (JSON or SSE) and ``/v1/models``.

    A body over ``max_request_bytes`` gets a 413 before it is read (at once when its
    ``Content-Length`` says so, else as soon as the bytes read pass it), and prompts are tokenised in
    a thread, so a large prompt never holds up the event loop that streams the other requests.

    Args:
        config: The served model's architecture (for the loop range and costs).
        tokenizer: Encodes prompts (to check their length) before they are queued.
        model_name: The id ``/v1/models`` lists and responses carry.
        loops_default: k (or ``"auto"``) for requests that give no ``loops``.
        loops_max: Largest k served, and the budget of ``"auto"`` requests that give no ``max_loops``.
        max_context: Most positions (prompt plus ``max_tokens``) a request may take: the cache's length;
            ``None`` for ``arch.max_seq_len``.
        max_request_bytes: Largest request body read.
        body_timeout_s: Seconds a client has to send its whole body; a slower one gets a 408.
        chat_template: Renders ``/v1/chat/completions`` messages into a prompt; without one that endpoint
            answers 400.
    """

    def __init__(
        self,
        config: ModelConfig,
        tokenizer: Tokenizer,
        model_name: str,
        loops_default: Union[int, Literal["auto"]],
        loops_max: int,
        max_context: Optional[int] = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
        chat_template: Optional[ChatTemplate] = None,
    ) -> None:
        super().__init__()
        self.config, self.tokenizer, self.model_name = config, tokenizer, model_name
        self.loops_default, self.loops_max = loops_default, loops_max
        self.max_context = config.max_seq_len if max_context is None else max_context
        self.max_request_bytes, self.body_timeout_s = max_request_bytes, body_timeout_s
        self.api_path = "/v1/completions"
        self.add_endpoint(self.api_path, self.completions, ["POST"])
        self.add_endpoint("/v1/models", self.models, ["GET"])
        self.chat_template = chat_template
        self.add_endpoint("/v1/chat/completions", self.chat_completions, ["POST"])

    @property
    @override
    def stream(self) -> bool:
        return True

    @override
    def decode_request(self, request: Any, context_kwargs: Optional[dict] = None) -> Any:
        return request

    @override
    def encode_response(self, output: Any, context_kwargs: Optional[dict] = None) -> Any:
        return output

    async def models(self) -> dict[str, Any]:
        """``GET /v1/models``: the one model, with the loop counts it serves and their relative cost."""
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "elr-lightning",
                    "loops": list(range(1, self.loops_max + 1)),
                    "loops_default": self.loops_default,
                    "max_loops_trained": self.config.max_loops,
                    "relative_cost": relative_costs(self.config, self.loops_max),
                    "max_seq_len": self.config.max_seq_len,
                    "max_context": self.max_context,
                }
            ],
        }

    def parse(self, raw: bytes) -> tuple[CompletionBody, CompletionRequest]:
        """Validate a request body; raise :class:`RequestError` naming the first bad field."""
        data = parse_json(raw)
        if not isinstance(data, dict):
            raise RequestError("the request body must be a JSON object", "body")
        try:
            body = CompletionBody.model_validate(data)
        except ValidationError as err:
            first = err.errors()[0]
            param = str(first["loc"][0]) if first["loc"] else "body"
            raise RequestError(f"{param}: {first['msg']}", param) from err
        if body.model is not None and body.model != self.model_name:  # as OpenAI answers an unknown model
            raise RequestError(
                f"The model `{body.model}` does not exist; this server serves `{self.model_name}` (GET /v1/models)",
                "model", 404, code="model_not_found",
            )
        loops = self.depth(body)
        try:
            ids = tuple(self.tokenizer.encode(body.prompt))
        except ValueError as err:  # a character the model's alphabet lacks, or the tokenizer failed on the text
            raise RequestError(f"prompt: {err}", "prompt") from err
        need = len(ids) + body.max_tokens - 1
        if need > self.max_context:
            param = "prompt" if len(ids) > self.max_context else "max_tokens"
            raise RequestError(
                f"the prompt ({len(ids)} tokens) plus max_tokens={body.max_tokens} needs {need} positions, more than "
                f"this server's max_context={self.max_context}; shorten the prompt or lower max_tokens",
                param,
            )
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        if len(stop) > 4 or not all(stop):
            raise RequestError("stop must be a non-empty string or a list of at most 4 non-empty strings", "stop")
        top_p = None if body.top_p == 1.0 else body.top_p
        return body, CompletionRequest(ids, loops, body.max_tokens, body.temperature, top_p, body.seed, stop)

    async def read_body(self, request: Request) -> bytes:
        """The request's body, refused with a 413 as soon as it is known to pass ``max_request_bytes``."""
        limit = self.max_request_bytes
        too_big = RequestError(
            f"the request body is larger than this server's limit of {limit} bytes (elr serve --max_request_bytes); "
            "send a shorter prompt",
            "body",
            413,
        )
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks: list[bytes] = []

        async def read() -> None:
            size = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_big
                chunks.append(chunk)

        try:
            await asyncio.wait_for(read(), self.body_timeout_s)
        except asyncio.TimeoutError:
            raise RequestError(
                f"the request body did not arrive within {self.body_timeout_s:g} s (elr serve --body_timeout); "
                "send the whole body at once",
                "body",
                408,
            ) from None
        except ClientDisconnect:
            log.info("a client disconnected before sending its whole request body (%d bytes read)", sum(map(len, chunks)))
            raise RequestError("the client disconnected before sending its whole body", "body", 499) from None
        return b"".join(chunks)

    def depth(self, body: CompletionBody) -> Depth:
        """The request's depth: its k, or :class:`~elr_lightning.inference.decode.AdaptiveDepth` for ``"auto"``
        (the server's ``loops_default`` when it gives none)."""
        loops = self.loops_default if body.loops is None else body.loops
        if loops != "auto":
            for name in ("max_loops", "threshold", "exit_criterion"):
                if getattr(body, name) is not None:
                    raise RequestError(f"{name} is only read with loops='auto'; drop it or set loops to 'auto'", name)
            if not 1 <= loops <= self.loops_max:
                raise RequestError(
                    f"loops={loops} is out of range; this server serves loops 1..{self.loops_max} or 'auto'", "loops"
                )
            return loops
        budget = self.loops_max if body.max_loops is None else body.max_loops
        if not 1 <= budget <= self.loops_max:
            raise RequestError(f"max_loops={budget} is out of range; this server serves 1..{self.loops_max}", "max_loops")
        threshold = DEFAULT_THRESHOLD if body.threshold is None else body.threshold
        return AdaptiveDepth(budget, threshold, body.exit_criterion or "kl")

    async def completions(self, request: Request) -> Any:
        """``POST /v1/completions``."""
        try:
            raw = await self.read_body(request)
            body, job = await asyncio.to_thread(self.parse, raw)  # tokenising a long prompt blocks: not on the loop
        except RequestError as err:
            return err.response()
        uid = str(uuid.uuid4())
        queue: deque = deque()
        event = asyncio.Event()
        self.response_buffer[uid] = ResponseBufferItem(response_queue=queue, event=event)
        self.request_queue.put((self.response_queue_id, uid, time.monotonic(), job))
        pieces = self.data_streamer(queue, event, send_status=True)
        head = {"id": f"cmpl-{uid}", "object": "text_completion", "created": int(time.time()), "model": self.model_name}
        if body.stream:
            return StreamingResponse(self._sse(uid, head, job, pieces), media_type="text/event-stream")
        answer = asyncio.ensure_future(_collect(pieces))
        try:
            while not answer.done():
                await asyncio.wait({answer}, timeout=DISCONNECT_POLL_S)
                if not answer.done() and await request.is_disconnected():
                    answer.cancel()
                    self.cancel(uid)
                    return error_response("client disconnected", "cancelled", 499)
        finally:
            self.response_buffer.pop(uid, None)  # done or client gone: later pieces are dropped
        if isinstance(answer.result(), JSONResponse):
            return answer.result()
        text, finish, loops = answer.result()
        return {
            **head,
            "loops": _depth_json(job.loops),
            "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}],
            "usage": _usage(job, loops),
        }

    async def chat_completions(self, request: Request) -> Any:
        """``POST /v1/chat/completions``: the messages rendered by the chat template, then :meth:`completions`."""
        try:
            raw = await self.read_body(request)
            prompt_body = await asyncio.to_thread(completion_body, raw, self.chat_template)
        except RequestError as err:
            return err.response()
        except ChatError as err:
            return RequestError(str(err), err.param).response()
        return chat_response(await self.completions(PreRead(request, prompt_body)))

    def cancel(self, uid: str) -> None:
        """Tell the inference worker that request ``uid``'s client went away (see the module docstring)."""
        self.request_queue.put((self.response_queue_id, f"cancel-{uid}", time.monotonic(), Cancel(uid)))

    async def _sse(
        self, uid: str, head: dict[str, Any], job: CompletionRequest, pieces: AsyncIterator
    ) -> AsyncIterator[str]:
        loops: list[int] = []
        finished = False
        try:
            async for data, status in pieces:
                piece = None if status == LitAPIStatus.ERROR else json.loads(data)
                if piece is None or "error" in piece:
                    finished = True
                    yield "data: " + bytes(_failure(piece).body).decode() + "\n\n"
                    return
                loops += [piece["loops"]] if piece["loops"] else []
                finished = piece["finish_reason"] is not None
                choice = {"text": piece["text"], "index": 0, "logprobs": None, "finish_reason": piece["finish_reason"]}
                chunk = {**head, "choices": [choice]}
                if finished:
                    chunk["usage"] = _usage(job, loops)
                yield "data: " + json.dumps(chunk) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.response_buffer.pop(uid, None)  # done or client gone: later pieces are dropped
            if not finished:
                self.cancel(uid)


def _failure(piece: Optional[dict[str, Any]]) -> JSONResponse:
    """The 500 of a request that failed: alone (``piece`` names why) or with its whole step (``None``)."""
    if piece is None:
        return error_response("inference failed for every request in the step", "server_error", 500)
    return error_response(f"inference failed for this request: {piece['error']}", "server_error", 500)


async def _collect(pieces: AsyncIterator) -> Union[tuple[str, Optional[str], list[int]], JSONResponse]:
    """The text, finish reason and loops per token of a whole completion, or the error response if it failed."""
    text, finish, loops = [], None, []
    async for data, status in pieces:
        piece = None if status == LitAPIStatus.ERROR else json.loads(data)
        if piece is None or "error" in piece:
            return _failure(piece)
        text.append(piece["text"])
        finish = piece["finish_reason"]
        loops += [piece["loops"]] if piece["loops"] else []
    return "".join(text), finish, loops


def _depth_json(depth: Depth) -> dict[str, Any]:
    """The response's ``loops``: one object for a fixed k and for ``auto`` (the unused fields ``null``)."""
    if isinstance(depth, AdaptiveDepth):
        return {"loops": "auto", "max_loops": depth.max_loops, "threshold": depth.threshold,
                "exit_criterion": depth.criterion}
    return {"loops": depth, "max_loops": depth, "threshold": None, "exit_criterion": None}


def _usage(job: CompletionRequest, loops: list[int]) -> dict[str, Any]:
    """OpenAI's usage block plus the recurrent loops each completion token took."""
    used = len(loops)
    return {
        "prompt_tokens": len(job.prompt_ids),
        "completion_tokens": used,
        "total_tokens": len(job.prompt_ids) + used,
        "loops_per_token": loops,
        "mean_loops": sum(loops) / used if used else 0.0,
    }


class _EngineLoop(ContinuousBatchingLoop):
    """LitServe's continuous-batching loop, resting briefly while idle instead of spinning a core."""

    @override
    async def run(self, lit_api: ls.LitAPI, *args: Any, **kwargs: Any) -> None:
        if not lit_api.has_active_requests():
            await asyncio.sleep(0.002)
            return
        await super().run(lit_api, *args, **kwargs)


class ELRServeAPI(ls.LitAPI):
    """The inference worker: loads the checkpoint and steps a :class:`DecodeEngine`.

    Args:
        ckpt_path: The checkpoint to serve.
        spec: The HTTP side.
        kv_cache: KV-cache policy name (``"last_loop"`` or ``"per_loop"``).
        max_batch_size: Most requests decoded at once, all k together; more wait in the queue.
        dtype: ``"float32"``, or ``"bfloat16"`` to run under autocast.
        log_level: Level of the worker's log (uvicorn's names: ``"critical"`` ... ``"debug"``, ``"trace"``);
            ``"info"`` logs every finished request.
    """

    def __init__(
        self,
        ckpt_path: str,
        spec: CompletionsSpec,
        kv_cache: str,
        max_batch_size: int,
        dtype: str = "float32",
        log_level: str = "warning",
    ) -> None:
        super().__init__(max_batch_size=max_batch_size, stream=True, spec=spec, loop=_EngineLoop())
        self.ckpt_path, self.kv_cache, self.dtype, self.log_level = ckpt_path, kv_cache, dtype, log_level
        self.engine: Optional[DecodeEngine] = None
        self._notes: deque[str] = deque()  # ids of Cancel messages, finished at the next step

    @override
    def setup(self, device: str) -> None:
        from elr_lightning.inference.generate import load_model

        torch.set_flush_denormal(True)
        if not log.handlers:  # the worker is a fresh process: its log goes to the server's stderr
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
            log.addHandler(handler)
            log.propagate = False  # one line, not a second one through a root handler
        log.setLevel(logging.DEBUG if self.log_level == "trace" else self.log_level.upper())
        model, _ = load_model(self.ckpt_path, map_location=device)
        autocast = torch.bfloat16 if self.dtype == "bfloat16" else None
        self.engine = DecodeEngine(
            model, self.spec.tokenizer, self.kv_cache, autocast, self.max_batch_size, self.spec.max_context
        )

    def add_request(self, uid: str, request: Union[CompletionRequest, Cancel]) -> None:
        """Hand a validated request, or a cancellation, to the engine (called by the loop between steps).

        A :class:`Cancel` travels under its own id, which the loop tracks like a request: it is
        finished at the next step.
        """
        if isinstance(request, Cancel):
            self.engine.cancel(request.uid)
            self._notes.append(uid)
        else:
            self.engine.submit(uid, request)

    @override
    def has_active_requests(self) -> bool:
        return self.engine is not None and (self.engine.active > 0 or bool(self._notes))

    @override
    def has_capacity(self) -> bool:
        """Always: the engine queues what its slots cannot hold yet, so cancellations reach it at once."""
        return True

    def step(self, prev_outputs: Optional[list[Output]]) -> list[Output]:
        """One engine step: every request's new text, then a finish marker for each that ended.

        A request that fails alone (see :class:`DecodeEngine`) gets a piece carrying its ``error`` and
        is finished; the others go on. If the whole step fails, the engine drops every request and the pending cancellation notes are
        forgotten before the error reaches LitServe's loop, which answers all requests in flight (the
        notes' ids among them) with an error and stops tracking them; the server then serves new ones.
        A note kept past that point would be reported finished at the next step under an id the loop
        no longer knows, failing every request then in flight.
        """
        try:
            events = self.engine.step()
        except Exception:
            self.engine.reset()
            self._notes.clear()
            raise
        notes = [self._notes.popleft() for _ in range(len(self._notes))]
        outputs = [Output(uid, "", LitAPIStatus.FINISH_STREAMING) for uid in notes]
        for event in events:
            piece = {"text": event.text, "finish_reason": event.finish_reason,
                     "completion_tokens": event.completion_tokens, "loops": event.loops}
            if event.error is not None:
                piece["error"] = event.error
                log.warning("request %s failed alone after %d tokens: %s", event.uid, event.completion_tokens, event.error)
            elif event.finish_reason is not None:
                log.info("request %s: %s after %d tokens", event.uid, event.finish_reason, event.completion_tokens)
            outputs.append(Output(event.uid, piece, LitAPIStatus.OK))
            if event.finish_reason is not None:
                outputs.append(Output(event.uid, "", LitAPIStatus.FINISH_STREAMING))
        return outputs

    @override
    def encode_response(self, output: Any, **kwargs: Any) -> Any:
        return output
