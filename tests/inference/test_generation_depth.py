"""Tests of the shared decode loop: mixed depths in one step, adaptive depth per token, skipped loops' cache."""

from dataclasses import replace

import pytest
import torch

from conftest import GQA_CONFIG, PlainConditioner, perturbed_model
from elr_lightning.inference.decode import AdaptiveDepth, Decoder
from elr_lightning.inference.generate import generate
from elr_lightning.mixers import MoE
from elr_lightning.model import LoopedLM
from test_moe import moe_config

pytestmark = pytest.mark.usefixtures("one_thread")

K = GQA_CONFIG.max_loops
HYBRID = replace(
    GQA_CONFIG,
    token_pattern={"in": ["gdp"], "rec": ["gdp", "attention"], "out": ["attention"]},
    mixers={"gdp": {"class_path": "elr_lightning.mixers.GatedDeltaProduct", "init_args": {"chunk_size": 8}}},
)
#: Every channel mixer a mixture of experts; loops 2..k replay loop 1's routes.
MOE = moe_config(GQA_CONFIG, replay="replay", shared_expert_dim=8)
ARCHS = {"attention": GQA_CONFIG, "hybrid": HYBRID, "moe": MOE}


@pytest.fixture(scope="module", params=list(ARCHS))
def model(request: pytest.FixtureRequest) -> LoopedLM:
    return perturbed_model(ARCHS[request.param])


#: A depth that exits at some tokens and not at others on the perturbed models.
AUTO = AdaptiveDepth(K, 0.015, "kl")


def alone(model: LoopedLM, prompt: list[int], depth, policy: str, steps: int):
    return generate(model, [prompt], loops=depth, kv_cache=policy, max_new_tokens=steps, greedy=True, output_logits=True)


#: The prompts of the rows decoded together.
PROMPTS = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5, 8, 9, 7], [2, 7, 1], [8]]


def together_equal_alone(model: LoopedLM, depths: list, policy: str, steps: int = 8) -> list[list[int]]:
    """Decode :data:`PROMPTS` at ``depths`` in shared steps; assert each row's logits within 1e-4 of the row alone,
    and its greedy tokens and loops used equal. Returns the loops each row used per decoded token."""
    decoder = Decoder(model, len(PROMPTS), 7 + steps, policy)
    logits = [[decoder.prefill(i, torch.tensor(p), d)] for i, (p, d) in enumerate(zip(PROMPTS, depths))]
    used = [[] for _ in PROMPTS]
    for _ in range(steps - 1):
        tokens = torch.stack([row[-1].argmax() for row in logits])
        step, step_used = decoder.step(list(range(len(PROMPTS))), tokens, depths)
        for i in range(len(PROMPTS)):
            logits[i].append(step[i])
            used[i].append(int(step_used[i]))
    for i, (p, d) in enumerate(zip(PROMPTS, depths)):
        ref = alone(model, p, d, policy, steps)
        torch.testing.assert_close(torch.stack(logits[i]), ref.logits[0], atol=1e-4, rtol=0)
        assert torch.equal(torch.stack(logits[i]).argmax(-1), ref.new_tokens[0])
        assert used[i] == ref.loops_used[0, 1:].tolist()
    return used


@pytest.mark.parametrize("policy", ["per_loop", "last_loop"])
def test_rows_of_different_depths_share_a_step_and_equal_each_row_alone(model: LoopedLM, policy: str) -> None:
    """k = 1, K and auto (both criteria) in one step: logits within 1e-4 of the row alone, greedy tokens equal."""
    used = together_equal_alone(model, [1, K, AUTO, AdaptiveDepth(K, 0.5, "delta"), 2], policy)
    assert 1 < sum(used[2]) / len(used[2]) < K, "the adaptive row never or always exited; the test shows nothing"


