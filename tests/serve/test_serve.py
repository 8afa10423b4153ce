"""Tests of ``elr serve``: the batching engine against ``generate``, request validation, the real server."""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from argparse import ArgumentError
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from _bpe import train_bpe
from _elr_ckpt import SERVE_ARCH, write_checkpoint
from conftest import REPO_ROOT, perturbed_model
from elr_lightning.inference.decode import AdaptiveDepth
from elr_lightning.inference.generate import generate, load_model
from elr_lightning.serve.api import DEFAULT_THRESHOLD, Cancel, CompletionBody, CompletionsSpec, RequestError, relative_costs
from elr_lightning.serve.engine import CompletionRequest, DecodeEngine, _StopText
from elr_lightning.serve.command import serving_tokenizer
from elr_lightning.tokenizers import ByteTokenizer, HFTokenizer, IncrementalDecoder, Tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("serve") / "tiny.ckpt"
    write_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def model(checkpoint: Path):
    return load_model(str(checkpoint))[0]


def reference(model, request: CompletionRequest, policy: str, tokenizer: Tokenizer = TOK) -> str:
    """What ``elr generate`` prints for the request (its prompt, k, seed and sampling), stop strings applied."""
    out = generate(
        model, [list(request.prompt_ids)], loops=request.loops, max_new_tokens=request.max_tokens, kv_cache=policy,
        temperature=request.temperature, top_p=request.top_p, seed=request.seed, eos_id=tokenizer.eos_id,
    )
    ids = out.new_tokens[0].tolist()
    if tokenizer.eos_id in ids:
        ids = ids[: ids.index(tokenizer.eos_id)]
    text = tokenizer.decode(ids)
    cuts = [i for i in (text.find(s) for s in request.stop) if i >= 0]
    return text[: min(cuts)] if cuts else text


def run_engine(engine: DecodeEngine, requests: dict[str, CompletionRequest]) -> tuple[dict[str, str], dict[str, str]]:
    texts, finish = {u: "" for u in requests}, {}
    for uid, request in requests.items():
        engine.submit(uid, request)
    while engine.active:
        for event in engine.step():
            assert event.uid not in finish, "an event after the request finished"
            texts[event.uid] = texts.get(event.uid, "") + event.text
            if event.finish_reason is not None:
                finish[event.uid] = event.finish_reason
    return texts, finish


REQUESTS = {
    "a": CompletionRequest(tuple(TOK.encode("def f(x):")), 1, 12, 0.0),
    "b": CompletionRequest(tuple(TOK.encode("import os")), 2, 10, 1.0, 0.9, 7),
    "c": CompletionRequest(tuple(TOK.encode("ab")), 3, 14, 0.8, None, 3),
    "d": CompletionRequest(tuple(TOK.encode("class A:\n")), 2, 9, 1.0, None, 11),
    "e": CompletionRequest(tuple(TOK.encode("x = 1")), 3, 12, 0.0),
}


@pytest.mark.parametrize("policy", ["last_loop", "per_loop"])
def test_engine_equals_generate_for_mixed_k(model, policy: str) -> None:
    engine = DecodeEngine(model, TOK, policy)
    texts, finish = run_engine(engine, REQUESTS)
    for uid, request in REQUESTS.items():
        assert texts[uid] == reference(model, request, policy), uid
        assert finish[uid] == "length"
    assert len({texts["a"], texts["e"]}) == 2


def test_a_finished_request_frees_its_slot_and_a_waiting_one_takes_it_in_the_same_step(model) -> None:
    engine = DecodeEngine(model, TOK, "last_loop", max_batch_size=2)
    short = CompletionRequest(tuple(TOK.encode("ab")), 3, 2, 0.0)
    for uid, request in (("short", short), ("a", REQUESTS["a"]), ("b", REQUESTS["b"])):
        engine.submit(uid, request)
    engine.step()
    assert engine.running == {"short": 3, "a": 1} and engine.active == 3
    events = engine.step()  # "short" makes its second token and ends; "b" joins at once
    assert [e.finish_reason for e in events if e.uid == "short"] == ["length"]
    assert engine.running == {"a": 1, "b": 2}
    texts, finish = run_engine(engine, {})
    assert finish == {"a": "length", "b": "length"}


