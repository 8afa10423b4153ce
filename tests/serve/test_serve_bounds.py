"""``elr serve`` bounded by construction: the request-body cap, tokenising off the event loop, ``--max_context``."""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json
import os
import re
import threading
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.requests import Request

from _elr_ckpt import SERVE_ARCH
from elr_lightning.inference.decode import AdaptiveDepth
from elr_lightning.inference.generate import load_model
from elr_lightning.serve.api import CompletionsSpec, RequestError
from elr_lightning.serve.engine import CompletionRequest, DecodeEngine
from elr_lightning.serve.memory import (
    ServingMemory,
    available_bytes,
    check_fits,
    checkpoint_parameters,
    default_max_context,
    resolve_accelerator,
    serving_memory,
)
from elr_lightning.tokenizers import ByteTokenizer
from test_serve import TOK, checkpoint, free_port, model, post, start_server, stop_server  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")


class Receiver:
    """An ASGI ``receive`` that hands out ``chunks`` and counts the bytes the server took."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self.chunks = list(chunks)
        self.taken = 0

    async def __call__(self) -> dict:
        if not self.chunks:
            return {"type": "http.request", "body": b"", "more_body": False}
        chunk = self.chunks.pop(0)
        self.taken += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": bool(self.chunks)}


def http_request(receiver: Receiver, content_length: int | None) -> Request:
    """A Starlette request as uvicorn hands it to the endpoint (``Content-Length`` only if given)."""
    headers = [(b"content-type", b"application/json")]
    if content_length is not None:
        headers.append((b"content-length", str(content_length).encode()))
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers, "query_string": b""}
    return Request(scope, receiver)


def error_of(response) -> tuple[int, dict]:
    return response.status_code, json.loads(response.body)["error"]


@settings(max_examples=25, deadline=None)
@given(size=st.integers(65, 4000), chunk=st.integers(1, 700), declared=st.booleans())
def test_a_body_over_the_limit_is_refused_with_413_before_it_is_read(size: int, chunk: int, declared: bool) -> None:
    limit = 1000
    spec = CompletionsSpec(SERVE_ARCH, TOK, "tiny", 1, 3, max_request_bytes=limit)
    body = json.dumps({"prompt": "a" * size, "max_tokens": 1}).encode()
    receiver = Receiver(body[i : i + chunk] for i in range(0, len(body), chunk))
    response = asyncio.run(spec.completions(http_request(receiver, len(body) if declared else None)))
    status, error = error_of(response)
    if len(body) <= limit:  # read whole, then refused for its length in tokens (max_seq_len 64)
        assert receiver.taken == len(body) and status == 400 and error["param"] == "prompt"
        return
    assert status == 413 and error["param"] == "body" and "--max_request_bytes" in error["message"]
    assert str(limit) in error["message"] and error["type"] == "invalid_request_error"
    assert receiver.taken == (0 if declared else min(len(body), (limit // chunk + 1) * chunk))


class GatedTokenizer(ByteTokenizer):
    """Encodes only once the event loop has run again (it opens the gate), or gives up after 5 s."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.loop_ran: list[bool] = []

    def encode(self, text: str) -> list[int]:
        self.loop_ran.append(self.gate.wait(timeout=5))
        return super().encode(text)


def test_prompts_are_tokenised_off_the_event_loop() -> None:
    """While one prompt is being tokenised, the event loop keeps running (here: it opens the tokenizer's gate)."""
    tokenizer = GatedTokenizer()
    spec = CompletionsSpec(SERVE_ARCH, tokenizer, "tiny", 1, 3)
    body = json.dumps({"prompt": "x" * 80}).encode()  # refused after tokenising: 80 tokens > 64 positions

    async def scenario():
        answer = asyncio.ensure_future(spec.completions(http_request(Receiver([body]), len(body))))
        await asyncio.sleep(0.05)
        tokenizer.gate.set()
        return await answer

    status, error = error_of(asyncio.run(scenario()))
    assert status == 400 and error["param"] == "prompt"
    assert tokenizer.loop_ran == [True], "the prompt was tokenised on the event loop, which stood still meanwhile"


@pytest.mark.parametrize(
    "prompt, max_tokens, param", [("x" * 17, 1, "prompt"), ("x" * 8, 10, "max_tokens"), ("x" * 8, 9, None)]
)
def test_requests_longer_than_max_context_are_refused_naming_the_field(prompt: str, max_tokens: int, param) -> None:
    spec = CompletionsSpec(SERVE_ARCH, TOK, "tiny", 1, 3, max_context=16)
    raw = json.dumps({"prompt": prompt, "max_tokens": max_tokens}).encode()
    if param is None:
        assert spec.parse(raw)[1].max_tokens == max_tokens  # 8 + 9 - 1 = 16 positions: fits
        return
    with pytest.raises(RequestError, match="max_context=16") as info:
        spec.parse(raw)
    assert info.value.param == param and info.value.status == 400


