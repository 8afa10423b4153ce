"""Peak memory of ``elr retrofit`` against the size of the safetensors it reads.

Builds a ``LlamaForCausalLM`` (transformers ``LlamaConfig``, random weights) with the shapes of
``--shape`` (``1b``: Llama 3.2 1B's, 1.24B parameters; ``small`` for a quick look), saves it as
bf16 shards of ``--shard_mb`` with their ``model.safetensors.index.json`` and a word-level
``tokenizer.json`` of its vocabulary, then runs ``elr retrofit --no_verify`` on it in a
subprocess. The peak resident set is ``resource.getrusage(RUSAGE_CHILDREN).ru_maxrss`` of a
wrapper process that runs only that command. ``--baseline COMMIT`` runs the same command on that
commit's package (``git archive``) first, in the same run. Target: peak RSS at most 1.5x the
safetensors bytes. Everything is written to a temporary folder and deleted.

``--verify`` (the default of ``elr retrofit``) is left out: it loads the source model with
transformers in fp32 beside ours, two fp32 copies of the model whatever the retrofit itself takes.

    python bench/retrofit_memory.py --baseline main      # writes bench/results/retrofit_memory.json
    python bench/retrofit_memory.py --shape small        # a quick look
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

#: Llama 3.2 1B's shapes (tied embeddings, GQA 32/8, llama3 RoPE), and a small model of the same kind.
SHAPES: dict[str, dict[str, Any]] = {
    "1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    ),
    "small": dict(
        hidden_size=256, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
        vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False,
    ),
}

#: Runs ``sys.argv[1:]`` and prints the peak RSS (KiB on Linux) of that one child and its return code.
WRAPPER = (
    "import resource, subprocess, sys\n"
    "rc = subprocess.call(sys.argv[1:], stdout=subprocess.DEVNULL)\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, rc)\n"
)


def write_source(folder: Path, shape: str, shard_mb: int) -> int:
    """The random bf16 Llama of ``shape`` saved in ``folder`` as shards with an index; its parameter count."""
    import tokenizers
    import torch
    import transformers

    config = transformers.LlamaConfig(**SHAPES[shape])
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(str(folder), max_shard_size=f"{shard_mb}MB")
    del model
    gc.collect()
    vocab = {f"w{i}": i for i in range(config.vocab_size)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    return params


def peak_rss(package_root: Path, source: Path, out: Path) -> dict[str, Any]:
    """Peak RSS, seconds and checkpoint bytes of ``elr retrofit`` run from ``package_root``."""
    command = [sys.executable, "-m", "elr_lightning.cli", "retrofit", "--hf", str(source), "--out", str(out),
               "--no_verify"]
    env = {**os.environ, "PYTHONPATH": str(package_root), "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", WRAPPER, *command], env=env, cwd=package_root, capture_output=True,
                          text=True, check=True)
    seconds = time.perf_counter() - start
    kib, rc = (int(x) for x in done.stdout.split()[-2:])
    if rc != 0:
        raise RuntimeError(f"elr retrofit from {package_root} failed ({rc}): {done.stderr[-2000:]}")
    ckpt = out / "retrofit.ckpt"
    result = {"peak_rss_bytes": kib * 1024, "seconds": round(seconds, 1), "checkpoint_bytes": ckpt.stat().st_size}
    shutil.rmtree(out)
    return result


def baseline_package(commit: str, folder: Path) -> str:
    """``elr_lightning`` as it is at ``commit``, extracted into ``folder``; the commit's hash."""
    archive = subprocess.run(["git", "archive", commit, "elr_lightning"], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    return subprocess.run(["git", "rev-parse", "--short", commit], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--shard_mb", type=int, default=500, help="Largest safetensors shard, in MB.")
    parser.add_argument("--baseline", default=None, help="Also measure this commit's elr retrofit, first.")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "retrofit_memory.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="retrofit_memory_") as tmp:
        work = Path(tmp)
        source = work / "source"
        params = write_source(source, args.shape, args.shard_mb)
        size = sum(p.stat().st_size for p in source.glob("*.safetensors"))
        shards = len(list(source.glob("*.safetensors")))
        print(f"{args.shape}: {params:,} parameters, {size / 1e9:.3f} GB of bf16 safetensors in {shards} shards")
        runs: dict[str, dict[str, Any]] = {}
        if args.baseline:
            (work / "baseline").mkdir()
            name = f"baseline {args.baseline} ({baseline_package(args.baseline, work / 'baseline')})"
            runs[name] = peak_rss(work / "baseline", source, work / "out")
        runs["current"] = peak_rss(ROOT, source, work / "out")
    print(f"{'code':<28} {'peak RSS GB':>12} {'x safetensors':>14} {'checkpoint GB':>14} {'seconds':>8}")
    for name, run in runs.items():
        run["ratio"] = round(run["peak_rss_bytes"] / size, 3)
        print(f"{name:<28} {run['peak_rss_bytes'] / 1e9:>12.2f} {run['ratio']:>14.2f} "
              f"{run['checkpoint_bytes'] / 1e9:>14.2f} {run['seconds']:>8.1f}")
    target = 1.5
    verdict = "meets" if runs["current"]["ratio"] <= target else "misses"
    print(f"current peak RSS / safetensors = {runs['current']['ratio']:.2f}: {verdict} the target of {target}")
    result = {
        "shape": args.shape, "config": SHAPES[args.shape], "parameters": params, "safetensors_bytes": size,
        "shards": shards, "target_ratio": target, "runs": runs, "python": platform.python_version(),
        "note": "peak RSS of `elr retrofit --no_verify` (ru_maxrss of a wrapper's only child)",
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