def test_engine_stop_strings_and_text_before_them(model) -> None:
    free = CompletionRequest(tuple(TOK.encode("def f(x):")), 2, 24, 1.0, None, 5)
    text = reference(model, free, "last_loop")
    stop = text[5:7]
    request = CompletionRequest(free.prompt_ids, 2, 24, 1.0, None, 5, (stop, "\x00never"))
    texts, finish = run_engine(DecodeEngine(model, TOK, "last_loop"), {"s": request})
    assert texts["s"] == text[: text.find(stop)] and finish["s"] == "stop"


class _EosBytes(ByteTokenizer):
    """Bytes, with byte 0 as the end-of-sequence id."""

    @property
    def eos_id(self) -> int:
        return 0


@pytest.mark.parametrize(
    "script, stop, text, finish",
    [
        ("hello EN", ["END"], "hello EN", "stop"),  # held back as a possible start of END, then EOS
        ("hello EN", ["END", "ENx"], "hello EN", "stop"),
        ("hello \u00e9", ["\u00e9t\u00e9"], "hello \u00e9", "stop"),  # a held-back 2-byte character too
        ("hello END", ["END"], "hello ", "stop"),
        ("hello E", ["END"], "hello E", "length"),  # max_tokens: flushed as before
    ],
)
def test_a_completion_that_ends_releases_the_text_held_back_for_a_stop_string(
    model, monkeypatch: pytest.MonkeyPatch, script: str, stop: list[str], text: str, finish: str
) -> None:
    """Text held back because it could begin a stop string is sent when the completion ends, at EOS as at
    ``max_tokens``, unless a stop string did appear."""
    tokens = iter(TOK.encode(script) + [0])
    monkeypatch.setattr("elr_lightning.serve.engine.sample_next", lambda *a, **k: torch.tensor([next(tokens)]))
    max_tokens = len(TOK.encode(script)) + (1 if finish == "stop" else 0)
    request = CompletionRequest(tuple(TOK.encode("x")), 2, max_tokens, 0.0, stop=tuple(stop))
    texts, finishes = run_engine(DecodeEngine(model, _EosBytes(), "last_loop"), {"s": request})
    assert (texts["s"], finishes["s"]) == (text, finish)


def test_serving_uses_the_checkpoint_tokenizer_and_detokenises_bpe(tmp_path: Path) -> None:
    bpe = HFTokenizer(str(train_bpe(tmp_path / "bpe.json", vocab_size=300)))
    path = tmp_path / "bpe.ckpt"
    write_checkpoint(path, dataclasses.replace(SERVE_ARCH, vocab_size=320), tokenizer=bpe)
    raw = torch.load(path, weights_only=True)
    tokenizer = serving_tokenizer(raw, None, load_model(str(path), meta=True)[0].config)
    assert tokenizer.fingerprint() == bpe.fingerprint() and tokenizer.eos_id is not None
    assert isinstance(serving_tokenizer(raw, "byte", load_model(str(path), meta=True)[0].config), ByteTokenizer)
    model = load_model(str(path))[0]
    requests = {f"r{k}": CompletionRequest(tuple(bpe.encode("def decode(self, s):")), k, 16, 1.0, None, k) for k in (1, 2, 3)}
    texts, finish = run_engine(DecodeEngine(model, tokenizer, "per_loop"), requests)
    for uid, request in requests.items():
        assert texts[uid] == reference(model, request, "per_loop", tokenizer)
        assert finish[uid] in ("stop", "length")


@given(st.text(alphabet="ab\n", max_size=30), st.lists(st.text(alphabet="ab\n", min_size=1, max_size=3), max_size=3),
       st.integers(1, 4))
