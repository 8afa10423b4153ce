"""Evaluation-harness throughput: requests/s of the ``elr`` adapter at k = 1 and k = 4 against the
harness's own HF adapter (``HFLM``) on an equivalent plain model, all in this one run.

The plain model is a ``transformers`` Llama of the same width, heads, SwiGLU width, vocabulary and
depth as the looped model at k = 1 (``D_eff(1) = L_in + L_rec + L_out`` layers), untrained like it
(speed does not depend on the weights), both in fp32 on the CPU. Both adapters see the same
requests: the ``loglikelihood`` requests of the local ``elr_line_end`` task (four per document) and
the ``generate_until`` requests of ``elr_complete_line``, with a byte-level tokenizer on both sides.
The ``_fold`` variants fold the loop conditioning into the weights
for their k first (``fold=True``). Each adapter runs the request list after a warm-up; the median over ``--repeats`` runs is reported,
variants measured round-robin. The ratios are ELR over HF, from the same run.

Needs the ``eval`` and ``hf`` extras (``lm-eval``, ``transformers``).

    python bench/eval.py [--docs 100] [--repeats 3] [--threads 2] [--out bench/results/eval.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import LM

from elr_lightning.conditioning import LoopConditioner
from elr_lightning.config import ModelConfig
from elr_lightning.eval import ELRLM
from elr_lightning.eval.taskdata import load_task
from elr_lightning.model import LoopedLM
from elr_lightning.tokenizers import ByteTokenizer, _byte_level_alphabet

CONFIG = ModelConfig(vocab_size=256, d_model=256, n_heads=8, n_in=2, n_rec=4, n_out=2, max_seq_len=512, max_loops=4)
BATCH = 16


def hf_adapter(config: ModelConfig) -> LM:
    """``HFLM`` over a Llama of the looped model's shape at k = 1, with a byte-level tokenizer."""
    import tokenizers
    from lm_eval.models.huggingface import HFLM
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {char: byte for char, byte in _byte_level_alphabet().items()}
    vocab["<|endoftext|>"] = 256
    core = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = tokenizers.decoders.ByteLevel()
    core.add_special_tokens(["<|endoftext|>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    llama = LlamaConfig(
        vocab_size=257,
        hidden_size=config.d_model,
        intermediate_size=config.ff_dim,
        num_hidden_layers=config.effective_depth(1),
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.kv_heads,
        max_position_embeddings=config.max_seq_len,
        rms_norm_eps=config.norm_eps,
        rope_theta=config.rope_base,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama).eval()
    return HFLM(pretrained=model, tokenizer=tokenizer, batch_size=BATCH, device="cpu", max_length=config.max_seq_len)


def requests(docs: int, data_dir: str) -> dict[str, list[Instance]]:
    """The local tasks' requests: four ``loglikelihood`` per ``line_end`` doc, one ``generate_until`` per ``complete_line`` doc."""
    line_end = load_task("line_end", data_dir=data_dir)["test"].select(range(docs))
    complete = load_task("complete_line", data_dir=data_dir)["test"].select(range(docs // 2))
    ll = [
        Instance("loglikelihood", doc, (doc["context"], choice), i)
        for i, doc in enumerate(line_end)
        for choice in doc["choices"]
    ]
    gen_kwargs = {"until": ["\n"], "max_gen_toks": 24, "do_sample": False}
    gen = [Instance("generate_until", doc, (doc["context"], dict(gen_kwargs)), i) for i, doc in enumerate(complete)]
    return {"loglikelihood": ll, "generate_until": gen}


def measure(variants: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds per variant, after one warm-up each, round-robin."""
    for run in variants.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    """Measure, print the table and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--docs", type=int, default=100, help="line_end documents (x4 loglikelihood requests).")
    parser.add_argument("--repeats", type=int, default=3, help="Timed runs per variant (median reported).")
    parser.add_argument("--threads", type=int, default=2, help="torch threads.")
    parser.add_argument("--data_dir", default=None, help="Local task data (built there if missing).")
    parser.add_argument("--out", default="bench/results/eval.json", help="JSON output path.")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    reqs = requests(args.docs, args.data_dir)
    torch.manual_seed(0)
    looped = LoopedLM(CONFIG, conditioner=LoopConditioner(d_cond=32, rank=4)).eval()
    adapters: dict[str, LM] = {
        "hf_llama": hf_adapter(CONFIG),
        "elr_k1": ELRLM.from_model(looped, ByteTokenizer(), loops=1, batch_size=BATCH),
        "elr_k4": ELRLM.from_model(looped, ByteTokenizer(), loops=4, batch_size=BATCH),
        "elr_k1_fold": ELRLM.from_model(looped, ByteTokenizer(), loops=1, batch_size=BATCH, fold=True),
        "elr_k4_fold": ELRLM.from_model(looped, ByteTokenizer(), loops=4, batch_size=BATCH, fold=True),
    }
    rows: dict[str, dict[str, float]] = {}
    for kind, batch in reqs.items():
        variants = {name: (lambda lm=lm, kind=kind, batch=batch: getattr(lm, kind)(batch, disable_tqdm=True))
                    for name, lm in adapters.items()}  # fmt: skip
        seconds = measure(variants, args.repeats)
        base = len(batch) / seconds["hf_llama"]
        for name, s in seconds.items():
            rate = len(batch) / s
            rows.setdefault(kind, {})[f"{name}_requests_per_s"] = rate
            if name != "hf_llama":
                rows[kind][f"{name}_over_hf"] = rate / base
        print(f"{kind:16s} ({len(batch)} requests): " + "  ".join(
            f"{name} {len(batch) / s:7.1f} req/s" for name, s in seconds.items()
        ))  # fmt: skip
        print("  ELR/HF: " + "  ".join(f"{key[:-8]} {v:.2f}x" for key, v in rows[kind].items() if key.endswith("_over_hf")))
    report = {
        "config": {**CONFIG.__dict__, "hf_layers": CONFIG.effective_depth(1), "batch_size": BATCH},
        "docs": args.docs,
        "repeats": args.repeats,
        "threads": args.threads,
        "machine": platform.platform(),
        "torch": torch.__version__,
        "results": rows,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
