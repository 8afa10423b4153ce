"""The lm-eval adapter against the model computed directly: log-likelihoods, rolling windows, generation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")
pytest.importorskip("tokenizers")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from _bpe import train_bpe  # noqa: E402
from conftest import perturbed_model  # noqa: E402
from elr_lightning.inference.cache import LastLoopCache  # noqa: E402
from elr_lightning.config import ModelConfig  # noqa: E402
from elr_lightning.eval import ELRLM  # noqa: E402
from elr_lightning.inference.generate import generate  # noqa: E402
from elr_lightning.model import LoopedLM  # noqa: E402
from elr_lightning.tokenizers import ByteTokenizer, Tokenizer, load_tokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 400
CONFIG = ModelConfig(vocab_size=VOCAB, d_model=32, n_heads=4, n_kv_heads=2, n_in=1, n_rec=2, n_out=1, max_loops=4,
                     max_seq_len=64)  # fmt: skip

#: (context, continuation); the first three cross a merge of the BPE ("se|lf", "sel|f", "wr|ap").
PAIRS = [
    ("    def __init__(se", "lf, width=70):"),
    ("        sel", "f.width = width"),
    ("    def wr", "ap(self)"),
    ("import ", "re"),
    ("x = ", "[i for i in range(10)]\n"),
    ("def f(a, b):\n    return a ", "+ b"),
]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return load_tokenizer(str(train_bpe(tmp_path_factory.mktemp("bpe") / "tokenizer.json", vocab_size=VOCAB)))


@pytest.fixture(scope="module")
def model() -> LoopedLM:
    return perturbed_model(CONFIG)


def _requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def _direct(model: LoopedLM, ctx: list[int], cont: list[int], loops: int, policy: str) -> tuple[float, bool]:
    """Continuation log-probability, one request alone, straight from the model's forward."""
    with torch.no_grad():
        if policy == "per_loop":
            logits = model(torch.tensor([ctx + cont[:-1]]), loops)[0, -len(cont) :]
        else:  # prefill the context, then feed the continuation one token at a time through the cache
            cache = LastLoopCache(max_len=len(ctx) + len(cont))
            steps = [model(torch.tensor([ctx]), loops, None, cache)[0, -1:]]
            steps += [model(torch.tensor([[t]]), loops, None, cache)[0] for t in cont[:-1]]
            logits = torch.cat(steps)
    log_probs = logits.float().log_softmax(-1)
    target = torch.tensor(cont)
    return float(log_probs[torch.arange(len(cont)), target].sum()), bool((log_probs.argmax(-1) == target).all())


@pytest.mark.parametrize("policy", ["per_loop", "last_loop"])
@pytest.mark.parametrize("loops", [1, 2, 4])
def test_loglikelihood_equals_the_direct_sum(model: LoopedLM, bpe: Tokenizer, policy: str, loops: int) -> None:
    lm = ELRLM.from_model(model, bpe, loops=loops, kv_cache=policy, batch_size=3)
    got = lm.loglikelihood(_requests("loglikelihood", PAIRS), disable_tqdm=True)
    crossed = 0
    for (context, continuation), (log_prob, greedy) in zip(PAIRS, got):
        stripped = context.rstrip()  # the harness moves trailing spaces of the context to the continuation
        ctx, whole = bpe.encode(stripped), bpe.encode(context + continuation)
        crossed += whole[: len(ctx)] != ctx  # a merge spans the boundary: the harness keeps ctx's own encoding
        expected, expected_greedy = _direct(model, ctx, whole[len(ctx) :], loops, policy)
        assert log_prob == pytest.approx(expected, abs=2e-4)
        assert greedy == expected_greedy
    assert crossed == 3


def test_cache_policies_agree_at_one_loop_and_differ_above(model: LoopedLM, bpe: Tokenizer) -> None:
    def scores(loops: int, policy: str) -> list[float]:
        lm = ELRLM.from_model(model, bpe, loops=loops, kv_cache=policy)
        return [s for s, _ in lm.loglikelihood(_requests("loglikelihood", PAIRS), disable_tqdm=True)]

    assert scores(1, "per_loop") == pytest.approx(scores(1, "last_loop"), abs=2e-4)
    assert max(abs(a - b) for a, b in zip(scores(4, "per_loop"), scores(4, "last_loop"))) > 1e-3


