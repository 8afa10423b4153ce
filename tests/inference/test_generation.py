"""Tests of generation: cache exactness, padding, sampling, streaming, checkpoints and ``elr generate``."""

import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from elr_lightning.cli import run
from elr_lightning.conditioning import LoopConditioner
from elr_lightning.config import ModelConfig
from elr_lightning.inference.cache import LastLoopCache
from elr_lightning.inference.generate import filter_logits, generate, load_model, stream_generate
from elr_lightning.inference.prompts import left_pad
from conftest import GQA_CONFIG, REPO_ROOT, perturbed_model, quiet_trainer
from elr_lightning.model import LoopedLM
from elr_lightning.module import ELRModule
from elr_lightning.tokenizers import ByteTokenizer, IncrementalDecoder

CONFIG = GQA_CONFIG
QUICKSTART = REPO_ROOT / "config" / "quickstart.yaml"


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(config: ModelConfig = CONFIG, seed: int = 0) -> LoopedLM:
    """The shared perturbed model (see conftest)."""
    return perturbed_model(config, seed)


@pytest.fixture(scope="module")
def model() -> LoopedLM:
    return tiny_model()


# ---- exactness of the caches ----------------------------------------------------------------------


@pytest.mark.parametrize("loops", [1, 2, 4])
def test_per_loop_cache_matches_full_forward(model: LoopedLM, loops: int) -> None:
    prompt = torch.randint(0, CONFIG.vocab_size, (2, 5), generator=torch.Generator().manual_seed(loops))
    out = generate(model, prompt, loops=loops, kv_cache="per_loop", max_new_tokens=32, greedy=True, output_logits=True)
    assert out.new_tokens.shape == (2, 32)
    with torch.no_grad():
        for n in range(32):
            full = model(out.sequences[:, : 5 + n], loops)[:, -1]
            torch.testing.assert_close(out.logits[:, n], full, atol=1e-4, rtol=0)
            assert torch.equal(out.new_tokens[:, n], full.argmax(-1))


def test_last_loop_equals_per_loop_at_one_loop(model: LoopedLM) -> None:
    prompt = torch.randint(0, CONFIG.vocab_size, (3, 6))
    kwargs = dict(loops=1, max_new_tokens=16, greedy=True, output_logits=True)
    per = generate(model, prompt, kv_cache="per_loop", **kwargs)
    last = generate(model, prompt, kv_cache="last_loop", **kwargs)
    assert torch.equal(per.new_tokens, last.new_tokens)
    torch.testing.assert_close(per.logits, last.logits, atol=1e-6, rtol=0)


# ---- left padding ---------------------------------------------------------------------------------


def _alone_vs_padded(model: LoopedLM, prompts: list[list[int]], loops: int, policy: str, steps: int) -> None:
    kwargs = dict(loops=loops, kv_cache=policy, max_new_tokens=steps, greedy=True, output_logits=True)
    batched = generate(model, prompts, **kwargs)
    for i, p in enumerate(prompts):
        alone = generate(model, [p], **kwargs)
        assert torch.equal(batched.new_tokens[i], alone.new_tokens[0]), (i, p)
        torch.testing.assert_close(batched.logits[i], alone.logits[0], atol=1e-4, rtol=0)


@pytest.mark.parametrize("policy", ["per_loop", "last_loop"])
def test_left_padded_batch_equals_each_prompt_alone(model: LoopedLM, policy: str) -> None:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, CONFIG.vocab_size, (n,), generator=g).tolist() for n in (3, 9, 1, 6)]
    _alone_vs_padded(model, prompts, loops=3, policy=policy, steps=12)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(1, 10), min_size=1, max_size=3),
    loops=st.integers(1, 4),
    policy=st.sampled_from(["per_loop", "last_loop"]),
    seed=st.integers(0, 2**16),
)
def test_padded_equals_alone_property(model: LoopedLM, lengths: list[int], loops: int, policy: str, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, CONFIG.vocab_size, (n,), generator=g).tolist() for n in lengths]
    _alone_vs_padded(model, prompts, loops=loops, policy=policy, steps=6)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(length=st.integers(1, 12), loops=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_per_loop_exact_property(model: LoopedLM, length: int, loops: int, seed: int) -> None:
    prompt = torch.randint(0, CONFIG.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))
    out = generate(model, prompt, loops=loops, max_new_tokens=6, greedy=True, output_logits=True)
    with torch.no_grad():
        full = model(out.sequences[:, :-1], loops)[:, length - 1 :]
    torch.testing.assert_close(out.logits, full, atol=1e-4, rtol=0)


