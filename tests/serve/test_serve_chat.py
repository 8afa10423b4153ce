"""Tests of ``elr serve``'s ``/v1/chat/completions``: template rendering, validation, and the real server."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from fastapi.responses import JSONResponse

pytest.importorskip("litserve")
from _elr_ckpt import write_checkpoint  # noqa: E402
from elr_lightning.inference.generate import generate, load_model  # noqa: E402
from elr_lightning.serve.chat import ChatError, ChatTemplate, chat_response, completion_body  # noqa: E402
from elr_lightning.tokenizers import ByteTokenizer  # noqa: E402

TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f"}]


def test_messages_render_with_the_generation_prompt() -> None:
    assert ChatTemplate(TEMPLATE).render(MESSAGES) == "<|system|>Be brief.\n<|user|>def f\n<|assistant|>"


def test_a_template_survives_the_pickling_that_sends_it_to_the_server_s_workers() -> None:
    import pickle

    copy = pickle.loads(pickle.dumps(ChatTemplate(TEMPLATE, eos_token="</s>")))
    assert copy.render(MESSAGES) == ChatTemplate(TEMPLATE).render(MESSAGES) and copy.eos_token == "</s>"


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


def post(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def serve(checkpoint: Path, log: Path, *flags: str) -> tuple[subprocess.Popen, int]:
    """``elr serve`` in a session of its own on a free port, once ``/health`` answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file()))}
    with open(log, "wb") as err:
        server = subprocess.Popen(
            [sys.executable, "-m", "elr_lightning.cli", "serve", "--ckpt_path", str(checkpoint), "--port", str(port),
             "--accelerator", "cpu", *flags],
            env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
    deadline = time.monotonic() + 120
    while True:
        assert server.poll() is None, log.read_text()[-2000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return server, port
        except OSError:
            pass
        if time.monotonic() > deadline:
            os.killpg(server.pid, signal.SIGKILL)
            raise AssertionError("the server did not become healthy in 120 s")
        time.sleep(0.5)


@pytest.mark.slow
def test_server_chat_equals_generate_on_the_rendered_prompt(tmp_path: Path) -> None:
    openai = pytest.importorskip("openai")
    checkpoint = tmp_path / "tiny.ckpt"
    write_checkpoint(checkpoint)
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    server, port = serve(checkpoint, tmp_path / "server.log", "--chat_template", str(tmp_path / "chat.jinja"))
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
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            raise
