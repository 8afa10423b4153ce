"""``elr serve``: one request's bad value or failing row fails that request alone; hostile bodies get JSON 400s."""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from _elr_ckpt import SERVE_ARCH
from elr_lightning.inference.generate import MIN_TEMPERATURE, sample_next
from elr_lightning.serve.api import CompletionsSpec, RequestError
from elr_lightning.serve.engine import CompletionRequest, DecodeEngine
from test_serve import (  # noqa: F401 (fixtures)
    REQUESTS,
    TOK,
    checkpoint,
    free_port,
    model,
    post,
    reference,
    run_engine,
    start_server,
    stop_server,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-40, MIN_TEMPERATURE / 2])
def test_temperatures_below_the_floor_are_greedy(temperature: float) -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 30
    assert torch.equal(sample_next(logits, temperature), logits.argmax(-1))


def test_a_poisoned_temperature_among_healthy_requests_leaves_them_as_alone(model) -> None:
    poisoned = CompletionRequest(tuple(TOK.encode("def f(x):")), 2, 12, 1e-300, None, 5)
    healthy = {uid: REQUESTS[uid] for uid in ("b", "c", "d")}
    texts, finish = run_engine(DecodeEngine(model, TOK, "last_loop"), {**healthy, "poisoned": poisoned})
    assert finish == {uid: "length" for uid in [*healthy, "poisoned"]}
    for uid, request in healthy.items():
        assert texts[uid] == reference(model, request, "last_loop"), uid
    greedy = CompletionRequest(poisoned.prompt_ids, 2, 12, 0.0)
    assert texts["poisoned"] == reference(model, greedy, "last_loop")