def test_left_pad_helper() -> None:
    ids, mask = left_pad([[1, 2], [3]], pad_id=9)
    assert ids.tolist() == [[1, 2], [9, 3]]
    assert mask.tolist() == [[1, 1], [0, 1]]


def test_explicit_mask_equals_token_lists(model: LoopedLM) -> None:
    ids, mask = left_pad([[4, 5, 6], [7]], pad_id=0)
    a = generate(model, ids, attention_mask=mask, loops=2, max_new_tokens=5, greedy=True)
    b = generate(model, [[4, 5, 6], [7]], loops=2, max_new_tokens=5, greedy=True)
    assert torch.equal(a.new_tokens, b.new_tokens)


# ---- stopping, sampling, streaming -----------------------------------------------------------------


def test_max_new_tokens_and_sequences(model: LoopedLM) -> None:
    out = generate(model, [[1, 2, 3], [4]], loops=2, max_new_tokens=7, greedy=True)
    assert out.new_tokens.shape == (2, 7)
    assert out.sequences.shape == (2, 3 + 7)
    assert torch.equal(out.sequences[:, 3:], out.new_tokens)
    assert out.logits is None


def test_eos_stops_each_sequence(model: LoopedLM) -> None:
    prompts = [[1, 2, 3], [10, 11]]
    free = generate(model, prompts, loops=2, max_new_tokens=12, greedy=True).new_tokens
    eos = int(free[0, 2])
    first = {i: next(n for n in range(12) if free[i, n] == eos) if (free[i] == eos).any() else None for i in (0, 1)}
    out = generate(model, prompts, loops=2, max_new_tokens=12, greedy=True, eos_id=eos, pad_id=63)
    steps = max(12 if f is None else f + 1 for f in first.values())
    assert out.new_tokens.shape == (2, steps)
    for i, f in first.items():
        end = steps if f is None else f + 1
        assert torch.equal(out.new_tokens[i, :end], free[i, :end])
        assert (out.new_tokens[i, end:] == 63).all()


def test_eos_single_sequence_stops_right_after_eos(model: LoopedLM) -> None:
    free = generate(model, [[7, 8, 9]], loops=1, max_new_tokens=10, greedy=True).new_tokens[0]
    eos = int(free[4])
    stop = int((free == eos).nonzero()[0]) + 1
    tokens = list(stream_generate(model, [[7, 8, 9]], loops=1, max_new_tokens=10, greedy=True, eos_id=eos))
    assert len(tokens) == stop
    assert int(tokens[-1][0]) == eos


def test_seeded_sampling_is_reproducible(model: LoopedLM) -> None:
    kwargs = dict(loops=2, max_new_tokens=24, temperature=1.5)
    a = generate(model, [[1, 2, 3]], seed=123, **kwargs).new_tokens
    b = generate(model, [[1, 2, 3]], seed=123, **kwargs).new_tokens
    c = generate(model, [[1, 2, 3]], seed=124, **kwargs).new_tokens
    d = generate(model, [[1, 2, 3]], generator=torch.Generator().manual_seed(123), **kwargs).new_tokens
    assert torch.equal(a, b) and torch.equal(a, d)
    assert not torch.equal(a, c)


def test_greedy_forms_agree(model: LoopedLM) -> None:
    kwargs = dict(loops=3, max_new_tokens=10)
    greedy = generate(model, [[3, 1, 4]], greedy=True, **kwargs).new_tokens
    assert torch.equal(generate(model, [[3, 1, 4]], temperature=0.0, **kwargs).new_tokens, greedy)
    assert torch.equal(generate(model, [[3, 1, 4]], top_k=1, seed=5, **kwargs).new_tokens, greedy)
    assert torch.equal(generate(model, [[3, 1, 4]], top_p=1e-6, seed=5, **kwargs).new_tokens, greedy)


def test_top_k_and_top_p_restrict_sampled_support(model: LoopedLM) -> None:
    prompts = [[1, 2], [3, 4]]
    out = generate(model, prompts, loops=2, max_new_tokens=20, top_k=3, temperature=2.0, seed=0, output_logits=True)
    top3 = out.logits.topk(3, dim=-1).indices
    assert (top3 == out.new_tokens[..., None]).any(-1).all()
    out = generate(model, prompts, loops=2, max_new_tokens=20, top_p=0.5, seed=0, output_logits=True)
    kept = filter_logits(out.logits.flatten(0, 1), top_p=0.5).isfinite()
    assert kept.gather(1, out.new_tokens.flatten()[:, None]).all()


