"""Labelled batches (``{"input_ids", "labels"}`` with ``IGNORE_INDEX``): loss, shards, validation, refusals."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import tiny_config
from elr_lightning import IGNORE_INDEX
from elr_lightning.batches import TokenBatch, next_token_labels
from elr_lightning.callbacks import ComputeAccounting, DelayedMixedDepth, ZeroInitConditioning
from elr_lightning.conditioning import LoopConditioner
from elr_lightning.data import StepIndexedLoader
from elr_lightning.data.labelled import LabelledExamples
from elr_lightning.module import ELRModule
from elr_lightning.sampling import FixedLoops, IndependentRank, OneLoopOverride, UniformLoops

VOCAB = 64


def perturbed(seed: int = 0, **kwargs: Any) -> ELRModule:
    """A conditioned module whose zero-initialised gate and heads are perturbed, so every part acts."""
    torch.manual_seed(seed)
    module = ELRModule(arch=tiny_config(), conditioner=LoopConditioner(d_cond=8, rank=2), **kwargs)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return module


def grads(module: ELRModule) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def loss_and_grads(module: ELRModule, batch: Any, loops: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    module.zero_grad(set_to_none=True)
    loss = module.shard_loss(batch, loops)
    loss.backward()
    return loss.detach(), grads(module)


def assert_same_grads(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], **tol: float) -> None:
    assert a.keys() == b.keys() and len(a) > 0
    for name in a:
        torch.testing.assert_close(a[name], b[name], msg=name, **tol)


def parity_batch(rows: int, length: int, seed: int) -> dict[str, torch.Tensor]:
    """Position-aligned targets: bits (ids 0/1) and the parity of the prefix at every position (ids 2/3)."""
    bits = torch.randint(0, 2, (rows, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": bits, "labels": 2 + bits.cumsum(1) % 2}


# ---- the loss ----------------------------------------------------------------------------------


@settings(max_examples=6)
@given(seed=st.integers(0, 2**16), k0=st.integers(1, 4), k1=st.integers(1, 4))
def test_next_token_labels_train_exactly_like_token_windows(seed, k0, k1):
    """The labelled form of a window batch (labels = the next tokens, none ignored) is the same loss and gradient."""
    module = perturbed(seed, virtual_ranks=2)
    windows = torch.randint(0, VOCAB, (4, 17), generator=torch.Generator().manual_seed(seed))
    labelled = {"input_ids": windows[:, :-1], "labels": windows[:, 1:]}
    loss, plain = loss_and_grads(module, windows, [k0, k1])
    loss_labelled, labelled_grads = loss_and_grads(module, labelled, [k0, k1])
    assert torch.equal(loss, loss_labelled)
    assert_same_grads(plain, labelled_grads, rtol=0, atol=0)


@settings(max_examples=8)
@given(seed=st.integers(0, 2**16), k=st.integers(1, 4), keep=st.floats(0.05, 0.95))
def test_ignored_positions_add_neither_loss_nor_gradient(seed, k, keep):
    """The loss is the mean over labelled positions only; ignored positions' would-be targets do not matter."""
    module = perturbed(seed)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (3, 16), generator=g)
    targets = torch.randint(0, VOCAB, (3, 16), generator=g)
    mask = torch.rand(3, 16, generator=g) < keep
    mask[0, 0] = True
    batch = {"input_ids": ids, "labels": torch.where(mask, targets, IGNORE_INDEX)}
    loss, got = loss_and_grads(module, batch, [k])
    module.zero_grad(set_to_none=True)
    logits = module(ids, k)
    expected = F.cross_entropy(logits[mask].float(), targets[mask])
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads(got, grads(module), rtol=1e-5, atol=1e-7)


def test_shards_weigh_by_their_labelled_tokens():
    """One mean over the step's labelled tokens: a shard with more targets weighs more (not a mean of shard means)."""
    module = perturbed(1, virtual_ranks=2)
    batch = parity_batch(4, 16, seed=1)
    labels = batch["labels"].clone()
    labels[:2, 1:] = IGNORE_INDEX  # shard 0: 2 targets; shard 1: 32
    batch["labels"] = labels
    loss = module.shard_loss(batch, [1, 3])
    sums = [
        F.cross_entropy(module(ids, k).flatten(0, 1), lab.flatten(), reduction="sum")
        for ids, lab, k in ((batch["input_ids"][:2], labels[:2], 1), (batch["input_ids"][2:], labels[2:], 3))
    ]
    torch.testing.assert_close(loss, (sums[0] + sums[1]) / 34)
    assert not math.isclose(loss.item(), (sums[0] / 2 + sums[1] / 32).item() / 2, rel_tol=1e-3)