def test_stop_text_releases_exactly_the_text_before_the_first_stop(text: str, stops: list[str], chunk: int) -> None:
    gate, out, stopped = _StopText(stops), "", False
    for i in range(0, len(text), chunk):
        piece, stopped = gate.feed(text[i : i + chunk])
        out += piece
        if stopped:
            break
    if not stopped:
        out += gate.flush()
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    assert out == (text[: min(cuts)] if cuts else text)
    assert stopped == bool(cuts)


@pytest.fixture(scope="module")
def spec() -> CompletionsSpec:
    return CompletionsSpec(SERVE_ARCH, TOK, "tiny", loops_default=1, loops_max=3)


@pytest.mark.parametrize(
    "body, param",
    [
        (b'{"prompt": "x"', "body"),
        (b'["x"]', "body"),
        (b'{"prompt": ""}', "prompt"),
        (b'{"max_tokens": 3}', "prompt"),
        (b'{"prompt": "x", "loops": 0}', "loops"),
        (b'{"prompt": "x", "loops": 4}', "loops"),
        (b'{"prompt": "x", "max_tokens": -2}', "max_tokens"),
        (b'{"prompt": "x", "max_tokens": 65}', "max_tokens"),
        (('{"prompt": "' + "y" * 65 + '"}').encode(), "prompt"),
        (b'{"prompt": "x", "temperature": -1}', "temperature"),
        (b'{"prompt": "x", "top_p": 0}', "top_p"),
        (b'{"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}', "stop"),
        (b'{"prompt": "x", "n": 2}', "n"),
        (b'{"prompt": "x", "frequency_penalty": 1}', "frequency_penalty"),
        (b'{"prompt": "x", "seed": 18446744073709551616}', "seed"),  # 2**64: torch.Generator refuses it
        (b'{"prompt": "x", "seed": -9223372036854775809}', "seed"),
        (b'{"prompt": "x", "max_tokens": "5"}', "max_tokens"),  # wrong JSON types are refused, not coerced
        (b'{"prompt": "x", "loops": true}', "loops"),
        (b'{"prompt": "x", "stream": "yes"}', "stream"),
        (b'{"prompt": "x", "seed": 1.0}', "seed"),
    ],
)
def test_bad_requests_name_the_field(spec: CompletionsSpec, body: bytes, param: str) -> None:
    with pytest.raises(RequestError) as info:
        spec.parse(body)
    assert info.value.param == param and info.value.status == 400
    assert json.loads(info.value.response().body)["error"]["param"] == param


def test_good_request_parses_with_defaults(spec: CompletionsSpec) -> None:
    _, job = spec.parse(b'{"prompt": "hi", "stop": "\\n", "top_p": 1.0}')
    assert job == CompletionRequest((104, 105), 1, 16, 1.0, None, None, ("\n",))
    _, job = spec.parse(b'{"prompt": "hi", "temperature": 0, "top_p": 1, "seed": null, "loops": null}')  # ints as floats
    assert (job.temperature, job.top_p, job.seed, job.loops) == (0.0, None, None, 1)
    assert relative_costs(SERVE_ARCH, 3) == {"1": 1.0, "2": 6 / 4, "3": 8 / 4}


def test_seeds_at_both_ends_of_the_accepted_range_run_in_the_engine(spec: CompletionsSpec, model) -> None:
    """A seed the HTTP side accepts never fails the engine step (which would fail every request in flight)."""
    requests = {}
    for seed in (-(2**63), 2**64 - 1):
        _, requests[str(seed)] = spec.parse(json.dumps({"prompt": "ab", "max_tokens": 2, "seed": seed}).encode())
    texts, finish = run_engine(DecodeEngine(model, TOK, "last_loop"), requests)
    assert finish == {uid: "length" for uid in requests}