@pytest.mark.parametrize("stage", ["decode", "prefill", "sampling"])
def test_a_row_that_fails_ends_alone_and_the_others_equal_generate(
    model, monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    """A step that fails on one row (in the batched decode, in its prefill, or in its sampling) ends that
    request with ``finish_reason="error"``; the others get the tokens they get alone."""
    engine = DecodeEngine(model, TOK, "per_loop", max_batch_size=4)
    bad_prompt = tuple(TOK.encode("poison"))
    step, prefill = engine.decoder.step, engine.decoder.prefill

    def failing_step(slots, tokens, depths):
        if any(engine._rows[s].request.prompt_ids == bad_prompt for s in slots):
            raise RuntimeError("row failure")
        return step(slots, tokens, depths)

    def failing_prefill(slot, ids, depth):
        if tuple(ids.tolist()) == bad_prompt:
            raise RuntimeError("row failure")
        return prefill(slot, ids, depth)

    if stage == "decode":
        monkeypatch.setattr(engine.decoder, "step", failing_step)
    elif stage == "prefill":
        monkeypatch.setattr(engine.decoder, "prefill", failing_prefill)
    healthy = {uid: REQUESTS[uid] for uid in ("a", "b", "c")}
    # sampling: the model's logits for this row are NaN (a temperature of NaN reaches no check of the engine)
    bad = CompletionRequest(bad_prompt, 2, 8, float("nan") if stage == "sampling" else 1.0, None, 1)
    events = []
    for uid, request in {**healthy, "bad": bad}.items():
        engine.submit(uid, request)
    while engine.active:
        events += engine.step()
    texts = {uid: "".join(e.text for e in events if e.uid == uid) for uid in healthy}
    finish = {e.uid: e for e in events if e.finish_reason is not None}
    assert finish["bad"].finish_reason == "error" and finish["bad"].error.count("\n") == 0
    for uid, request in healthy.items():
        assert finish[uid].finish_reason == "length" and texts[uid] == reference(model, request, "per_loop"), uid


@pytest.fixture(scope="module")
def spec() -> CompletionsSpec:
    return CompletionsSpec(SERVE_ARCH, TOK, "tiny", loops_default=1, loops_max=3)


@pytest.mark.parametrize(
    "body, words",
    [
        (b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", "digits"),
        (b'{"prompt": "x", "stop": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "too deeply"),
        (b"[" * 100_000, "too deeply"),
    ],
)
def test_huge_integers_and_deep_nesting_are_400s_naming_the_problem(spec: CompletionsSpec, body: bytes, words: str) -> None:
    with pytest.raises(RequestError) as info:
        spec.parse(body)
    answer = json.loads(info.value.response().body)["error"]
    assert info.value.status == 400 and answer["param"] == "body" and words in answer["message"]


def test_an_unknown_model_is_a_404_with_openais_error_shape(spec: CompletionsSpec) -> None:
    with pytest.raises(RequestError) as info:
        spec.parse(b'{"prompt": "x", "model": "gpt-4"}')
    assert info.value.status == 404
    assert json.loads(info.value.response().body) == {
        "error": {
            "message": "The model `gpt-4` does not exist; this server serves `tiny` (GET /v1/models)",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    body, _ = spec.parse(b'{"prompt": "x", "model": "tiny"}')
    assert body.model == "tiny"


# ---- the real server, over HTTP --------------------------------------------------------------------


def _read_response(sock: socket.socket) -> str:
    """One HTTP response, head and body: a loaded machine sends the body in a later segment than the head."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < int(
        re.search(rb"(?im)^content-length: *(\d+)", data.split(b"\r\n\r\n", 1)[0])[1]
    ):
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.decode()


@pytest.mark.slow
def test_server_answers_a_poisoned_request_alone_and_bounds_hostile_bodies(
    checkpoint: Path, model, tmp_path: Path
) -> None:
    port, log = free_port(), tmp_path / "server.log"
    server = start_server(checkpoint, port, log, "--max_batch_size", "4", "--body_timeout", "2")
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        healthy = [{"prompt": p, "max_tokens": 10, "temperature": 0.9, "seed": s, "loops": k}
                   for p, s, k in (("def main(", 1, 1), ("import sys", 2, 2), ("class Foo", 3, 3))]  # fmt: skip
        poisoned = {"prompt": "def main(", "max_tokens": 10, "temperature": 1e-300, "loops": 2}
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda b: post(url, json.dumps(b).encode()), [*healthy, poisoned]))
        assert [status for status, _ in answers] == [200] * 4
        for body, (_, answer) in zip(healthy, answers):
            request = CompletionRequest(tuple(TOK.encode(body["prompt"])), body["loops"], 10, 0.9, None, body["seed"])
            assert answer["choices"][0]["text"] == reference(model, request, "last_loop")
            assert answer["loops"] == {"loops": body["loops"], "max_loops": body["loops"], "threshold": None,
                                       "exit_criterion": None}  # fmt: skip
        greedy = CompletionRequest(tuple(TOK.encode("def main(")), 2, 10, 0.0)
        assert answers[3][1]["choices"][0]["text"] == reference(model, greedy, "last_loop")

        for body, status_words in [
            (b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", (400, "digits")),
            (b"[" * 100_000, (400, "too deeply")),
            (b'{"prompt": "x", "model": "other"}', (404, "does not exist")),
        ]:
            status, answer = post(url, body)
            assert (status, status_words[1] in answer["error"]["message"]) == (status_words[0], True)

        for _ in range(60):  # partial bodies whose clients go away
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 1000\r\n\r\n{\"prompt\": \"ab")  # fmt: skip
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:  # a client that never finishes
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
            head = _read_response(sock)
        assert head.startswith("HTTP/1.1 408") and "body_timeout" in head
        status, answer = post(url, b'{"prompt": "def", "max_tokens": 3}')
        assert status == 200, "the server stopped serving"
        time.sleep(1)
    finally:
        clean = stop_server(server)
    assert clean, "processes of the server were left running after SIGTERM"
    text = log.read_text()
    assert "Traceback" not in text and "ClientDisconnect" not in text, text[-3000:]


@pytest.mark.slow
def test_serve_sizes_its_limits_by_the_architecture_its_workers_build(checkpoint: Path, tmp_path: Path) -> None:
    """``elr.arch`` may differ from ``hyper_parameters.arch`` in ``max_seq_len`` (the load allows it); the server
    read its limits from the first and built its workers from the second, which failed in worker setup."""
    raw = torch.load(checkpoint, weights_only=True)
    raw["elr"]["arch"]["max_seq_len"] = 2 * raw["hyper_parameters"]["arch"]["max_seq_len"]
    torch.save(raw, tmp_path / "longer.ckpt")
    port = free_port()
    server = start_server(tmp_path / "longer.ckpt", port, tmp_path / "server.log")
    try:
        models = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30).read())
        assert models["data"][0]["max_seq_len"] == SERVE_ARCH.max_seq_len
        status, answer = post(f"http://127.0.0.1:{port}/v1/completions", b'{"prompt": "def", "max_tokens": 3}')
        assert status == 200 and answer["usage"]["completion_tokens"] == 3
    finally:
        clean = stop_server(server)
    assert clean


def test_a_request_that_failed_alone_gets_its_own_error_plain_and_streamed(spec: CompletionsSpec) -> None:
    import asyncio

    from litserve.utils import LitAPIStatus

    from elr_lightning.serve.api import _collect

    failed = json.dumps({"text": "", "finish_reason": "error", "completion_tokens": 2, "loops": 0,
                         "error": "ValueError: the model's logits for this request are NaN or +inf"})  # fmt: skip

    async def pieces():
        yield json.dumps({"text": "ab", "finish_reason": None, "completion_tokens": 1, "loops": 1}), LitAPIStatus.OK
        yield failed, LitAPIStatus.OK

    answer = asyncio.run(_collect(pieces()))
    body = json.loads(answer.body)["error"]
    assert answer.status_code == 500 and body["type"] == "server_error" and "NaN or +inf" in body["message"]

    spec.request_queue = type("Queue", (), {"put": lambda self, item: None})()
    spec.response_buffer, spec.response_queue_id = {}, 0
    job = CompletionRequest((97,), 1, 4)

    async def stream() -> list[str]:
        return [chunk async for chunk in spec._sse("u", {"id": "cmpl-u"}, job, pieces())]

    chunks = asyncio.run(stream())
    assert json.loads(chunks[0].removeprefix("data: "))["choices"][0]["text"] == "ab"
    assert "NaN or +inf" in json.loads(chunks[-1].removeprefix("data: "))["error"]["message"]