def test_filter_logits() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    assert filter_logits(logits, top_k=2).isfinite().tolist() == [[True, True, False, False, False]]
    assert filter_logits(logits, top_p=0.5).isfinite().tolist() == [[True, False, False, False, False]]
    assert filter_logits(logits, top_p=0.6).isfinite().tolist() == [[True, True, False, False, False]]
    assert filter_logits(logits, top_p=0.85).isfinite().tolist() == [[True, True, True, False, False]]
    shuffled = logits[:, [3, 0, 4, 2, 1]]
    assert filter_logits(shuffled, top_p=0.6).isfinite().tolist() == [[False, True, False, False, True]]
    assert filter_logits(logits, top_k=99).isfinite().all()


def test_streaming_callback_and_iterator_see_every_token_in_order(model: LoopedLM) -> None:
    seen: list[torch.Tensor] = []
    out = generate(model, [[1, 2, 3], [5]], loops=2, max_new_tokens=9, seed=3, callback=seen.append)
    assert torch.equal(torch.stack(seen, dim=1), out.new_tokens)
    streamed = list(stream_generate(model, [[1, 2, 3], [5]], loops=2, max_new_tokens=9, seed=3))
    assert torch.equal(torch.stack(streamed, dim=1), out.new_tokens)


def test_stream_does_not_leak_inference_mode(model: LoopedLM) -> None:
    for _ in stream_generate(model, [[1, 2]], loops=1, max_new_tokens=2, greedy=True):
        assert not torch.is_inference_mode_enabled()


def test_elr_module_is_accepted() -> None:
    module = ELRModule(arch=CONFIG)
    out = generate(module, [[1, 2]], loops=2, max_new_tokens=3, greedy=True)
    assert out.new_tokens.shape == (1, 3)


def test_bad_requests_raise(model: LoopedLM) -> None:
    with pytest.raises(ValueError, match="empty"):
        generate(model, torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="empty"):
        generate(model, [[1, 2], []])
    with pytest.raises(ValueError, match="empty"):
        generate(model, torch.ones(2, 3, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]]))
    with pytest.raises(ValueError, match="left-padded"):
        generate(model, torch.ones(1, 3, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 0]]))
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(model, [[1] * 60], max_new_tokens=10)
    with pytest.raises(ValueError, match="temperature"):
        stream_generate(model, [[1]], temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, [[1]], top_p=0.0)
    with pytest.raises(ValueError, match="loops"):
        generate(model, [[1]], loops=0)
    with pytest.raises(ValueError, match="fresh"):
        used = LastLoopCache(16)
        used.advance(1)
        generate(model, [[1]], kv_cache=used)


def test_incremental_decoder_holds_back_partial_utf8() -> None:
    text = "héllo → 世界!"
    decoder = IncrementalDecoder(ByteTokenizer())
    pieces = [decoder.push(b) for b in text.encode("utf-8")]
    pieces.append(decoder.flush())
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


# ---- checkpoints and the CLI -----------------------------------------------------------------------


CKPT_ARCH = ModelConfig(d_model=32, n_heads=2, n_in=1, n_rec=1, n_out=1, max_loops=4, max_seq_len=128)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ELRModule]:
    torch.manual_seed(0)
    module = ELRModule(arch=CKPT_ARCH, conditioner=LoopConditioner(d_cond=8, rank=2))
    data = DataLoader(torch.randint(0, 256, (8, 17)), batch_size=4)
    trainer = quiet_trainer(max_steps=2)
    trainer.fit(module, data)
    path = tmp_path_factory.mktemp("ckpt") / "tiny.ckpt"
    trainer.save_checkpoint(path)
    return path, module


def test_load_model_round_trip(checkpoint: tuple[Path, ELRModule]) -> None:
    path, trained = checkpoint
    model, module = load_model(str(path))
    assert isinstance(module, ELRModule) and module.model is model and not model.training
    assert model.config == CKPT_ARCH
    ids = torch.randint(0, 256, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, 3), trained.model.eval()(ids, 3))


def test_load_model_of_a_meta_init_run_has_real_weights(checkpoint: tuple[Path, ELRModule], tmp_path: Path) -> None:
    path, trained = checkpoint
    raw = torch.load(path, weights_only=True)
    raw["hyper_parameters"]["meta_init"] = True  # as saved by an FSDP run with meta_init: true
    meta_path = tmp_path / "meta.ckpt"
    torch.save(raw, meta_path)
    model, _ = load_model(str(meta_path))
    assert not any(p.is_meta for p in model.parameters())
    ids = torch.randint(0, 256, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, 3), trained.model.eval()(ids, 3))