# ---- the real server, over HTTP --------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def post(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def start_server(checkpoint: Path, port: int, log: Path, *flags: str) -> subprocess.Popen:
    """``elr serve`` on ``port`` in a session of its own, stderr to ``log``; returns once ``/health`` answers."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    with open(log, "wb") as err:
        server = subprocess.Popen(
            [sys.executable, "-m", "elr_lightning.cli", "serve", "--ckpt_path", str(checkpoint), "--port", str(port),
             "--accelerator", "cpu", *flags],
            env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=err,
        )
    deadline = time.monotonic() + 90
    while True:
        if server.poll() is not None:
            raise AssertionError(log.read_text()[-2000:])
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return server
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop_server(server)
            raise AssertionError("the server did not become healthy in 90 s")
        time.sleep(0.5)


def stop_server(server: subprocess.Popen) -> bool:
    """SIGTERM the server; whether it left no process behind (stragglers are killed)."""
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=60)
    finally:
        deadline = time.monotonic() + 30
        while group_alive(server.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        stray = group_alive(server.pid)
        if stray:
            os.killpg(server.pid, signal.SIGKILL)
    return not stray


@pytest.mark.slow
def test_server_answers_concurrent_k_like_generate_and_shuts_down_cleanly(
    checkpoint: Path, model, tmp_path: Path
) -> None:
    openai = pytest.importorskip("openai")
    port = free_port()
    server = start_server(checkpoint, port, tmp_path / "server.log", "--max_batch_size", "8")
    base = f"http://127.0.0.1:{port}"
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=60, max_retries=0)
        listed = client.models.list().data[0].model_dump()
        assert listed["loops"] == [1, 2, 3] and listed["relative_cost"] == relative_costs(SERVE_ARCH, 3)

        prompts = ["def main(", "import sys", "class Foo"]
        jobs = [(p, k, stream, seed) for p, seed in zip(prompts, (1, 2, 3)) for k in (1, 2, 3) for stream in (False, True)]

        def ask(job):
            prompt, k, stream, seed = job
            kwargs = dict(model="tiny", prompt=prompt, max_tokens=10, temperature=0.9, seed=seed, extra_body={"loops": k})
            if not stream:
                choice = client.completions.create(**kwargs).choices[0]
                return choice.text, choice.finish_reason
            chunks = list(client.completions.create(stream=True, **kwargs))
            return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason

        with ThreadPoolExecutor(len(jobs)) as pool:
            answers = list(pool.map(ask, jobs))
        for (prompt, k, _, seed), (text, finish) in zip(jobs, answers):
            request = CompletionRequest(tuple(TOK.encode(prompt)), k, 10, 0.9, None, seed)
            assert text == reference(model, request, "last_loop"), (prompt, k)
            assert finish == "length"
        by_k = {k: text for (p, k, s, _), (text, _) in zip(jobs, answers) if p == prompts[0] and not s}
        assert len(set(by_k.values())) > 1, "every k gave the same text; the loop count is not reaching the model"

        for body, param in [(b'{"prompt": "x", "loops": 9}', "loops"), (b'{"prompt": ""}', "prompt"),
                            (b"{not json", "body"), (b'{"prompt": "x", "max_tokens": -1}', "max_tokens")]:
            status, answer = post(f"{base}/v1/completions", body)
            assert status == 400 and answer["error"]["param"] == param
        with pytest.raises(openai.BadRequestError, match="loops"):
            client.completions.create(model="tiny", prompt="x", extra_body={"loops": 0})
        status, answer = post(f"{base}/v1/completions", b'{"prompt": "def", "max_tokens": 3, "loops": 2}')
        assert status == 200 and answer["usage"]["completion_tokens"] == 3, "the server stopped serving"
        assert answer["usage"]["loops_per_token"] == [2, 2, 2]
        body = b'{"prompt": "def", "max_tokens": 6, "loops": "auto", "threshold": 0.1, "temperature": 0}'
        status, answer = post(f"{base}/v1/completions", body)
        request = CompletionRequest(tuple(TOK.encode("def")), AdaptiveDepth(3, 0.1, "kl"), 6, 0.0)
        assert status == 200 and answer["choices"][0]["text"] == reference(model, request, "last_loop")
        assert len(answer["usage"]["loops_per_token"]) == 6 and answer["usage"]["loops_per_token"][0] == 3
    finally:
        clean = stop_server(server)
    assert clean, "processes of the server were left running after SIGTERM"


@pytest.mark.slow
def test_a_client_that_disconnects_mid_stream_stops_its_decoding(tmp_path: Path) -> None:
    """Through LitServe's HTTP transport: closing a stream cancels the request in the engine and frees its slot."""
    checkpoint = tmp_path / "long.ckpt"
    write_checkpoint(checkpoint, dataclasses.replace(SERVE_ARCH, max_seq_len=2048))
    port, log = free_port(), tmp_path / "server.log"
    server = start_server(checkpoint, port, log, "--max_batch_size", "1", "--log_level", "info")
    try:
        max_tokens = 2000
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        body = {"prompt": "def", "max_tokens": max_tokens, "loops": 3, "stream": True, "temperature": 0}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        chunks = []
        while len(chunks) < 3:
            line = response.readline()
            assert line, "the stream ended early"
            if line.startswith(b"data: "):
                chunks.append(json.loads(line[6:]))
        conn.close()  # the client goes away after three tokens
        uid = chunks[0]["id"].removeprefix("cmpl-")
        finished = re.compile(rf"request {uid}: (\w+) after (\d+) tokens")
        deadline = time.monotonic() + 60
        while not (found := finished.search(log.read_text())):
            assert time.monotonic() < deadline, "the abandoned request never finished"
            time.sleep(0.1)
        reason, decoded = found.group(1), int(found.group(2))
        assert reason == "cancelled" and decoded < max_tokens // 4, (reason, decoded)

        status, answer = post(f"http://127.0.0.1:{port}/v1/completions",
                              b'{"prompt": "import", "max_tokens": 5, "loops": 2, "temperature": 0}')
        request = CompletionRequest(tuple(TOK.encode("import")), 2, 5, 0.0)
        expected = reference(load_model(str(checkpoint))[0], request, "last_loop")
        assert status == 200 and answer["choices"][0]["text"] == expected, "the freed slot did not serve correctly"
        assert answer["usage"]["completion_tokens"] == 5
    finally:
        clean = stop_server(server)
    assert clean, "processes of the server were left running after SIGTERM"