@pytest.mark.parametrize("policy", ["per_loop", "last_loop"])
@pytest.mark.parametrize("replay", ["replay", "replay_experts", "dynamic"])
def test_moe_rows_of_a_mixed_step_route_as_they_would_alone(replay: str, policy: str) -> None:
    """k = 1, 2, 3 and auto in one step: each row replays its own loop 1 routes at its later loops (or, without
    replay, routes every loop), so it equals the row alone, also where exits leave a loop a non-prefix of the rows."""
    model = perturbed_model(moe_config(GQA_CONFIG, replay=replay, num_experts=8, shared_expert_dim=8))
    depths = [2, AdaptiveDepth(3, 0.5, "delta"), 1, AUTO, 3]
    used = together_equal_alone(model, depths, policy)
    # the auto rows sort first: one leaving before loop 3, which the k = 3 row runs, thins loop 3 to a non-prefix
    assert min(used[1] + used[3]) < 3, "no adaptive row left early; the test shows nothing"
    if replay != "dynamic":  # replaying must matter: routing every loop moves the rows at k = 2 and 3
        replayed = [alone(model, PROMPTS[i], depths[i], policy, 8).logits for i in (0, 4)]
        for moe in (m for m in model.modules() if isinstance(m, MoE)):
            moe.replay = "dynamic"
        routed = [alone(model, PROMPTS[i], depths[i], policy, 8).logits for i in (0, 4)]
        assert max(float((a - b).abs().max()) for a, b in zip(routed, replayed)) > 1e-2


@pytest.mark.parametrize("replay", ["replay", "replay_experts", "dynamic"])
def test_a_mixed_moe_step_routes_at_loop_one_only_under_replay(replay: str, monkeypatch) -> None:
    """Rows at k = 1, 3, 2: loop i runs on the rows whose k reaches it; under replay only loop 1 routes (top-k)."""
    model = perturbed_model(moe_config(GQA_CONFIG, replay=replay))
    decoder = Decoder(model, 3, 8, "per_loop")
    depths = [1, 3, 2]
    last = [decoder.prefill(i, torch.tensor([5, 6, 7]), d) for i, d in enumerate(depths)]
    routed: list[tuple[int, int]] = []  # (recurrent layer, rows) of each routing call
    for j, block in enumerate(model.core.layers):

        def route(logits: torch.Tensor, j: int = j, own=block.mlp.route):
            routed.append((j, len(logits)))
            return own(logits)

        monkeypatch.setattr(block.mlp, "route", route)
    decoder.step([0, 1, 2], torch.stack([x.argmax() for x in last]), depths)
    loops = (3, 2, 1) if replay == "dynamic" else (3,)  # rows per loop: every row reaches loop 1, one reaches 3
    assert routed == [(j, rows) for rows in loops for j in range(GQA_CONFIG.n_rec)]


@pytest.mark.parametrize("policy", ["per_loop", "last_loop"])
def test_a_mixed_step_is_the_same_in_any_order_of_slots_and_depths(model: LoopedLM, policy: str) -> None:
    """Rows are put in order of budget inside a step (each loop runs on a prefix): the caller's order does not matter."""
    prompts = {0: [3, 1, 4], 2: [9, 2, 6, 5], 3: [5], 5: [8, 9, 7, 9, 3], 6: [2, 3]}
    depths = {0: 1, 2: K, 3: 2, 5: AdaptiveDepth(K, 0.5, "delta"), 6: K}
    results = []
    for order in ([0, 2, 3, 5, 6], [6, 3, 0, 5, 2]):
        decoder = Decoder(model, 7, 8, policy)
        last = {s: decoder.prefill(s, torch.tensor(prompts[s]), depths[s]).argmax() for s in order}
        logits, used = decoder.step(order, torch.stack([last[s] for s in order]), [depths[s] for s in order])
        results.append({s: (logits[i], int(used[i])) for i, s in enumerate(order)})
    for s in prompts:
        torch.testing.assert_close(results[0][s][0], results[1][s][0], atol=1e-5, rtol=0)
        assert results[0][s][1] == results[1][s][1]
        if isinstance(depths[s], int):
            assert results[0][s][1] == depths[s]


