"""Tests of ``elr serve``'s ``/v1/chat/completions``: template rendering, validation, and the real server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.responses import JSONResponse

pytest.importorskip("litserve")
from _elr_ckpt import write_checkpoint  # noqa: E402
from elr_lightning.generation import generate, load_model  # noqa: E402
from elr_lightning.serve.chat import ChatError, ChatTemplate, chat_response, completion_body  # noqa: E402
from elr_lightning.tokenizers import ByteTokenizer  # noqa: E402
from test_serve import post, start_server, stop_server, free_port  # noqa: E402

TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f"}]


def test_messages_render_with_the_generation_prompt() -> None:
    assert ChatTemplate(TEMPLATE).render(MESSAGES) == "<|system|>Be brief.\n<|user|>def f\n<|assistant|>"


def test_a_chat_body_becomes_the_completion_body_of_its_rendered_prompt() -> None:
    raw = json.dumps({"messages": MESSAGES, "max_completion_tokens": 5, "loops": 2, "stop": "\n"}).encode()
    body = json.loads(completion_body(raw, ChatTemplate(TEMPLATE)))
    assert body == {"prompt": ChatTemplate(TEMPLATE).render(MESSAGES), "max_tokens": 5, "loops": 2, "stop": "\n"}


@pytest.mark.parametrize(
    ("data", "param"),
    [
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": ["x"]}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages"),
        ({"messages": MESSAGES, "prompt": "x"}, "prompt"),
        ([1], "body"),
    ],
)
def test_bad_chat_bodies_name_the_field(data, param: str) -> None:
    with pytest.raises(ChatError) as err:
        completion_body(json.dumps(data).encode(), ChatTemplate(TEMPLATE))
    assert err.value.param == param and "\n" not in str(err.value)


def test_without_a_template_the_endpoint_says_how_to_give_one() -> None:
    with pytest.raises(ChatError, match="--chat_template"):
        completion_body(json.dumps({"messages": MESSAGES}).encode(), None)


def test_a_template_cannot_reach_python_objects() -> None:
    template = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatError, match="messages"):
        template.render(MESSAGES)


def test_a_template_that_does_not_parse_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "chat.jinja"
    path.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="chat.jinja"):
        ChatTemplate.from_file(str(path))


def test_a_completion_answer_is_reshaped_as_a_chat_answer_and_errors_pass() -> None:
    answer = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m", "loops": 2,
              "choices": [{"text": "hi", "index": 0, "logprobs": None, "finish_reason": "length"}], "usage": {}}  # fmt: skip
    chat = chat_response(answer)
    assert chat["object"] == "chat.completion" and chat["id"] == "chatcmpl-1" and chat["loops"] == 2
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    error = JSONResponse({"error": {}}, 400)
    assert chat_response(error) is error


@pytest.mark.slow
def test_server_chat_equals_generate_on_the_rendered_prompt(tmp_path: Path) -> None:
    openai = pytest.importorskip("openai")
    checkpoint = tmp_path / "tiny.ckpt"
    write_checkpoint(checkpoint)
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    port = free_port()
    server = start_server(checkpoint, port, tmp_path / "server.log", "--chat_template", str(tmp_path / "chat.jinja"))
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=60, max_retries=0)
        tok, model = ByteTokenizer(), load_model(str(checkpoint))[0]
        prompt = tok.encode(ChatTemplate(TEMPLATE).render(MESSAGES))
        for k in (1, 3):
            want = tok.decode(generate(model, [prompt], loops=k, max_new_tokens=8, greedy=True, kv_cache="last_loop")
                              .new_tokens[0].tolist())  # fmt: skip
            kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0, extra_body={"loops": k})
            answer = client.chat.completions.create(**kwargs)
            assert answer.object == "chat.completion" and answer.choices[0].message.content == want, k
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
            assert chunks[-1].choices[0].finish_reason == "length"
        status, error = post(f"http://127.0.0.1:{port}/v1/chat/completions", b'{"messages": [{"role": "x"}]}')
        assert status == 400 and error["error"]["param"] == "messages"
        status, error = post(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(
            {"messages": MESSAGES, "loops": 9}).encode())  # fmt: skip
        assert status == 400 and error["error"]["param"] == "loops"
    finally:
        assert stop_server(server)