def test_serve_command_refuses_bad_flags_before_starting(checkpoint: Path, tmp_path: Path) -> None:
    from elr_lightning.cli import run

    with pytest.raises(FileNotFoundError, match="missing.ckpt"):
        run(["serve", "--ckpt_path", str(tmp_path / "missing.ckpt")])
    with pytest.raises(ValueError, match="--loops 4 must be in 1..--max_loops"):
        run(["serve", "--ckpt_path", str(checkpoint), "--loops", "4"])
    with pytest.raises(ValueError, match="--max_batch_size 0"):
        run(["serve", "--ckpt_path", str(checkpoint), "--max_batch_size", "0"])
    with pytest.raises(ArgumentError, match="log_level"):  # raised for `elr` to print in one line
        run(["serve", "--ckpt_path", str(checkpoint), "--log_level", "verbose"])


def test_a_server_default_of_auto_gives_requests_without_loops_adaptive_depth() -> None:
    """``elr serve --loops auto``: a request that names no ``loops`` chooses its depth per token."""
    spec = CompletionsSpec(SERVE_ARCH, TOK, "tiny", loops_default="auto", loops_max=3)
    assert spec.depth(CompletionBody(prompt="a")) == AdaptiveDepth(3, DEFAULT_THRESHOLD, "kl")
    assert spec.depth(CompletionBody(prompt="a", loops=2)) == 2
    with pytest.raises(RequestError, match="threshold is only read with loops='auto'"):
        spec.depth(CompletionBody(prompt="a", loops=2, threshold=0.1))


def test_engine_reset_drops_every_request(model) -> None:
    engine = DecodeEngine(model, TOK, "last_loop")
    engine.submit("a", REQUESTS["a"])
    engine.step()
    engine.submit("b", REQUESTS["b"])
    assert sorted(engine.reset()) == ["a", "b"] and engine.active == 0 and engine.step() == []


GDP_ARCH = dataclasses.replace(
    SERVE_ARCH,
    token_pattern={"in": ["gdp"], "rec": ["gdp", "attention"], "out": ["attention"]},
    mixers={"gdp": {"class_path": "elr_lightning.mixers.GatedDeltaProduct", "init_args": {"chunk_size": 8}}},
)