def test_load_model_errors_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.ckpt"
    with pytest.raises(FileNotFoundError, match="nope.ckpt"):
        load_model(str(missing))
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(os.urandom(256))
    with pytest.raises(ValueError, match="garbage.ckpt"):
        load_model(str(garbage))
    weights = tmp_path / "weights.ckpt"
    torch.save({"w": torch.zeros(2)}, weights)
    with pytest.raises(ValueError, match="weights.ckpt.*not a Lightning"):
        load_model(str(weights))


def test_cli_generate_streams_the_continuation(
    checkpoint: tuple[Path, ELRModule], capsys: pytest.CaptureFixture
) -> None:
    path, _ = checkpoint
    run(["generate", "--ckpt_path", str(path), "--prompt", "hello", "--loops", "2", "--kv_cache", "last_loop",
          "--max_new_tokens", "12", "--temperature", "0"])  # fmt: skip
    captured = capsys.readouterr()
    model, _ = load_model(str(path))
    expected = generate(model, [list(b"hello")], loops=2, kv_cache="last_loop", max_new_tokens=12, greedy=True)
    assert captured.out == "hello" + ByteTokenizer().decode(expected.new_tokens[0].tolist()) + "\n"


def test_cli_generate_prompt_file_stats_and_sampling(
    checkpoint: tuple[Path, ELRModule], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path, _ = checkpoint
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("def f(", encoding="utf-8")
    args = ["generate", "--ckpt_path", str(path), "--prompt_file", str(prompt), "--max_new_tokens", "6",
            "--seed", "1", "--top_k", "5", "--top_p", "0.9", "--stats", "--no_echo_prompt"]  # fmt: skip
    run(args)
    first = capsys.readouterr()
    run(args)
    second = capsys.readouterr()
    assert first.out == second.out and not first.out.startswith("def f(")
    assert "KV cache" in first.err and "tok/s" in first.err and "kv_cache=per_loop" in first.err


def test_cli_generate_errors(checkpoint: tuple[Path, ELRModule], tmp_path: Path) -> None:
    path = str(checkpoint[0])
    with pytest.raises(ValueError, match="empty"):
        run(["generate", "--ckpt_path", path, "--prompt", ""])
    with pytest.raises(ValueError, match=r"--loops 5.*max_loops=4.*--allow_extrapolation"):
        run(["generate", "--ckpt_path", path, "--prompt", "x", "--loops", "5"])
    missing = str(tmp_path / "missing.ckpt")
    with pytest.raises(FileNotFoundError, match="missing.ckpt"):
        run(["generate", "--ckpt_path", missing, "--prompt", "x"])
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_text("not a checkpoint")
    with pytest.raises(ValueError, match="garbage.ckpt"):
        run(["generate", "--ckpt_path", str(garbage), "--prompt", "x"])


def test_cli_generate_extrapolates_with_the_flag(
    checkpoint: tuple[Path, ELRModule], capsys: pytest.CaptureFixture
) -> None:
    path = str(checkpoint[0])
    with pytest.warns(UserWarning, match="--loops 5"):
        run(["generate", "--ckpt_path", path, "--prompt", "x", "--loops", "5", "--allow_extrapolation",
              "--max_new_tokens", "3", "--seed", "0"])  # fmt: skip
    assert capsys.readouterr().out.startswith("x")


@pytest.mark.slow
def test_checkpoint_from_elr_fit_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A checkpoint written by the real ``elr fit`` (quickstart config, 3 steps) generates."""
    monkeypatch.chdir(tmp_path)
    run(["fit", "--config", str(QUICKSTART), "--trainer.max_steps", "3", "--trainer.val_check_interval", "3",
          "--data.init_args.max_bytes", "300000", "--trainer.default_root_dir", str(tmp_path),
          "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),
          "--trainer.enable_progress_bar", "false"])  # fmt: skip
    ckpts = sorted(tmp_path.rglob("last.ckpt"))
    assert ckpts, "elr fit wrote no last.ckpt"
    capsys.readouterr()
    run(["generate", "--ckpt_path", str(ckpts[0]), "--prompt", "import ", "--loops", "3", "--kv_cache", "last_loop",
          "--max_new_tokens", "8", "--seed", "0"])  # fmt: skip
    assert capsys.readouterr().out.startswith("import ")
