"""``PromptCompletionDataModule``: the prompt takes no part in the loss, lengths, the split, errors, resume, ``elr fit``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from _bpe import train_bpe
from conftest import REPO_ROOT, quiet_trainer, tiny_config
from elr_lightning import IGNORE_INDEX
from elr_lightning.cli import run
from elr_lightning.conditioning import LoopConditioner
from elr_lightning.data import PromptCompletionDataModule
from elr_lightning.module import ELRModule
from elr_lightning.sampling import OneLoopOverride

ROOT = REPO_ROOT
EXAMPLE = ROOT / "config" / "finetune_example.yaml"
NEWLINE = 10  # the byte tokenizer's end mark


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return path


def pairs(count: int = 40) -> list[dict[str, str]]:
    return [{"prompt": f"q{i}: {'x' * (i % 7)}?", "completion": f"a{i * 3}"} for i in range(count)]


def data(path: Path, **kwargs: Any) -> PromptCompletionDataModule:
    module = PromptCompletionDataModule(path=str(path), **{"seq_len": 24, "batch_size": 4, **kwargs})
    module.setup("fit")
    return module


# ---- the batches -----------------------------------------------------------------------------------


def test_completion_and_end_mark_are_the_only_targets(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "ab", "completion": "xyz"}])
    module = data(path, val_fraction=0.0, seq_len=8, batch_size=1)
    batch = module.train_examples.batch([0])
    assert batch["input_ids"].tolist() == [[*b"abxyz", NEWLINE, 0, 0]]  # prompt, completion, end mark, padding
    assert batch["labels"].tolist() == [[IGNORE_INDEX, *b"xyz", NEWLINE, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]]
    item = module.train_examples[0]
    assert torch.equal(item["labels"], batch["labels"][0])


def test_prompt_tokens_contribute_zero_loss_and_zero_gradient(tmp_path):
    """The loss is the mean over completion targets alone; its gradient reaches no logit of a prompt position,
    and changing what the prompt positions would predict (their next tokens) changes neither loss nor gradient."""
    records = [{"prompt": "translate: " + "ab" * (i + 1), "completion": "XY" * (i + 2)} for i in range(4)]
    module = data(write_jsonl(tmp_path / "train.jsonl", records), val_fraction=0.0, seq_len=32)
    batch = module.train_examples.batch(range(4))
    torch.manual_seed(0)
    model = ELRModule(arch=tiny_config(vocab_size=256), conditioner=LoopConditioner(d_cond=8, rank=2), virtual_ranks=2)
    logits_seen: list[torch.Tensor] = []

    def keep(mod: Any, args: Any, out: torch.Tensor) -> None:
        out.retain_grad()
        logits_seen.append(out)

    model.model.register_forward_hook(keep)
    loss = model.shard_loss(batch, [1, 2])
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    logit_grad = torch.cat([t.grad for t in logits_seen])
    # Prompt positions (the targets of which lie in the prompt), recomputed from the raw text.
    for row, record in enumerate(records):
        p, c = len(record["prompt"]), len(record["completion"]) + 1
        assert torch.count_nonzero(logit_grad[row, : p - 1]) == 0  # predicting prompt tokens: no gradient
        assert torch.count_nonzero(logit_grad[row, p + c - 1 :]) == 0  # after the end mark: padding
        assert (logit_grad[row, p - 1 : p + c - 1].abs().sum(-1) > 0).all()  # every completion target: gradient
    # The mean of the completion targets' cross-entropy, and nothing else.
    with torch.no_grad():
        logits = torch.cat(logits_seen).detach()
        ids = batch["input_ids"]
        total = 0.0
        count = 0
        for row, record in enumerate(records):
            p, c = len(record["prompt"]), len(record["completion"]) + 1
            targets = torch.tensor([*record["completion"].encode(), NEWLINE])
            total += F.cross_entropy(logits[row, p - 1 : p + c - 1], targets, reduction="sum").item()
            count += c
            assert torch.equal(ids[row, p : p + c], targets)
    assert loss.item() == pytest.approx(total / count, rel=1e-5)
    # The check can fail: with the prompt's next tokens as targets too, prompt logits do get gradient.
    unmasked = batch["labels"].clone()
    unmasked[:, :-1] = torch.where(unmasked[:, :-1] == IGNORE_INDEX, ids[:, 1:], unmasked[:, :-1])
    logits_seen.clear()
    model.zero_grad(set_to_none=True)
    model.shard_loss({"input_ids": ids, "labels": unmasked}, [1, 2]).backward()
    assert torch.count_nonzero(torch.cat([t.grad for t in logits_seen])[0, : len(records[0]["prompt"]) - 1]) > 0
    assert any(not torch.equal(grads[n], p.grad) for n, p in model.named_parameters() if p.grad is not None)


def test_longer_prompts_are_cut_from_the_left(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "0123456789", "completion": "ab"}, {"prompt": "p", "completion": "c"}])
    module = data(path, val_fraction=0.0, seq_len=6, batch_size=1)
    batch = module.train_examples.batch([0])
    assert batch["input_ids"].tolist() == [[*b"6789ab"]]  # 4 prompt tokens kept, then "ab" and the end mark
    assert batch["labels"].tolist() == [[IGNORE_INDEX] * 3 + [*b"ab", NEWLINE]]


def test_completions_that_do_not_fit_are_refused_with_a_count(tmp_path):
    records = [{"prompt": "p", "completion": "c"}, {"prompt": "p", "completion": "c" * 9}, {"prompt": "q", "completion": "d" * 12}]
    path = write_jsonl(tmp_path / "train.jsonl", records)
    with pytest.raises(ValueError, match=r"data\.path: 2 of 3 examples .* have a completion that alone does not fit "
                                         r"seq_len \+ 1 = 7 tokens \(the first at line 2\); raise data\.seq_len"):
        data(path, val_fraction=0.0, seq_len=6)
    with pytest.raises(ValueError, match=r"2 of 3 examples .* are longer than seq_len \+ 1 = 7 .* set data\.truncate_prompt: true"):
        data(path, val_fraction=0.0, seq_len=6, truncate_prompt=False)


def test_an_hf_tokenizer_ends_completions_with_its_eos_and_pads_with_it(tmp_path):
    tokenizer = train_bpe(tmp_path / "tokenizer.json")
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "def f(x):", "completion": " return x"}])
    module = data(path, val_fraction=0.0, tokenizer=str(tokenizer), seq_len=16, batch_size=1)
    eos = module.tokenizer.eos_id
    prompt, completion = module.tokenizer.encode("def f(x):"), module.tokenizer.encode(" return x")
    batch = module.train_examples.batch([0])
    n = len(prompt) + len(completion)
    assert batch["input_ids"][0, : n + 1].tolist() == prompt + completion + [eos]
    assert (batch["input_ids"][0, n:] == eos).all()
    assert batch["labels"][0, len(prompt) - 1 : n].tolist() == completion + [eos]
    assert (batch["labels"][0, : len(prompt) - 1] == IGNORE_INDEX).all() and (batch["labels"][0, n:] == IGNORE_INDEX).all()


# ---- the split -----------------------------------------------------------------------------------


def test_validation_is_held_out_by_hash_and_a_file_replaces_it(tmp_path):
    records = pairs(200)
    module = data(write_jsonl(tmp_path / "train.jsonl", records + records[:20]), val_fraction=0.2)
    train, val = len(module.train_examples), len(module.val_examples)
    assert train + val == 220 and 20 <= val <= 70
    again = data(write_jsonl(tmp_path / "shuffled.jsonl", list(reversed(records + records[:20]))), val_fraction=0.2)
    assert len(again.val_examples) == val  # the split depends on the text, not the order
    separate = data(tmp_path / "train.jsonl", validation=str(write_jsonl(tmp_path / "val.jsonl", pairs(3))))
    assert (len(separate.train_examples), len(separate.val_examples)) == (220, 3)


def test_no_held_out_example_is_refused_when_validation_runs(tmp_path):
    module = data(write_jsonl(tmp_path / "train.jsonl", pairs(8)), val_fraction=0.0)
    module.trainer = pl.Trainer(logger=False, enable_checkpointing=False)
    with pytest.raises(ValueError, match=r"data\.val_fraction=0\.0 holds out none of the examples.*limit_val_batches: 0"):
        module.val_dataloader()


# ---- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lines, message",
    [
        ([], r"data\.path: '.*train\.jsonl' holds no example"),
        (["", "  "], r"holds no example"),
        ([{"prompt": "a", "completion": "b"}, {"prompt": "a", "answer": "b"}],
         r"data\.completion_field: record at .*train\.jsonl:2 has no 'completion' field \(found \['answer', 'prompt'\]\)"),
        ([{"question": "a", "completion": "b"}], r"data\.prompt_field: record at .*train\.jsonl:1 has no 'prompt' field"),
        ([{"prompt": "a", "completion": "b"}, "{not json"], r"data\.path: .*train\.jsonl:2 is not valid JSON"),
        ([{"prompt": "a", "completion": 3}], r"data\.completion_field: 'completion' at .*train\.jsonl:1 is a int, not a string"),
    ],
    ids=["empty", "blank", "missing-completion", "missing-prompt", "bad-json", "not-a-string"],
)
def test_bad_files_are_refused_naming_file_line_and_field(tmp_path, lines, message):
    path = write_jsonl(tmp_path / "train.jsonl", lines)
    with pytest.raises(ValueError, match=message) as err:
        data(path)
    assert "\n" not in str(err.value)


def test_a_missing_file_is_refused_naming_the_option(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data\.path: '.*nope\.jsonl' does not exist"):
        data(tmp_path / "nope.jsonl")
    train = write_jsonl(tmp_path / "train.jsonl", pairs(4))
    with pytest.raises(FileNotFoundError, match=r"data\.validation: '.*gone\.jsonl' does not exist"):
        data(train, validation=str(tmp_path / "gone.jsonl"))


def test_custom_field_names(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [{"q": "hi", "a": "yo"}])
    module = data(path, val_fraction=0.0, prompt_field="q", completion_field="a", seq_len=6, batch_size=1)
    assert module.train_examples.batch([0])["input_ids"].tolist() == [[*b"hiyo", NEWLINE, 0]]


# ---- training: exact resume, and elr fit from YAML ---------------------------------------------------


def finetune_module() -> ELRModule:
    pl.seed_everything(0)
    return ELRModule(arch=tiny_config(vocab_size=256), sampler=OneLoopOverride(4, 0.5), virtual_ranks=2,
                     conditioner=LoopConditioner(d_cond=8, rank=2), warmup_steps=1, lr=1e-2)  # fmt: skip


def fit(path: Path, root: Path, steps: int, ckpt_path: Any = None, stop: int = 0) -> tuple[ELRModule, list[float]]:
    """Fit ``steps`` steps (or end after step ``stop``, as a kill would, the planned length unchanged)."""
    losses: list[float] = []

    class Losses(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))
            trainer.should_stop = trainer.global_step == stop

    module = finetune_module()
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=root, save_last=True, every_n_train_steps=1)
    trainer = quiet_trainer(
        max_steps=steps, limit_val_batches=0, default_root_dir=root, callbacks=[Losses(), checkpoint], enable_checkpointing=True
    )
    trainer.fit(module, datamodule=PromptCompletionDataModule(str(path), seq_len=24, batch_size=4, seed=5),
                ckpt_path=ckpt_path, weights_only=True)  # fmt: skip
    return module, losses


def test_a_resumed_fine_tune_replays_exactly(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", pairs(40))  # about 9 batches: the run crosses an epoch
    straight, straight_losses = fit(path, tmp_path / "straight", steps=12)
    fit(path, tmp_path / "stopped", steps=12, stop=5)
    resumed, resumed_losses = fit(path, tmp_path / "resumed", steps=12, ckpt_path=tmp_path / "stopped" / "last.ckpt")
    assert resumed_losses == straight_losses[5:]
    a, b = straight.state_dict(), resumed.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


#: The example config's model cut to test size.
TINY = ["--model.init_args.arch.d_model", "32", "--model.init_args.arch.n_heads", "2",
        "--model.init_args.conditioner.init_args.d_cond", "8", "--model.init_args.conditioner.init_args.rank", "2"]  # fmt: skip


@pytest.mark.slow
def test_elr_fit_fine_tunes_from_the_shipped_yaml_and_from_a_checkpoint(tmp_path, monkeypatch, caplog):
    """The example config through the CLI on a tiny JSONL: it trains, validates at every k and saves; then
    the README's command fine-tunes that checkpoint's weights (DelayedMixedDepth(init_from=...))."""
    monkeypatch.chdir(tmp_path)
    path = write_jsonl(tmp_path / "pairs.jsonl", pairs(60))
    common = ["--config", str(EXAMPLE), "--data.path", str(path), "--data.val_fraction", "0.2", "--data.batch_size", "4",
              "--trainer.max_steps", "4", "--trainer.val_check_interval", "4", *TINY]  # fmt: skip
    run(["fit", *common])
    version = tmp_path / "runs" / "finetune" / "version_0"
    ckpt = version / "checkpoints" / "last.ckpt"
    saved = torch.load(ckpt, weights_only=True)
    assert saved["global_step"] == 4 and saved["hyper_parameters"]["arch"]["d_model"] == 32
    events = EventAccumulator(str(next(version.glob("events*"))))
    events.Reload()
    for k in (1, 2, 3):
        values = [e.value for e in events.Scalars(f"val/loss_k{k}")]
        assert len(values) == 1 and math.isfinite(values[0]) and 0 < values[0] < 7
    caplog.set_level("INFO")
    run(["fit", *common, "--trainer.callbacks+=elr_lightning.callbacks.DelayedMixedDepth",
         "--trainer.callbacks.init_from", str(ckpt), "--trainer.callbacks.switch_fraction", "0",
         "--trainer.callbacks+=elr_lightning.callbacks.ZeroInitConditioning"])  # fmt: skip
    assert f"DelayedMixedDepth: loaded {ckpt}; newly initialised: none" in caplog.text
    continued = torch.load(tmp_path / "runs" / "finetune" / "version_1" / "checkpoints" / "last.ckpt", weights_only=True)
    assert continued["global_step"] == 4
    assert not torch.equal(continued["state_dict"]["model.embed.weight"], saved["state_dict"]["model.embed.weight"])
