"""Tests of folding the loop conditioning (eq. 4) into the layers' weights for a fixed k."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from conftest import GQA_CONFIG, PlainConditioner, perturbed_model, quiet_trainer
from elr_lightning.inference.cache import KVCache, LastLoopCache, PerLoopCache
from elr_lightning.cli import run
from elr_lightning.conditioning import LoopConditioner
from elr_lightning.inference.fold import FoldedLM, fold_conditioning
from elr_lightning.inference.cache import layer_caches
from elr_lightning.inference.generate import generate
from elr_lightning.model import LoopedLM
from elr_lightning.module import ELRModule
from elr_lightning.updates import FixedDelta

pytestmark = pytest.mark.usefixtures("one_thread")

V = GQA_CONFIG.vocab_size


@pytest.fixture(scope="module")
def model() -> LoopedLM:
    return perturbed_model()


def prompt(seed: int, shape: tuple[int, int] = (3, 9)) -> torch.Tensor:
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("loops", [1, 2, 4])
def test_folded_logits_match(model: LoopedLM, loops: int) -> None:
    folded = fold_conditioning(model, loops)
    ids = prompt(loops)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :1] = 0
    with torch.no_grad():
        for m in (None, mask):
            torch.testing.assert_close(folded(ids, loops, m), model(ids, loops, m), atol=1e-4, rtol=0)


def test_folding_changes_the_weights(model: LoopedLM) -> None:
    """The perturbed conditioning acts, so the folded weights differ per loop and from the source."""
    folded = fold_conditioning(model, 2)
    assert isinstance(folded, FoldedLM) and not folded.training and len(folded.core.per_loop) == 2
    first, second = (layers[0].attn.q for layers in folded.core.per_loop)
    assert first.bias is not None and first.bias.abs().max() > 0
    assert not torch.allclose(first.weight, second.weight)
    assert not torch.allclose(first.weight, model.core.layers[0].attn.q.weight)
    assert not any(p.requires_grad for layers in folded.core.per_loop for p in layers.parameters())
    assert folded.embed is model.embed and folded.input_layers is model.input_layers


def greedy_decode(lm: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, loops: int, cache: KVCache, n: int):
    """Greedy decoding through ``lm``'s forward with ``cache``; ``(tokens, logits)`` per step."""
    tokens, logits = [], []
    with torch.no_grad():
        out = lm(ids, loops, mask, cache)[:, -1]
        for _ in range(n):
            logits.append(out)
            tokens.append(out.argmax(-1))
            mask = torch.cat((mask, mask.new_ones(mask.shape[0], 1)), dim=1)
            out = lm(tokens[-1][:, None], loops, mask, cache)[:, -1]
    return torch.stack(tokens, 1), torch.stack(logits, 1)


@pytest.mark.parametrize("policy", [PerLoopCache, LastLoopCache])
@pytest.mark.parametrize("loops", [1, 3])
def test_folded_cached_decode_matches(model: LoopedLM, policy: type[KVCache], loops: int) -> None:
    ids = prompt(10 + loops, (2, 6))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    folded = fold_conditioning(model, loops)
    ref_tokens, ref_logits = greedy_decode(model, ids, mask, loops, policy(max_len=6 + 16), 16)
    cache = policy(max_len=6 + 16)
    tokens, logits = greedy_decode(folded, ids, mask, loops, cache, 16)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
    assert torch.equal(tokens, ref_tokens)
    assert len(cache._stores) == layer_caches(GQA_CONFIG, loops, policy)


def test_wrong_loops_raises(model: LoopedLM) -> None:
    folded = fold_conditioning(model, 2)
    with pytest.raises(ValueError, match="folded for loops=2"):
        folded(prompt(0), 3)
    with pytest.raises(ValueError, match=">= 1"):
        fold_conditioning(model, 0)


@pytest.mark.parametrize("update", [None, FixedDelta(0.3)])
def test_unconditioned_model_folds_exactly(update) -> None:
    torch.manual_seed(0)
    plain = LoopedLM(GQA_CONFIG, update=update).eval()
    folded = fold_conditioning(plain, 3)
    assert all(layers[0] is plain.core.layers[0] for layers in folded.core.per_loop)
    ids = prompt(5)
    with torch.no_grad():
        torch.testing.assert_close(folded(ids, 3), plain(ids, 3), atol=1e-5, rtol=0)


def test_inactive_conditioner_folds_to_the_plain_layers() -> None:
    torch.manual_seed(0)
    lm = LoopedLM(GQA_CONFIG, conditioner=LoopConditioner(d_cond=8, rank=2)).eval()
    lm.conditioner.set_active(False)
    folded = fold_conditioning(lm, 2)
    assert folded.output_layers[0] is lm.output_layers[0]
    ids = prompt(6)
    with torch.no_grad():
        torch.testing.assert_close(folded(ids, 2), lm(ids, 2), atol=1e-5, rtol=0)


@pytest.mark.parametrize("loops", [1, 2])
def test_generate_with_fold_matches(model: LoopedLM, loops: int) -> None:
    kwargs = dict(loops=loops, max_new_tokens=12, greedy=True, output_logits=True)
    ref = generate(model, [[1, 2, 3, 4], [5, 6]], fold=False, **kwargs)
    out = generate(model, [[1, 2, 3, 4], [5, 6]], fold=True, **kwargs)
    assert torch.equal(out.new_tokens, ref.new_tokens)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=0)
    again = generate(fold_conditioning(model, loops), [[1, 2, 3, 4], [5, 6]], fold=True, **kwargs)
    assert torch.equal(again.new_tokens, ref.new_tokens)



@pytest.mark.filterwarnings("ignore:You defined a `validation_step`")
def test_cli_generate_fold_streams_the_same_text(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    torch.manual_seed(0)
    module = ELRModule(arch=replace(GQA_CONFIG, vocab_size=256), conditioner=LoopConditioner(d_cond=8, rank=2))
    trainer = quiet_trainer(max_steps=1, limit_val_batches=0)
    trainer.fit(module, DataLoader(torch.randint(0, 256, (4, 9)), batch_size=4))
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn_like(p))
    path = tmp_path / "tiny.ckpt"
    trainer.save_checkpoint(path)
    capsys.readouterr()  # drop fit's own output: a model summary table on stdout when rich is installed
    args = ["generate", "--ckpt_path", str(path), "--prompt", "hi", "--loops", "2", "--max_new_tokens", "10",
            "--temperature", "0", "--tokenizer", "byte"]  # fmt: skip
    run([*args, "--no_fold"])
    plain = capsys.readouterr().out
    run([*args, "--fold"])
    assert capsys.readouterr().out == plain


def test_a_modulator_without_affine_cannot_be_folded():
    model = LoopedLM(GQA_CONFIG, conditioner=PlainConditioner(d_cond=8, rank=2))
    with pytest.raises(NotImplementedError, match="Identity does not implement affine"):
        fold_conditioning(model, 2)