@pytest.mark.parametrize("policy", ["last_loop", "per_loop"])
@pytest.mark.parametrize("where", ["decode", "prefill", "admission"])
def test_after_a_failed_step_the_next_request_answers_as_generate(
    monkeypatch: pytest.MonkeyPatch, policy: str, where: str
) -> None:
    """A decode step in which every row fails (the model, not a request, is at fault) raises and leaves nothing
    behind after ``reset``: no recurrent-state writes waiting for the next commit, no lengths, no lost slot. A
    failure in one request's prefill or admission ends that request alone and the others go on. Either way the
    next requests' answers equal ``elr generate``'s."""
    model = perturbed_model(GDP_ARCH)
    engine = DecodeEngine(model, TOK, policy, max_batch_size=2)
    for uid in ("a", "b"):
        engine.submit(uid, REQUESTS[uid])
    engine.step()
    armed = [True]

    def fail(module, args) -> None:  # after the recurrent block's GDP layer recorded its new state
        if armed[0] and (args[0].shape[1] == 1) == (where == "decode"):
            raise RuntimeError("injected failure")

    if where == "admission":
        monkeypatch.setattr(
            "elr_lightning.serve.engine.IncrementalDecoder",
            lambda tok: fail(None, (torch.zeros(1, 2),)) or IncrementalDecoder(tok),
        )
    else:
        model.core.layers[1].attn.register_forward_pre_hook(fail)
    if where == "decode":
        with pytest.raises(RuntimeError, match="injected failure"):
            engine.step()
        assert sorted(engine.reset()) == ["a", "b"]
        assert engine.decoder.lengths == [0, 0]
    else:  # b's slot frees and c takes it in the failing step: c alone fails, a goes on
        engine.cancel("b")
        engine.submit("c", REQUESTS["c"])
        events = engine.step()
        failed = {e.uid: e.error for e in events if e.finish_reason == "error"}
        assert list(failed) == ["c"] and "injected failure" in failed["c"]
        assert engine.running == {"a": 1}
        armed[0] = False
        _, finish = run_engine(engine, {})
        assert finish == {"a": "length"}
    armed[0] = False
    stores = engine.decoder.cache._stores.values()
    assert not any(store._row_pending or store._pending for store in stores)
    good = CompletionRequest(tuple(TOK.encode("class A:\n")), 3, 10, 0.0)
    for uid in ("g1", "g2", "g3"):  # every slot serves again
        engine.submit(uid, good)
    texts: dict[str, str] = {}
    for step in range(40):
        for event in engine.step():
            texts[event.uid] = texts.get(event.uid, "") + event.text
        if step == 0:
            assert sorted(engine.running) == ["g1", "g2"]  # both slots took a request
        if not engine.active:
            break
    assert not engine.active
    assert texts == {uid: reference(model, good, policy) for uid in ("g1", "g2", "g3")}


