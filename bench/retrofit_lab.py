"""The retrofit lab's stand-in model and its non-recurrent arm (docs/lab-retrofit.md).

No pretrained weights can be downloaded here, so the "downloaded model" is a small
``transformers`` ``LlamaForCausalLM`` pretrained by this script on a corpus that is not the
library's default one: Python's reference documentation (the English prose of
``pydoc_data.topics``) plus the standard library's ``.txt`` / ``.rst`` / ``.html`` files, tokenised
with a byte-level BPE trained on it. The windows, split and order are those of
:class:`~elr_lightning.data.TextDataModule`, so ``elr fit`` arms see the same data.

    python bench/retrofit_lab.py corpus   --out DIR               # DIR/corpus/*.txt, DIR/tokenizer.json
    python bench/retrofit_lab.py pretrain --out DIR --steps 320 --warmup 30   # DIR/standin (a Hugging Face folder)
    python bench/retrofit_lab.py flat     --out DIR --steps 150 --lr 3e-4 --warmup 8   # arm (a)
    elr retrofit --hf DIR/standin --out DIR/retrofit --max_loops 3
    python bench/retrofit_lab.py arm      --out DIR --name b --steps 114 --lr 3e-4     # arm (b): DIR/b.yaml
    python bench/retrofit_lab.py arm      --out DIR --name b0 --steps 106 --lr 3e-4 --switch 0
    python bench/retrofit_lab.py arm      --out DIR --name c --steps 114 --scratch --lr 3e-3   # arm (c)
    elr fit --config DIR/b.yaml; elr fit --config DIR/b0.yaml; elr fit --config DIR/c.yaml
    python bench/retrofit_lab.py table    --out DIR
    python bench/retrofit_lab.py probe    --out DIR --ckpt DIR/retrofit/retrofit.ckpt   # loss at k = 1..3

``pretrain`` and ``flat`` write ``DIR/<command>_s<seed>_lr<lr>.json``; the ``elr fit`` arms log ``val/loss_k{k}`` to
``DIR/logs/<name>``. Equal compute: an ELR step costs ``(1 - rho) + rho D_eff(k_bar) / D_eff(1)``
flat steps (eq. 5), rho the mixed share of steps and k_bar the sampler's mean k (eq. 3).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sysconfig
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from elr_lightning.data import TextDataModule

VOCAB = 2048
SEQ, BATCH = 128, 8


def corpus(out: Path) -> None:
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = out / "corpus"
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in sorted(topics.items()):
        (folder / f"topic_{name}.txt").write_text(text, encoding="utf-8")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for i, path in enumerate(sorted(p for ext in ("txt", "rst", "html") for p in stdlib.rglob(f"*.{ext}"))):
        if "site-packages" not in path.parts:
            (folder / f"doc_{i:05d}.txt").write_text(path.read_text(encoding="utf-8", errors="replace"), encoding="utf-8")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train([str(p) for p in sorted(folder.iterdir())], trainer)
    tok.save(str(out / "tokenizer.json"))
    print(f"{len(list(folder.iterdir()))} files, {sum(p.stat().st_size for p in folder.iterdir())} bytes")


def datamodule(out: Path) -> TextDataModule:
    dm = TextDataModule(
        sources=str(out / "corpus"), tokenizer=str(out / "tokenizer.json"), seq_len=SEQ, batch_size=BATCH,
        val_fraction=0.05, cache_dir=str(out / "cache"), val_batches=16,
    )
    dm.prepare_data()
    dm.setup("fit")
    return dm


@torch.no_grad()
def val_loss(model: torch.nn.Module, dm: TextDataModule) -> float:
    model.eval()
    total, n = 0.0, 0
    for batch in dm.val_dataloader():
        logits = model(batch[:, :-1]).logits
        total += F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum").item()
        n += batch[:, 1:].numel()
    model.train()
    return total / n


def train(model: torch.nn.Module, dm: TextDataModule, steps: int, lr: float, warmup: int, skip: int) -> list[float]:
    """AdamW, linear warm-up then cosine to 0.1 lr; batches ``skip..skip+steps`` of the step-indexed loader."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warmup if s < warmup else 0.1 + 0.45 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup)))
    )
    def batches():
        while True:  # epochs in the data module's order, as Lightning runs them
            yield from dm.train_dataloader()

    loader = batches()
    for _ in range(skip):
        next(loader)
    losses = []
    for step in range(steps):
        batch = next(loader)
        loss = F.cross_entropy(model(batch[:, :-1]).logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(), sched.step(), opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 100 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    return losses


def arm(out: Path, name: str, steps: int, scratch: bool, lr: float, seed: int, switch: Optional[float]) -> None:
    """``DIR/<name>.yaml``: the retrofit's YAML on the lab's data, for ``steps``, from scratch without ``init_from``."""
    import yaml

    fit = yaml.safe_load((out / "retrofit" / "retrofit.yaml").read_text())
    fit["seed_everything"] = seed
    fit["trainer"].update(
        accelerator="cpu", devices=1, precision=32, max_steps=steps, val_check_interval=steps, enable_progress_bar=False,
        num_sanity_val_steps=0, default_root_dir=str(out / "runs" / name),
        logger={"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(out / "logs"), "name": name}},
    )
    callbacks = fit["trainer"]["callbacks"]
    callbacks[0]["init_args"]["dirpath"] = str(out / "runs" / name)
    if scratch:
        callbacks[1]["init_args"].pop("init_from")
    if switch is not None:
        callbacks[1]["init_args"]["switch_fraction"] = switch
    fit["model"]["init_args"]["lr"] = lr
    fit["data"]["init_args"].update(
        sources=str(out / "corpus"), tokenizer=str(out / "tokenizer.json"), seq_len=SEQ, batch_size=BATCH,
        val_fraction=0.05, cache_dir=str(out / "cache"), val_batches=16,
    )
    (out / f"{name}.yaml").write_text(yaml.safe_dump(fit, sort_keys=False))


@torch.no_grad()
def probe(out: Path, ckpt: str, loops: int) -> None:
    """Validation loss of an ELR checkpoint at k = 1..``loops`` (e.g. the retrofit before any training)."""
    from elr_lightning.inference.generate import load_model

    model, _ = load_model(ckpt)
    dm = datamodule(out)
    losses = {}
    for k in range(1, loops + 1):
        total, n = 0.0, 0
        for batch in dm.val_dataloader():
            logits = model(batch[:, :-1], loops=k)
            total += F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").item()
            n += batch[:, 1:].numel()
        losses[k] = total / n
    print(json.dumps({"ckpt": ckpt, "val_loss": losses}))


def table(out: Path) -> None:
    """Validation loss per k of every arm, k = 1 tax against (a) and the loop gain k = 1 -> K."""
    import csv

    rows = {}
    for path in sorted(out.glob("flat_s*.json")):
        rows[path.stem] = {1: json.loads(path.read_text())["val_loss"]}
    for folder in sorted((out / "logs").glob("*")):
        metrics = sorted(folder.glob("version_*/metrics.csv"))[-1]
        last: dict[int, float] = {}
        for row in csv.DictReader(metrics.open()):
            for key, value in row.items():
                if key.startswith("val/loss_k") and value:
                    last[int(key.removeprefix("val/loss_k"))] = float(value)
        rows[folder.name] = last
    flat = next((v[1] for k, v in rows.items() if k.startswith("flat")), None)
    for name, losses in rows.items():
        ks = sorted(losses)
        line = " ".join(f"k={k}: {losses[k]:.4f}" for k in ks)
        if flat is not None:
            line += f" | k=1 vs (a): {100 * (losses[1] / flat - 1):+.2f}%"
        if len(ks) > 1:
            line += f" | k=1 -> k={ks[-1]}: {100 * (1 - losses[ks[-1]] / losses[1]):+.2f}% lower"
        print(f"{name}: {line}")
    (out / "table.json").write_text(json.dumps(rows, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=("corpus", "pretrain", "flat", "arm", "table", "probe"))
    parser.add_argument("--ckpt", default="", help="probe: the checkpoint")
    parser.add_argument("--name", default="b")
    parser.add_argument("--scratch", action="store_true")
    parser.add_argument("--switch", type=float, default=None, help="arm: the switch fraction (default: the YAML's)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    torch.manual_seed(args.seed)
    if args.command in ("corpus", "arm", "table"):
        if args.command == "corpus":
            corpus(args.out)
        elif args.command == "arm":
            arm(args.out, args.name, args.steps, args.scratch, args.lr, args.seed, args.switch)
        else:
            table(args.out)
        return
    from transformers import LlamaConfig, LlamaForCausalLM

    if args.command == "probe":
        probe(args.out, args.ckpt, 3)
        return
    dm = datamodule(args.out)
    start = time.time()
    if args.command == "pretrain":
        config = LlamaConfig(
            vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=SEQ * 2, rms_norm_eps=1e-5, tie_word_embeddings=True,
            eos_token_id=0, bos_token_id=0,
        )
        model = LlamaForCausalLM(config)
        losses = train(model, dm, args.steps, args.lr, args.warmup, skip=0)
        model.save_pretrained(str(args.out / "standin"))
        (args.out / "standin" / "tokenizer.json").write_bytes((args.out / "tokenizer.json").read_bytes())
    else:
        model = LlamaForCausalLM.from_pretrained(str(args.out / "standin"), dtype=torch.float32)
        before = val_loss(model, dm)
        losses = train(model, dm, args.steps, args.lr, args.warmup, skip=0)
        print(f"val before {before:.4f}")
    result = {
        "command": args.command, "steps": args.steps, "lr": args.lr, "seed": args.seed, "val_loss": val_loss(model, dm),
        "train_loss_last50": sum(losses[-50:]) / 50, "seconds": time.time() - start,
    }
    (args.out / f"{args.command}_s{args.seed}_lr{args.lr:g}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