@pytest.mark.parametrize("policy", ["last_loop", "per_loop"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_startup_size_is_what_the_engine_allocates(model, policy: str, dtype: str) -> None:
    """The cache the engine holds after requests at every k up to loops_max is the size the startup line gives."""
    slots, context = 3, 24
    autocast = torch.bfloat16 if dtype == "bfloat16" else None
    engine = DecodeEngine(model, TOK, policy, autocast, max_batch_size=slots, max_len=context)
    for k in (1, 2, 3):
        engine.submit(str(k), CompletionRequest(tuple(TOK.encode("def f")), k, 4, 0.0))
    engine.submit("auto", CompletionRequest(tuple(TOK.encode("ab")), AdaptiveDepth(3, 0.5, "kl"), 4, 0.0))
    while engine.active:
        engine.step()
    params = sum(p.numel() for p in model.parameters())
    predicted = serving_memory(SERVE_ARCH, policy, 3, slots, context, dtype, params)
    assert engine.kv_cache_bytes() == predicted.kv_cache > 0 and predicted.weights == 4 * params
    with pytest.raises(ValueError, match="request x: .* max_len=24"):
        engine.submit("x", CompletionRequest(tuple(TOK.encode("y" * 20)), 1, 6, 0.0))


@given(st.integers(1, 10**6), st.integers(0, 10**6), st.integers(0, 10**8), st.integers(0, 10**8))
def test_check_fits_refuses_exactly_what_exceeds_free_memory(kv: int, state: int, weights: int, free: int) -> None:
    need = ServingMemory(kv, state, weights)
    if need.total <= free:
        check_fits(need, free, "cpu")
    else:
        with pytest.raises(ValueError, match="--max_context .* --max_batch_size"):
            check_fits(need, free, "cpu")
    check_fits(need, None, "mps")  # unknown free memory: nothing to check against


def test_serve_command_checks_context_and_memory_before_starting(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from elr_lightning.cli import run

    long_arch = dataclasses.replace(SERVE_ARCH, max_seq_len=131072)
    assert default_max_context(long_arch) == 4096 and default_max_context(SERVE_ARCH) == 64
    with pytest.raises(ValueError, match=r"--max_context 65 must be in 1..arch.max_seq_len \(64\)"):
        run(["serve", "--ckpt_path", str(checkpoint), "--max_context", "65"])
    with pytest.raises(ValueError, match="--max_request_bytes 0 must be >= 1"):
        run(["serve", "--ckpt_path", str(checkpoint), "--max_request_bytes", "0"])
    monkeypatch.setattr("elr_lightning.serve.command.available_bytes", lambda accelerator: 1000)
    with pytest.raises(ValueError, match=r"more than the 0.00 GB free on cpu; lower --max_context"):
        run(["serve", "--ckpt_path", str(checkpoint), "--accelerator", "cpu", "--kv_cache", "per_loop"])
    raw = torch.load(checkpoint, weights_only=True)
    held = {t.data_ptr(): t for t in load_model(str(checkpoint))[1].state_dict().values()}  # tied head once
    assert checkpoint_parameters(raw, SERVE_ARCH) == sum(t.numel() for t in held.values())
    expected = serving_memory(SERVE_ARCH, "per_loop", 3, 8, 64, "float32", 0).kv_cache
    assert f"KV cache {expected:,} bytes" in capsys.readouterr().err


@pytest.mark.slow
def test_server_caps_bodies_and_context_over_http(checkpoint: Path, tmp_path: Path) -> None:
    """Through uvicorn: a declared or chunked body over the cap gets a 413, a long prompt a 400, then it serves."""
    port, log = free_port(), tmp_path / "server.log"
    flags = ("--max_request_bytes", "2000", "--max_context", "32", "--max_batch_size", "2", "--kv_cache", "per_loop")
    server = start_server(checkpoint, port, log, *flags)
    base = f"http://127.0.0.1:{port}"
    try:
        status, answer = post(f"{base}/v1/completions", json.dumps({"prompt": "a" * 3000}).encode())
        assert status == 413 and answer["error"]["param"] == "body" and "2000 bytes" in answer["error"]["message"]

        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        chunks = (json.dumps({"prompt": "b" * 500})[:-1].encode() for _ in range(8))  # 4 KB, no Content-Length
        conn.request("POST", "/v1/completions", chunks, {"Content-Type": "application/json"}, encode_chunked=True)
        response = conn.getresponse()
        assert response.status == 413 and json.loads(response.read())["error"]["param"] == "body"
        conn.close()

        status, answer = post(f"{base}/v1/completions", json.dumps({"prompt": "c" * 33}).encode())
        assert status == 400 and answer["error"]["param"] == "prompt" and "max_context=32" in answer["error"]["message"]
        status, answer = post(f"{base}/v1/completions", json.dumps({"prompt": "def", "max_tokens": 31}).encode())
        assert status == 400 and answer["error"]["param"] == "max_tokens"

        status, answer = post(f"{base}/v1/completions", b'{"prompt": "def", "max_tokens": 30, "loops": 3}')
        assert status == 200 and answer["usage"]["completion_tokens"] == 30, "the server stopped serving"
        expected = serving_memory(SERVE_ARCH, "per_loop", 3, 2, 32, "float32", 0).kv_cache
        assert re.search(rf"KV cache {expected:,} bytes .*2 slots x 32 positions, per_loop up to k=3", log.read_text())
    finally:
        clean = stop_server(server)
    assert clean, "processes of the server were left running after SIGTERM"


def test_free_memory_is_asked_of_the_device_the_worker_uses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA: the first visible GPU's free memory from nvidia-smi (no CUDA context here); CPU: available RAM."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/asked"\necho 81920\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert available_bytes("cuda") == 81920 << 20
    assert (tmp_path / "asked").read_text().split()[-2:] == ["-i", "3"]
    assert 0 < available_bytes("cpu") <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert available_bytes("mps") is None and resolve_accelerator("gpu") == "cuda" == resolve_accelerator("cuda")
    fake.write_text("#!/bin/sh\nexit 9\n")
    assert available_bytes("cuda") is None  # unknown: the server starts without the check