def test_a_step_that_fails_with_a_cancellation_pending_does_not_fail_the_next_requests(spec: CompletionsSpec) -> None:
    """LitServe's own continuous-batching loop over the worker: a request is cancelled, then the step fails.

    The loop answers every tracked id (the cancellation's too) with the error and forgets them; the
    next request must then be answered as ``elr generate`` answers it, not with the forgotten
    cancellation's ``KeyError``.
    """
    import asyncio

    from litserve.utils import LitAPIStatus

    from elr_lightning.serve.api import ELRServeAPI, _EngineLoop

    model = perturbed_model(SERVE_ARCH)
    api = ELRServeAPI("unused.ckpt", spec, "last_loop", max_batch_size=2)
    api.engine = DecodeEngine(model, TOK, "last_loop", max_batch_size=2)
    loop, sent = _EngineLoop(), []

    class Transport:
        def send(self, item, consumer_id: int) -> None:
            sent.append(item)

    def run(requests: dict[str, object]) -> dict[str, list]:
        sent.clear()
        for uid, request in requests.items():
            loop.add_request(uid, request, api, spec)
            loop.response_queue_ids[uid] = 0
        asyncio.run(loop.run(api, "cpu", 0, None, Transport(), {}, None))
        answers: dict[str, list] = {}
        for uid, (data, status, _, _) in sent:
            answers.setdefault(uid, []).append((data, status))
        return answers

    armed = [False]

    def fail(module, args) -> None:
        if armed[0]:
            armed[0] = False
            raise RuntimeError("injected failure")

    model.core.layers[0].attn.register_forward_pre_hook(fail)
    for uid in ("a", "b"):
        loop.add_request(uid, REQUESTS[uid], api, spec)
        loop.response_queue_ids[uid] = 0
    api.step(None)  # both are running
    armed[0] = True  # b's decode fails in the step that cancels a
    failed = run({"cancel-a": Cancel("a")})
    assert {uid for uid, pieces in failed.items() if pieces[-1][1] == LitAPIStatus.ERROR} == {"a", "b", "cancel-a"}
    good = REQUESTS["e"]
    answers = run({"g": good})
    assert set(answers) == {"g"}, answers
    statuses = [status for _, status in answers["g"]]
    assert LitAPIStatus.ERROR not in statuses and statuses[-1] == LitAPIStatus.FINISH_STREAMING
    text = "".join(json.loads(data)["text"] for data, status in answers["g"] if status == LitAPIStatus.OK)
    assert text == reference(model, good, "last_loop")


def test_finished_and_abandoned_requests_leave_the_response_buffer(spec: CompletionsSpec) -> None:
    """Each request's buffer entry goes when it is answered, streamed out, or its client disconnects mid-stream."""
    import asyncio
    import queue

    from litserve import LitServer
    from litserve.utils import LitAPIStatus

    spec.response_buffer, spec.request_queue, spec.response_queue_id = {}, queue.Queue(), 0
    spec.data_streamer = LitServer.data_streamer

    class Body:
        headers: dict[str, str] = {}

        def __init__(self, stream: bool) -> None:
            self.raw = json.dumps({"prompt": "ab", "max_tokens": 3, "stream": stream}).encode()

        async def stream(self):
            yield self.raw

        async def is_disconnected(self) -> bool:
            return False

    def feed(finish: bool) -> None:
        """What the inference worker sends: two pieces, then (unless still running) the end of the stream."""
        _, uid, _, _ = spec.request_queue.get_nowait()
        item = spec.response_buffer[uid]
        for text, reason in (("x", None), ("y", "length" if finish else None)):
            piece = {"text": text, "finish_reason": reason, "completion_tokens": 1, "loops": 2}
            item.response_queue.append((json.dumps(piece), LitAPIStatus.OK))
        if finish:
            item.response_queue.append(("", LitAPIStatus.FINISH_STREAMING))
        item.event.set()

    async def scenario() -> list:
        answer = asyncio.ensure_future(spec.completions(Body(False)))
        while spec.request_queue.empty():  # the prompt is tokenised in a thread
            await asyncio.sleep(0.001)
        feed(finish=True)
        plain = await answer
        streamed = await spec.completions(Body(True))
        feed(finish=True)
        chunks = [chunk async for chunk in streamed.body_iterator]
        abandoned = await spec.completions(Body(True))
        feed(finish=False)
        first = await abandoned.body_iterator.__anext__()
        await abandoned.body_iterator.aclose()  # the client went away mid-stream
        return [plain, chunks[-1], first, dict(spec.response_buffer)]

    plain, last, first, left = asyncio.run(scenario())
    assert plain["choices"][0]["text"] == "xy" and last == "data: [DONE]\n\n" and '"text": "x"' in first
    assert plain["usage"]["loops_per_token"] == [2, 2] and plain["usage"]["mean_loops"] == 2.0
    assert left == {}
    _, cancel_id, _, cancel = spec.request_queue.get_nowait()  # the abandoned stream told the worker
    assert isinstance(cancel, Cancel) and cancel_id == f"cancel-{cancel.uid}"