@pytest.mark.parametrize("policy", ["per_loop", "last_loop"])
def test_folded_conditioning_scores_and_generates_alike(model: LoopedLM, bpe: Tokenizer, policy: str) -> None:
    plain = ELRLM.from_model(model, bpe, loops=3, kv_cache=policy, fold=False)
    folded = ELRLM.from_model(model, bpe, loops=3, kv_cache=policy)  # the default: constants computed per k
    requests = _requests("loglikelihood", PAIRS)
    expected = [s for s, _ in plain.loglikelihood(requests, disable_tqdm=True)]
    assert [s for s, _ in folded.loglikelihood(requests, disable_tqdm=True)] == pytest.approx(expected, abs=1e-3)
    gen = _requests("generate_until", [(p, {"until": ["\x00"], "max_gen_toks": 8}) for p, _ in PAIRS])
    assert plain.generate_until(gen, disable_tqdm=True) == folded.generate_until(gen, disable_tqdm=True)


def test_empty_context_conditions_on_the_separator(model: LoopedLM) -> None:
    lm = ELRLM.from_model(model, ByteTokenizer(), loops=2)  # no EOS: documents were joined by "\n"
    [(log_prob, _)] = lm.loglikelihood(_requests("loglikelihood", [("", "abc")]), disable_tqdm=True)
    assert log_prob == pytest.approx(_direct(model, [10], list(b"abc"), 2, "per_loop")[0], abs=1e-4)


@pytest.mark.parametrize("policy", ["per_loop", "last_loop"])
def test_loglikelihood_rolling_sums_the_windows(model: LoopedLM, policy: str) -> None:
    texts = ["short text", "def f(x):\n    return x * 2\n" * 6]  # the second spans several 64-token windows
    lm = ELRLM.from_model(model, ByteTokenizer(), loops=3, kv_cache=policy, batch_size=2)
    got = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(t,) for t in texts]), disable_tqdm=True)
    for text, total in zip(texts, got):
        windows = [make_disjoint_window(w) for w in get_rolling_token_windows(list(text.encode()), 10, 64, 1)]
        assert (len(windows) > 2) == (len(text) > 128)
        expected = sum(_direct(model, ctx, cont, 3, policy)[0] for ctx, cont in windows)
        assert total == pytest.approx(expected, abs=1e-3)
    assert len(got) == 2 and got[1] < got[0]