def test_a_shard_or_a_batch_without_labels_gives_no_nan():
    module = perturbed(2, virtual_ranks=2)
    batch = parity_batch(4, 8, seed=2)
    batch["labels"][:2] = IGNORE_INDEX  # the first shard has no target
    loss, got = loss_and_grads(module, batch, [2, 1])
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in got.values())
    batch["labels"][:] = IGNORE_INDEX  # the whole batch has none: loss 0, gradient 0
    loss, got = loss_and_grads(module, batch, [2, 1])
    assert loss.item() == 0.0 and all(torch.count_nonzero(g) == 0 for g in got.values())


def test_next_token_labels_mask_what_is_not_learned():
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    learn = torch.tensor([[False, False, True, True, False]])
    assert next_token_labels(ids, learn).tolist() == [[IGNORE_INDEX, 7, 8, IGNORE_INDEX, IGNORE_INDEX]]


@pytest.mark.parametrize("backprop", [{"activation_checkpointing": "loop"}, {"activation_checkpointing": "layer"}])
def test_activation_checkpointing_gives_the_same_labelled_gradient(backprop):
    batch = parity_batch(4, 16, seed=3)
    batch["labels"][:, :5] = IGNORE_INDEX
    eager = loss_and_grads(perturbed(3, virtual_ranks=2), batch, [3, 2])
    checkpointed = loss_and_grads(perturbed(3, virtual_ranks=2, **backprop), batch, [3, 2])
    torch.testing.assert_close(eager[0], checkpointed[0])
    assert_same_grads(eager[1], checkpointed[1], rtol=1e-5, atol=1e-7)


def test_backprop_loops_truncates_a_labelled_batch_like_a_window_batch():
    """Truncated backprop through the last loop: the same gradient in either batch form."""
    windows = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(4))
    labelled = {"input_ids": windows[:, :-1], "labels": windows[:, 1:]}
    module = perturbed(4, backprop_loops=1)
    plain = loss_and_grads(module, windows, [3])
    assert_same_grads(plain[1], loss_and_grads(module, labelled, [3])[1], rtol=0, atol=0)
    full = loss_and_grads(perturbed(4), labelled, [3])
    assert any(not torch.equal(plain[1][name], full[1][name]) for name in plain[1])


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["compile_layers", "compile_model"])
def test_compiled_models_train_labelled_batches_like_eager(flag, monkeypatch):
    """``torch.compile`` of the layers or of the whole looped forward: the same labelled loss and gradient."""
    compile_, compiled_calls = torch.compile, []

    def compile_without_codegen(*args: Any, **kwargs: Any) -> Any:  # tracing: seconds, not minutes of C++ builds
        compiled_calls.append(args)
        return compile_(*args, **{**kwargs, "backend": "aot_eager_decomp_partition"})

    monkeypatch.setattr(torch, "compile", compile_without_codegen)
    batch = parity_batch(4, 16, seed=8)
    batch["labels"][:2, :12] = IGNORE_INDEX
    eager = perturbed(8, virtual_ranks=2)
    compiled = perturbed(8, virtual_ranks=2, **{flag: True})
    compiled.configure_model()
    assert compiled_calls
    for loops in ([1, 3], [2, 2]):
        want, got = loss_and_grads(eager, batch, loops), loss_and_grads(compiled, batch, loops)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
        assert_same_grads(got[1], want[1], rtol=1e-4, atol=1e-6)