@pytest.mark.parametrize("conditioner", [None, PlainConditioner])
def test_mixed_rows_equal_each_row_alone_whatever_the_conditioning(conditioner) -> None:
    """The other per-row forms: no conditioning, and a modulator without constants (its heads run per row)."""
    torch.manual_seed(0)
    model = LoopedLM(GQA_CONFIG, conditioner=conditioner and conditioner(d_cond=8, rank=2))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.eval()
    prompts, depths = [[3, 1, 4], [9, 2], [6, 5, 3, 5]], [2, 1, K]
    decoder = Decoder(model, 3, 6, "per_loop")
    last = [decoder.prefill(i, torch.tensor(p), d) for i, (p, d) in enumerate(zip(prompts, depths))]
    step, _ = decoder.step([0, 1, 2], torch.stack([x.argmax() for x in last]), depths)
    for i, (p, d) in enumerate(zip(prompts, depths)):
        torch.testing.assert_close(step[i], alone(model, p, d, "per_loop", 2).logits[0, 1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("policy", ["per_loop", "last_loop"])
def test_auto_that_never_exits_is_k_at_the_budget(model: LoopedLM, policy: str) -> None:
    prompt = torch.randint(0, 64, (2, 4), generator=torch.Generator().manual_seed(1))
    fixed = generate(model, prompt, loops=K, kv_cache=policy, max_new_tokens=6, greedy=True, output_logits=True)
    auto = generate(model, prompt, loops="auto", threshold=0.0, kv_cache=policy, max_new_tokens=6, greedy=True,
                    output_logits=True)  # fmt: skip
    assert torch.equal(auto.new_tokens, fixed.new_tokens)
    torch.testing.assert_close(auto.logits, fixed.logits, atol=1e-6, rtol=0)
    assert bool((auto.loops_used == K).all())


@pytest.mark.parametrize("criterion", ["kl", "delta"])
def test_tokens_leave_after_one_loop_and_per_loop_fills_the_skipped_loops(criterion: str) -> None:
    """Under per_loop, the loops a token skipped hold its exit loop's keys and values at its position."""
    model = perturbed_model(GQA_CONFIG)
    out = generate(model, [[5, 6, 7]], loops="auto", threshold=1e9, exit_criterion=criterion, kv_cache="per_loop",
                   max_new_tokens=4, greedy=True)  # fmt: skip
    assert out.loops_used[0].tolist() == [K, 1, 1, 1]  # the prompt runs at the budget
    cache = out.cache
    for layer in (GQA_CONFIG.layer_index("rec", j) for j in range(GQA_CONFIG.n_rec)):
        first = cache.slot(layer, 1)
        for loop in range(2, K + 1):
            store = cache.slot(layer, loop)
            assert torch.equal(store.k[0, :, 3:6], first.k[0, :, 3:6])
            assert not torch.equal(store.k[0, :, :3], first.k[0, :, :3])  # the prompt ran every loop


@pytest.mark.parametrize("criterion", ["kl", "delta"])
def test_a_tiny_threshold_never_exits_beside_other_rows(criterion: str) -> None:
    """Each loop changes the state and the distribution, so a threshold of 1e-9 keeps every token at the budget.

    Beside a fixed-k row, each loop runs on a prefix of the rows (views of the state): the change
    must be measured against the state before the loop, not the one the loop just wrote.
    """
    model = perturbed_model(GQA_CONFIG)
    decoder = Decoder(model, 2, 8, "per_loop")
    depths = [AdaptiveDepth(K, 1e-9, criterion), 1]
    last = [decoder.prefill(i, torch.tensor([5, 6, 7]), d) for i, d in enumerate(depths)]
    for _ in range(3):
        logits, used = decoder.step([0, 1], torch.stack([x.argmax() for x in last]), depths)
        assert used.tolist() == [K, 1]
        last = list(logits)


def test_depth_arguments_are_checked_naming_the_field() -> None:
    model = perturbed_model(GQA_CONFIG)
    with pytest.raises(ValueError, match="loops='fast' must be an integer >= 1 or 'auto'"):
        generate(model, [[1]], loops="fast")
    with pytest.raises(ValueError, match="threshold=-1.0 must be a finite number >= 0"):
        generate(model, [[1]], loops="auto", threshold=-1.0)
    with pytest.raises(ValueError, match="criterion='entropy' must be one of"):
        generate(model, [[1]], loops="auto", exit_criterion="entropy")
    with pytest.raises(ValueError, match="loops=0 must be an integer >= 1"):
        generate(model, [[1]], loops="auto", max_loops=0)


def test_eval_adapter_scores_and_generates_with_auto_depth() -> None:
    """``loops=auto`` in the lm-eval adapter: with a threshold of 0 it scores as k = K; higher, it exits early."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from elr_lightning.eval import ELRLM
    from elr_lightning.tokenizers import ByteTokenizer

    model = perturbed_model(replace(GQA_CONFIG, vocab_size=256))
    pairs = [("def f(x", "):\n    return x"), ("import", " os")]
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i) for i, p in enumerate(pairs)]
    tok = ByteTokenizer()
    fixed = ELRLM.from_model(model, tok, loops=K).loglikelihood(requests, disable_tqdm=True)
    never = ELRLM.from_model(model, tok, loops="auto", threshold=0.0).loglikelihood(requests, disable_tqdm=True)
    early = ELRLM.from_model(model, tok, loops="auto", threshold=1e9).loglikelihood(requests, disable_tqdm=True)
    assert [lp for lp, _ in never] == pytest.approx([lp for lp, _ in fixed], abs=1e-4)
    assert [lp for lp, _ in early] != pytest.approx([lp for lp, _ in fixed], abs=1e-3)
    lm = ELRLM.from_model(model, tok, loops="auto", threshold=1e9)
    texts = lm.generate_texts(["def "], ["\n"], max_gen_toks=5)
    expected = generate(model, [tok.encode("def ")], loops=lm.depth, max_new_tokens=5, greedy=True)
    assert texts[0] == tok.decode(expected.new_tokens[0].tolist()).split("\n")[0]
    with pytest.raises(ValueError, match="loops='fast' must be an integer >= 1 or 'auto'"):
        ELRLM.from_model(model, tok, loops="fast")


@pytest.mark.parametrize("loops", [2, AdaptiveDepth(2, 0.1)], ids=["k", "adaptive_depth"])
@pytest.mark.parametrize("given", [{"threshold": 0.5}, {"exit_criterion": "delta"}, {"max_loops": 3}])
def test_adaptive_arguments_with_a_fixed_depth_are_refused(loops, given: dict) -> None:
    """``generate(loops=2, threshold=0.5)`` would decode at k = 2 and ignore the threshold: refused, naming it."""
    model = perturbed_model(GQA_CONFIG)
    with pytest.raises(ValueError, match=f"^{next(iter(given))} is only read with loops='auto'"):
        generate(model, [[1, 2]], loops=loops, max_new_tokens=2, **given)


def test_elr_generate_loops_auto_prints_the_loops_per_token(tmp_path, capsys) -> None:
    from _elr_ckpt import write_checkpoint
    from elr_lightning.cli import run

    ckpt = tmp_path / "tiny.ckpt"
    write_checkpoint(ckpt)
    run(["generate", "--ckpt_path", str(ckpt), "--prompt", "def", "--loops", "auto", "--threshold", "0.1",
         "--max_new_tokens", "5", "--temperature", "0", "--stats"])  # fmt: skip
    err = capsys.readouterr().err
    assert "loops per decoded token: mean" in err
    for flags in (["--max_loops", "3"], ["--threshold", "0.1"], ["--exit_criterion", "delta"], ["--exit_criterion", "kl"]):
        with pytest.raises(ValueError, match=f"{flags[0]} is only read with --loops auto"):
            run(["generate", "--ckpt_path", str(ckpt), "--prompt", "def", "--loops", "2", *flags])