@pytest.mark.parametrize("policy", ["per_loop", "last_loop"])
def test_generate_until_equals_generate_and_stops_at_stop_strings(model: LoopedLM, bpe: Tokenizer, policy: str) -> None:
    prompts = ["def __init__(self", "x", "import os\nimport re\n"]
    free = []
    for p in prompts:
        out = generate(model, [bpe.encode(p)], loops=3, kv_cache=policy, max_new_tokens=12, greedy=True, eos_id=bpe.eos_id)
        ids = out.new_tokens[0].tolist()
        free.append(bpe.decode(ids[: ids.index(bpe.eos_id)] if bpe.eos_id in ids else ids))
    # A stop string taken from the middle of each free continuation must cut it there.
    stops = [text[len(text) // 2 : len(text) // 2 + 2] for text in free]
    assert all(stops)
    lm = ELRLM.from_model(model, bpe, loops=3, kv_cache=policy, batch_size=2)
    args = [(p, {"until": [s], "max_gen_toks": 12, "do_sample": False}) for p, s in zip(prompts, stops)]
    args += [(p, {"until": ["\x00never"], "max_gen_toks": 12}) for p in prompts]
    got = lm.generate_until(_requests("generate_until", args), disable_tqdm=True)
    for text, stop, cut, whole in zip(free, stops, got[:3], got[3:]):
        assert whole == text
        assert cut == text[: text.index(stop)] and len(cut) < len(text)


def test_bad_model_arguments_are_refused(model: LoopedLM, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"loops=0 must be >= 1"):
        ELRLM.from_model(model, ByteTokenizer(), loops=0)
    with pytest.raises(ValueError, match=r"loops=5 is above .*max_loops=4.*allow_extrapolation"):
        ELRLM.from_model(model, ByteTokenizer(), loops=5)
    with pytest.warns(UserWarning, match="extrapolating"):
        assert ELRLM.from_model(model, ByteTokenizer(), loops=5, allow_extrapolation=True).loops == 5
    with pytest.raises(ValueError, match="kv_cache"):
        ELRLM.from_model(model, ByteTokenizer(), kv_cache="none")
    with pytest.raises(ValueError, match="batch_size: automatic"):
        ELRLM.from_model(model, ByteTokenizer(), batch_size="auto")  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError, match="missing.ckpt"):
        ELRLM(ckpt_path=str(tmp_path / "missing.ckpt"))
    with pytest.raises(ValueError, match="model_args: unknown argument.* loop;"):
        ELRLM.create_from_arg_string(f"ckpt_path={tmp_path / 'x.ckpt'},loop=4")
    with pytest.raises(ValueError, match="ckpt_path is required"):
        ELRLM.create_from_arg_string("loops=2")


#: Contexts beyond max_seq_len = 64 (cut from the left), a 64-token continuation beside 64-token contexts, and
#: a context whose trailing newline the harness moves to the continuation.
LONG = [("abcdefghij" * 12, "klm"), ("x = 1\n" * 20, " and more"), ("q", "r" * 64), ("short", "s" * 10),
        ("y" * 63, "t"), ("z" * 64, "uv"), ("w" * 70, "w" * 30)]  # fmt: skip


@pytest.mark.parametrize("policy", ["per_loop", "last_loop"])
@pytest.mark.parametrize("batch_size", [3, 16])
def test_long_requests_are_truncated_like_the_harness_in_any_batch(
    model: LoopedLM, policy: str, batch_size: int
) -> None:
    """Each score is the request's own, truncated to the last max_seq_len + 1 tokens, whatever shares its batch."""
    lm = ELRLM.from_model(model, ByteTokenizer(), loops=3, kv_cache=policy, batch_size=batch_size)
    got = lm.loglikelihood(_requests("loglikelihood", LONG), disable_tqdm=True)
    for (context, continuation), (log_prob, greedy) in zip(LONG, got):
        ctx, cont = lm._encode_pair(context, continuation)
        whole = (ctx + cont)[-(CONFIG.max_seq_len + 1) :]
        expected, expected_greedy = _direct(model, whole[: len(whole) - len(cont)], cont, 3, policy)
        assert log_prob == pytest.approx(expected, abs=2e-4)
        assert greedy == expected_greedy


def test_generate_until_cuts_long_contexts_from_the_left_to_fit_the_budget(model: LoopedLM) -> None:
    """Contexts beyond max_seq_len keep their last tokens; a 400-id model under the byte tokenizer never fails."""
    lm = ELRLM.from_model(model, ByteTokenizer(), loops=2, batch_size=3)
    never = ["\x00never"]
    args = [("a" * 200, {"until": never, "max_gen_toks": 5}), ("b" * 10, {"until": never}),
            ("c" * 200, {"until": never, "max_gen_toks": 500}),
            ("d" * 30, {"until": never, "max_gen_toks": 5})]  # fmt: skip
    got = lm.generate_until(_requests("generate_until", args), disable_tqdm=True)
    for (context, kwargs), text in zip(args, got):
        budget = min(kwargs.get("max_gen_toks", lm.max_gen_toks), CONFIG.max_seq_len - 1)
        prompt = list(context.encode())[-(CONFIG.max_seq_len - budget + 1) :]
        ours = generate(model, [prompt], loops=2, max_new_tokens=budget, greedy=True, kv_cache="per_loop")
        assert text == ByteTokenizer().decode(ours.new_tokens[0].tolist())