# ---- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "batch, message",
    [
        ({"input_ids": torch.zeros(2, 8, dtype=torch.long)}, r"needs the keys 'input_ids' and 'labels'; it lacks \['labels'\]"),
        ({"input_ids": torch.zeros(2, 8, dtype=torch.long), "labels": torch.zeros(2, 7, dtype=torch.long)},
         r"batch\['input_ids'\] has shape \[2, 8\] and batch\['labels'\] \[2, 7\]; labels are position-aligned"),
        ({"input_ids": torch.zeros(2, 8, dtype=torch.long), "labels": torch.zeros(2, 8)},
         r"batch\['labels'\] must be an integer tensor \[B, T\]; got shape \[2, 8\], dtype torch.float32"),
        ({"input_ids": torch.zeros(8, dtype=torch.long), "labels": torch.zeros(8, dtype=torch.long)},
         r"batch\['input_ids'\] must be an integer tensor \[B, T\]"),
        ({"input_ids": torch.zeros(2, 8, dtype=torch.long), "labels": torch.zeros(2, 8, dtype=torch.long),
          "attention_mask": torch.ones(2, 8)}, r"batch\['attention_mask'\] is not supported"),
        ([torch.zeros(2, 8, dtype=torch.long)], "a batch is a LongTensor"),
    ],
    ids=["missing", "shapes", "float", "1-d", "attention_mask", "list"],
)
def test_malformed_labelled_batches_are_refused_naming_the_keys(batch, message):
    module = ELRModule(arch=tiny_config())
    with pytest.raises(ValueError, match=message):
        module.shard_loss(batch, [1])


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("labels", 64, r"batch\['labels'\]\[1, 3\] = 64 is outside arch.vocab_size=64; give ids in \[0, 64\) or -100"),
        ("labels", -1, r"batch\['labels'\]\[1, 3\] = -1 is outside"),
        ("input_ids", 99, r"batch\['input_ids'\]\[1, 3\] = 99 is outside arch.vocab_size=64; give ids in \[0, 64\),"),
    ],
)
def test_ids_outside_the_vocabulary_are_refused_on_the_host(key, value, message):
    module = ELRModule(arch=tiny_config())
    batch = parity_batch(2, 8, seed=5)
    batch["labels"][0, :4] = IGNORE_INDEX  # ignored labels are fine
    module.transfer_batch_to_device(batch, torch.device("cpu"), 0)
    batch[key][1, 3] = value
    with pytest.raises(ValueError, match=message) as err:
        module.transfer_batch_to_device(batch, torch.device("cpu"), 0)
    assert "\n" not in str(err.value)


# ---- training, validation and prediction through a Trainer --------------------------------------


class ParityData(pl.LightningDataModule):
    """Prefix parity of random bits, the target at every position but the first ``skip``: labelled batches
    from a resumable :class:`StepIndexedLoader`; validation of fixed sequences."""

    def __init__(self, batch_size: int = 4, length: int = 16, skip: int = 3, seed: int = 0) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.seq_len = length
        train, val = parity_batch(64, length, seed), parity_batch(8, length, seed + 1)
        for part in (train, val):
            part["labels"][:, :skip] = IGNORE_INDEX
        self.train = LabelledExamples(train["input_ids"], train["labels"])
        self.val = LabelledExamples(val["input_ids"], val["labels"])
        self.seed = seed

    def train_dataloader(self) -> StepIndexedLoader:
        return StepIndexedLoader(self.train, self.batch_size, seed=self.seed)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.val, batch_size=self.batch_size)

    def predict_dataloader(self) -> torch.utils.data.DataLoader:
        return self.val_dataloader()


def trainer(steps: int = 3, **kwargs: Any) -> pl.Trainer:
    args = dict(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                limit_val_batches=0, log_every_n_steps=1)  # fmt: skip
    return pl.Trainer(**{**args, **kwargs})


@pytest.mark.parametrize(
    "sampler",
    [FixedLoops(2), OneLoopOverride(4, 0.5), UniformLoops(4), IndependentRank(4)],
    ids=["fixed", "override", "uniform", "independent"],
)
def test_fit_trains_on_labelled_batches_at_any_sampler(sampler):
    pl.seed_everything(0)
    module = ELRModule(arch=tiny_config(), sampler=sampler, virtual_ranks=2, warmup_steps=1, lr=1e-2)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    run = trainer(callbacks=[ComputeAccounting()])
    run.fit(module, datamodule=ParityData())
    assert math.isfinite(run.callback_metrics["train/loss"])
    assert run.callback_metrics["train/flops"] > 0
    assert any(not torch.equal(p, before[n]) for n, p in module.named_parameters())


