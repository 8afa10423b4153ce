"""Tests of continuous batching in ``elr serve``: adaptive requests, cancellation, bounded memory, depth fields."""

from __future__ import annotations

import asyncio
import json
import queue

import pytest
import torch

from _elr_ckpt import SERVE_ARCH, write_checkpoint
from elr_lightning.inference.decode import AdaptiveDepth
from elr_lightning.inference.generate import generate, load_model
from elr_lightning.serve.api import Cancel, CompletionsSpec, ELRServeAPI, RequestError
from elr_lightning.serve.engine import CompletionRequest, DecodeEngine
from elr_lightning.tokenizers import ByteTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("serve") / "tiny.ckpt"
    write_checkpoint(path)
    return load_model(str(path))[0]


def drain(engine: DecodeEngine) -> dict[str, list]:
    """Step until idle; each request's events."""
    events: dict[str, list] = {}
    while engine.active:
        for event in engine.step():
            events.setdefault(event.uid, []).append(event)
    return events


@pytest.mark.parametrize("policy", ["per_loop", "last_loop"])
def test_adaptive_requests_beside_fixed_ones_equal_generate_and_report_their_loops(model, policy: str) -> None:
    auto = AdaptiveDepth(SERVE_ARCH.max_loops, 0.1, "kl")
    requests = {
        "auto": CompletionRequest(tuple(TOK.encode("def f(x):")), auto, 12, 0.7, None, 5),
        "k1": CompletionRequest(tuple(TOK.encode("import os")), 1, 9, 0.0),
        "k3": CompletionRequest(tuple(TOK.encode("ab")), 3, 14, 1.0, None, 3),
    }
    engine = DecodeEngine(model, TOK, policy, max_batch_size=4)
    for uid, request in requests.items():
        engine.submit(uid, request)
    events = drain(engine)
    for uid, request in requests.items():
        ref = generate(model, [list(request.prompt_ids)], loops=request.loops, kv_cache=policy,
                       max_new_tokens=request.max_tokens, temperature=request.temperature, seed=request.seed)  # fmt: skip
        assert "".join(e.text for e in events[uid]) == TOK.decode(ref.new_tokens[0].tolist()), uid
        assert [e.loops for e in events[uid]] == ref.loops_used[0].tolist(), uid
    assert len({e.loops for e in events["auto"]}) > 1, "the adaptive request never exited early; nothing was shown"


def test_cancel_frees_a_running_slot_and_drops_a_waiting_request(model) -> None:
    engine = DecodeEngine(model, TOK, "last_loop", max_batch_size=1)
    engine.submit("run", CompletionRequest(tuple(TOK.encode("ab")), 2, 40, 0.0))
    engine.submit("wait", CompletionRequest(tuple(TOK.encode("cd")), 1, 40, 0.0))
    engine.step()
    assert engine.running == {"run": 2}
    engine.cancel("run")
    engine.cancel("wait")
    engine.cancel("unknown")
    events = engine.step()
    assert {(e.uid, e.finish_reason) for e in events} == {("run", "cancelled"), ("wait", "cancelled")}
    assert engine.active == 0 and engine.step() == []


@pytest.mark.slow
def test_memory_stays_bounded_over_a_thousand_requests(model) -> None:
    engine = DecodeEngine(model, TOK, "per_loop", max_batch_size=4)
    sizes = []
    for wave in range(10):
        for i in range(100):
            k = 1 + (i % 3)
            engine.submit(f"{wave}-{i}", CompletionRequest(tuple(TOK.encode("x" * (1 + i % 7))), k, 1 + i % 4, 0.0))
        finished = sum(e.finish_reason is not None for events in drain(engine).values() for e in events)
        assert finished == 100
        sizes.append((engine.kv_cache_bytes(), engine.decoder.cache.state_nbytes(), len(engine.decoder.cache._stores)))
    assert len(set(sizes)) == 1, sizes  # the cache holds the slots, whatever the traffic
    assert engine.running == {} and engine._free and len(engine._free) == 4


@pytest.fixture(scope="module")
def spec() -> CompletionsSpec:
    return CompletionsSpec(SERVE_ARCH, TOK, "tiny", loops_default=1, loops_max=3)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"loops": "fast"}, "loops"),
        ({"loops": "auto", "threshold": -1.0}, "threshold"),
        ({"loops": "auto", "max_loops": 9}, "max_loops"),
        ({"loops": "auto", "max_loops": 0}, "max_loops"),
        ({"loops": "auto", "exit_criterion": "entropy"}, "exit_criterion"),
        ({"loops": 2, "threshold": 0.1}, "threshold"),
        ({"max_loops": 2}, "max_loops"),
        ({"exit_criterion": "kl"}, "exit_criterion"),
    ],
)
def test_bad_depth_fields_name_the_field(spec: CompletionsSpec, body: dict, param: str) -> None:
    with pytest.raises(RequestError) as err:
        spec.parse(json.dumps({"prompt": "ab", **body}).encode())
    assert err.value.param == param and err.value.status == 400


def test_auto_request_parses_with_the_server_budget(spec: CompletionsSpec) -> None:
    _, job = spec.parse(b'{"prompt": "ab", "loops": "auto", "exit_criterion": "delta", "threshold": 0.05}')
    assert job.loops == AdaptiveDepth(3, 0.05, "delta")
    _, job = spec.parse(b'{"prompt": "ab", "loops": "auto", "max_loops": 2}')
    assert job.loops.max_loops == 2 and job.loops.criterion == "kl"


def test_a_disconnected_plain_request_is_cancelled_in_the_worker(spec: CompletionsSpec, model) -> None:
    """The HTTP side notices the dropped connection and queues a Cancel; the worker drops the request."""
    from litserve import LitServer
    from litserve.utils import LitAPIStatus

    spec.response_buffer, spec.request_queue, spec.response_queue_id = {}, queue.Queue(), 0
    spec.data_streamer = LitServer.data_streamer

    class Gone:
        headers: dict[str, str] = {}

        async def stream(self):
            yield b'{"prompt": "ab", "max_tokens": 50}'

        async def is_disconnected(self) -> bool:
            return True

    answer = asyncio.run(spec.completions(Gone()))
    assert answer.status_code == 499 and spec.response_buffer == {}
    _, uid, _, job = spec.request_queue.get_nowait()
    _, note, _, cancel = spec.request_queue.get_nowait()
    assert cancel == Cancel(uid)

    api = ELRServeAPI("unused.ckpt", spec, "last_loop", max_batch_size=2)
    api.engine = DecodeEngine(model, TOK, "last_loop", max_batch_size=2)
    api.add_request(uid, job)
    api.step(None)
    assert api.engine.running == {uid: 1}
    api.add_request(note, cancel)
    outputs = api.step(None)
    finished = {o.uid for o in outputs if o.status == LitAPIStatus.FINISH_STREAMING}
    assert finished == {uid, note} and not api.has_active_requests()
    assert [o.output["finish_reason"] for o in outputs if o.uid == uid and o.output] == ["cancelled"]
    assert torch.equal(torch.tensor(api.engine._free).sort().values, torch.tensor([0, 1]))
