"""``POST /v1/chat/completions`` for ``elr serve``: messages through a chat template, then a completion.

The same API as ``vllm serve`` gives (docs/serving.md), so a client moves between the two unchanged. A
chat request is the completion request of the rendered conversation: ``messages`` go through the
server's chat template (``elr serve --chat_template FILE``, e.g. an export's ``chat_template.jinja``)
with ``add_generation_prompt``, and every other field (``max_tokens``, ``loops``, ``stop``, ...) is
checked exactly as ``/v1/completions`` checks it. The answer is reshaped into OpenAI's
``chat.completion`` (or ``chat.completion.chunk`` events when streamed).

A template is data: it renders in Jinja's immutable sandbox (as ``transformers`` renders chat
templates), so it can read the messages but not reach Python objects or the file system.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Optional

from fastapi.responses import JSONResponse, StreamingResponse

#: Roles a chat message may take.
ROLES = ("system", "user", "assistant", "tool")


class ChatError(ValueError):
    """A chat request refused before rendering: ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _raise_exception(message: str) -> None:
    """The templates' ``raise_exception(message)``: refuse the conversation with ``message``."""
    from jinja2 import TemplateError

    raise TemplateError(message)


def _compile(source: str) -> Any:
    """``source`` compiled in Jinja's immutable sandbox; raises ``ValueError`` if it does not parse."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(source)
    except TemplateError as err:
        raise ValueError(f"the chat template does not parse: {err}") from err


class ChatTemplate:
    """A Jinja chat template, rendered in a sandbox.

    Args:
        source: The template text (Hugging Face's chat-template dialect: ``messages``,
            ``add_generation_prompt``, ``bos_token``, ``eos_token``, ``raise_exception``).
        bos_token: The text of the tokenizer's BOS token, if any.
        eos_token: The text of the tokenizer's EOS token, if any.
    """

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token
        self.template = _compile(source)

    def __getstate__(self) -> dict[str, str]:
        """The template's text (the server's workers get a copy; a compiled template does not pickle)."""
        return {"source": self.source, "bos_token": self.bos_token, "eos_token": self.eos_token}

    def __setstate__(self, state: dict[str, str]) -> None:
        self.__init__(**state)

    @classmethod
    def from_file(cls, path: str, bos_token: str = "", eos_token: str = "") -> "ChatTemplate":
        """Read a template file (``chat_template.jinja``); raises ``ValueError`` naming the file if unreadable."""
        try:
            source = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"--chat_template {path!r} cannot be read as UTF-8 text ({err})") from err
        try:
            return cls(source, bos_token, eos_token)
        except ValueError as err:
            raise ValueError(f"--chat_template {path!r}: {err}") from err

    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt of a conversation, ending where the assistant's answer starts."""
        from jinja2 import TemplateError

        try:
            return self.template.render(
                messages=messages, add_generation_prompt=True, bos_token=self.bos_token, eos_token=self.eos_token
            )
        except TemplateError as err:
            raise ChatError(f"messages: the chat template refused them ({err})", "messages") from err


def special_texts(tokenizer: Any) -> tuple[str, str]:
    """``(bos_token, eos_token)`` texts a template may print: no BOS, and the tokenizer's EOS if it has one."""
    eos = tokenizer.eos_id
    return "", "" if eos is None else tokenizer.decode([eos])


def check_messages(messages: Any) -> list[dict[str, str]]:
    """``messages`` as plain ``{"role", "content"}`` dicts; raises :class:`ChatError` on a bad one."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("messages must be a non-empty list of {role, content} objects", "messages")
    plain = []
    for n, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) - {"role", "content", "name"}:
            raise ChatError(f"messages[{n}] must be an object with role and content (and optionally name)", "messages")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ChatError(f"messages[{n}].role={role!r} must be one of {list(ROLES)}", "messages")
        if not isinstance(content, str):
            raise ChatError(f"messages[{n}].content must be a string (text only)", "messages")
        plain.append(dict(message))
    return plain


def completion_body(raw: bytes, template: Optional[ChatTemplate]) -> bytes:
    """The ``/v1/completions`` body of a chat request body: ``messages`` rendered into ``prompt``.

    Raises:
        ChatError: No template, a body that is not a JSON object, bad ``messages``, or a ``prompt`` field.
    """
    if template is None:
        raise ChatError(
            "this server has no chat template; start elr serve with --chat_template FILE (a Jinja chat template, "
            "e.g. an export's chat_template.jinja)",
            "messages",
        )
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ChatError(f"the request body is not valid JSON ({err}); send a JSON object", "body") from err
    if not isinstance(data, dict):
        raise ChatError("the request body must be a JSON object", "body")
    if "prompt" in data:
        raise ChatError("prompt is a /v1/completions field; a chat request sends messages", "prompt")
    if "max_completion_tokens" in data:  # OpenAI's newer name of max_tokens
        data.setdefault("max_tokens", data.pop("max_completion_tokens"))
    data["prompt"] = template.render(check_messages(data.pop("messages", None)))
    return json.dumps(data).encode()


class PreRead:
    """A request whose body was already read: what ``CompletionsSpec.completions`` reads of a request."""

    def __init__(self, request: Any, body: bytes) -> None:
        self.request, self.body, self.headers = request, body, {}

    async def stream(self) -> AsyncIterator[bytes]:
        """The body, in one chunk."""
        yield self.body

    async def is_disconnected(self) -> bool:
        """Whether the client of the original request went away."""
        return await self.request.is_disconnected()


def _chat_choice(choice: dict[str, Any], chunk: bool) -> dict[str, Any]:
    key = "delta" if chunk else "message"
    message = {"role": "assistant", "content": choice["text"]}
    return {"index": choice["index"], key: message, "logprobs": None, "finish_reason": choice["finish_reason"]}


def _chat(answer: dict[str, Any], chunk: bool) -> dict[str, Any]:
    """A completion answer (or stream chunk) as a chat one."""
    out = {k: v for k, v in answer.items() if k != "choices"}
    out["id"] = "chat" + answer["id"]
    out["object"] = "chat.completion.chunk" if chunk else "chat.completion"
    out["choices"] = [_chat_choice(c, chunk) for c in answer["choices"]]
    return out


async def _chat_events(events: AsyncIterator[Any]) -> AsyncIterator[str]:
    async for event in events:
        text = event.decode() if isinstance(event, bytes) else event
        if not text.startswith("data: {"):
            yield text
            continue
        data = json.loads(text[len("data: "):])
        yield "data: " + json.dumps(_chat(data, chunk=True) if "choices" in data else data) + "\n\n"


def chat_response(response: Any) -> Any:
    """``/v1/completions``' response reshaped for ``/v1/chat/completions`` (errors pass as they are)."""
    if isinstance(response, StreamingResponse):
        return StreamingResponse(_chat_events(response.body_iterator), media_type="text/event-stream")
    if isinstance(response, JSONResponse):
        return response
    return _chat(response, chunk=False)