def test_the_delayed_switch_trains_labelled_batches():
    pl.seed_everything(0)
    module = ELRModule(arch=tiny_config(max_loops=3), sampler=OneLoopOverride(3, 0.5), virtual_ranks=2,
                       conditioner=LoopConditioner(d_cond=8, rank=2), warmup_steps=1, lr=1e-2)  # fmt: skip
    run = trainer(steps=4, callbacks=[DelayedMixedDepth(switch_step=2), ZeroInitConditioning()])
    loops = []
    run.fit(module, datamodule=ParityData())
    for step in range(4):
        loops.append(module.local_loops(step))
    assert loops[:2] == [[1, 1], [1, 1]] and any(k > 1 for ks in loops[2:] for k in ks)
    assert module.model.conditioner.active and math.isfinite(run.callback_metrics["train/loss"])


def test_validation_and_prediction_count_labelled_targets_only():
    module = perturbed(6, val_loops=[1, 3])
    data = ParityData(skip=5)
    run = trainer(limit_val_batches=None)
    metrics = run.validate(module, datamodule=data, verbose=False)[0]
    ids, labels = data.val.input_ids, data.val.labels
    mask = labels != IGNORE_INDEX
    predictions = run.predict(module, datamodule=data)
    with torch.no_grad():
        for k in (1, 3):
            nll = F.cross_entropy(module(ids, k).transpose(1, 2), labels, reduction="none")
            assert metrics[f"val/loss_k{k}"] == pytest.approx(nll.sum().item() / mask.sum().item(), rel=1e-5)
            # the default token_bytes count one byte per token: bits per labelled target
            assert metrics[f"val/bpb_k{k}"] == pytest.approx(metrics[f"val/loss_k{k}"] / math.log(2), rel=1e-5)
            per_row = torch.cat([p[k] for p in predictions])
            torch.testing.assert_close(per_row, nll.sum(1) / mask.sum(1), rtol=1e-5, atol=1e-6)


def test_targets_without_bytes_log_no_bits_per_byte():
    """A data module whose targets are not text (``token_bytes`` all zero) gets loss per k and no bpb."""
    data = ParityData()
    data.token_bytes = torch.zeros(4, dtype=torch.long)
    metrics = trainer(limit_val_batches=None).validate(perturbed(9, val_loops=[1, 2]), datamodule=data, verbose=False)[0]
    assert set(metrics) == {"val/loss_k1", "val/loss_k2"}


def test_validation_of_a_batch_without_labels_is_not_nan():
    module = perturbed(7, val_loops=[1, 2])
    data = ParityData()
    data.val.labels[:4] = IGNORE_INDEX  # the first validation batch has no target
    metrics = trainer(limit_val_batches=None).validate(module, datamodule=data, verbose=False)[0]
    assert all(math.isfinite(v) for v in metrics.values())
    data.val.labels[4:] = IGNORE_INDEX
    nothing = trainer(limit_val_batches=None).validate(module, datamodule=data, verbose=False)[0]
    assert set(nothing) == set(metrics)


def test_fit_refuses_a_label_outside_the_vocabulary_in_one_line():
    data = ParityData()
    data.train.labels[5, 7] = 70
    module = ELRModule(arch=tiny_config(), sampler=FixedLoops(1))
    with pytest.raises(ValueError, match=r"batch\['labels'\]\[\d+, 7\] = 70 is outside arch.vocab_size=64"):
        trainer(steps=20).fit(module, datamodule=data)


def test_token_batch_reads_both_forms():
    windows = torch.arange(10).reshape(2, 5)
    plain = TokenBatch.of(windows)
    assert not plain.masked and plain.labelled_tokens() == 8 and plain.labelled_per_row() == 4
    assert torch.equal(plain.inputs, windows[:, :-1]) and torch.equal(plain.labels, windows[:, 1:])
    labelled = TokenBatch.of({"input_ids": windows[:, :4], "labels": torch.tensor([[1, -100, 2, -100], [-100] * 4])})
    assert labelled.masked and labelled.labelled_tokens().item() == 2
    assert labelled.labelled_per_row().tolist() == [2, 1]
    first, second = labelled.shards(2)
    assert torch.equal(second.labels, labelled.labels[1:]) and torch.equal(first.inputs, windows[:1, :4])
