"""Pretraining-scale data: tokenisation throughput, loader memory against corpus size, loader speed.

Three measurements, each against a baseline taken in the same run:

* **Tokenisation MB/s** of ``elr prepare`` (:func:`~elr_lightning.data.prepare.prepare_corpus`) at 1 and
  2 workers, against ``datasets.Dataset.map(batched=True, num_proc=W)`` reading and tokenising the
  same files with the same tokenizer (a byte-level BPE trained here on part of the corpus), in
  ``--repeats`` interleaved rounds; the ratio is the median of the rounds' ratios. The corpus is
  the first ``--mb`` MB of the standard library's sources. ``datasets`` comes with the ``eval``
  extra. Target: within 10% of the reference at the same worker count.
* **Loader RSS** of a rank drawing ``--batches`` training batches from a synthetic prepared folder
  of 10M tokens and of ``--big_tokens`` (2B by default) tokens, written directly as ``uint16``
  shards without tokenising (deleted afterwards). Each set is read in a fresh process; the table
  gives the resident set after the batches (``VmRSS``; ``RssAnon`` is the part that is not file
  pages of the memory-mapped shards). Target: within 10% of each other.
* **Loader tokens/s** in steady state, on one core, at the quickstart's batch shape, against the
  quickstart model's training tokens/s (``config/quickstart.yaml``, fp32, one thread). Target: at
  least 20x.

With ``--prepare_rss`` it measures only **elr prepare memory**: the peak RSS of the ``elr prepare``
process and of its ``--prepare_workers`` worker processes (``ru_maxrss`` of itself and of its
children, in a fresh process per input) on one plain-text file and one ``.jsonl.zst`` of each
``--prepare_mb`` size (MB of text, of JSONL before compression), made of the standard library's
sources repeated and deleted after their run. Target: the 2 GB inputs within 1.10x the 200 MB ones,
since a worker holds one ``--shard_mb`` span whatever the file's size.

    OMP_NUM_THREADS=1 python bench/data.py                       # writes bench/results/data.json
    OMP_NUM_THREADS=1 python bench/data.py --mb 4 --big_tokens 200000000   # a quick look
    python bench/data.py --prepare_rss                           # writes bench/results/data_prepare.json
    python bench/data.py --prepare_rss --prepare_mb 20 100 --prepare_shard_mb 8   # a quick look

``--step_time`` measures instead the quickstart model's training step (Lightning, fp32, one thread)
fed from a prepared folder (``--step_tokens`` synthetic byte-level tokens) against the same steps fed
the same batches already in memory: reading in the step (``prefetch 0``) and reading ahead in a
background thread (``prefetch 2``, the default), each with the folder's pages in the page cache
(warm) and evicted before the run (cold: ``posix_fadvise(DONTNEED)``, a corpus larger than memory).
The cases run interleaved over ``--step_rounds`` rounds, each a fresh ``Trainer`` over the same
steps (so the same loop counts); a round's ratio is its summed step time over the in-memory case's.
Target: prefetched over in-memory at most 1.02.

    OMP_NUM_THREADS=1 python bench/data.py --step_time           # writes bench/results/data_step.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def corpus_files(megabytes: float) -> list[str]:
    """The first ``megabytes`` MB of the standard library's sources, in a fixed order."""
    from elr_lightning.data import default_corpus_files

    files, total = [], 0
    for path in default_corpus_files():
        files.append(path)
        total += os.path.getsize(path)
        if total >= megabytes * 1e6:
            break
    return files


def train_tokenizer(files: list[str], path: str) -> None:
    """A byte-level BPE of 4096 ids with ``<|endoftext|>``, trained on the first 2 MB of ``files``."""
    import tokenizers as hf

    tok = hf.Tokenizer(hf.models.BPE())
    tok.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = hf.decoders.ByteLevel()
    trainer = hf.trainers.BpeTrainer(
        vocab_size=4096,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts, total = [], 0
    for p in files:
        texts.append(open(p, encoding="utf-8").read())
        total += len(texts[-1])
        if total > 2e6:
            break
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(path)


def _read_and_encode(batch: dict[str, list[str]], tokenizer: str) -> dict[str, list[Any]]:
    from elr_lightning.data.prepare import _tokenizer

    tok = _tokenizer(tokenizer)
    return {"ids": [tok.encode(open(p, encoding="utf-8").read()) for p in batch["path"]]}


def _timed(run: Any) -> tuple[float, float]:
    """Wall seconds and CPU seconds (this process and its finished children) of ``run()``."""
    def cpu() -> float:
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

    wall, used = time.perf_counter(), cpu()
    run()
    return time.perf_counter() - wall, cpu() - used


def tokenisation(files: list[str], tokenizer: str, workers: int, work: str, round_: int) -> dict[str, float]:
    """MB/s (wall and per CPU second) of ``elr prepare`` and of the ``datasets.map`` reference, at ``workers``."""
    import datasets

    from elr_lightning.data import prepare_corpus

    datasets.disable_progress_bars()
    megabytes = sum(os.path.getsize(p) for p in files) / 1e6
    out = os.path.join(work, f"prep{workers}-{round_}")
    ours = _timed(lambda: prepare_corpus(files, out, tokenizer, workers, shard_bytes=1 << 19, progress=False))
    shutil.rmtree(out)

    def reference() -> None:
        datasets.Dataset.from_dict({"path": files}).map(
            _read_and_encode,
            batched=True,
            batch_size=16,
            num_proc=workers if workers > 1 else None,
            fn_kwargs={"tokenizer": tokenizer},
            remove_columns=["path"],
            cache_file_name=os.path.join(work, f"map{workers}-{round_}.arrow"),
        )

    theirs = _timed(reference)
    return {
        "mb": megabytes,
        "ours_mb_s": megabytes / ours[0],
        "reference_mb_s": megabytes / theirs[0],
        "ours_mb_per_cpu_s": megabytes / ours[1],
        "reference_mb_per_cpu_s": megabytes / theirs[1],
    }


def write_synthetic(folder: str, tokens: int, shard_tokens: int = 1 << 28) -> None:
    """A prepared folder of ``tokens`` pseudo-random ids stored as ``uint16`` (as a GPT-2-sized vocabulary would
    be), no validation split; the ids are bytes, so the index matches the byte tokenizer the loader is given.

    Written as :mod:`elr_lightning.data.prepare` lays folders out, one 1M-token random block
    repeated, so the folder takes seconds to write.
    """
    from elr_lightning.data.prepare import PREPARED_FORMAT, shard_paths
    from elr_lightning.tokenizers import ByteTokenizer

    os.makedirs(os.path.join(folder, "shards"))
    block = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint16)
    shards, left = [], tokens
    while left:
        n = min(left, shard_tokens)
        paths = shard_paths(folder, len(shards))
        with open(paths["train"], "wb") as f:
            for a in range(0, n, len(block)):
                f.write(block[: min(len(block), n - a)].tobytes())
        open(paths["val"], "wb").close()
        shards.append({"index": len(shards), "input_bytes": 2 * n, "train_tokens": n, "val_tokens": 0})
        shards[-1].update(train_documents=1, val_documents=0)
        left -= n
    index = {
        "format": PREPARED_FORMAT,
        # the byte tokenizer's fingerprint and vocabulary: the loader checks both, and reads ids as the index's
        # dtype says (two bytes a token, the memory of a 50k vocabulary)
        "tokenizer_fingerprint": ByteTokenizer().fingerprint(),
        "vocab_size": ByteTokenizer().vocab_size,
        "dtype": "uint16",
        "separator": [10],
        "text_field": "text",
        "val_fraction": 0.0,
        "shards": shards,
        "train_tokens": tokens,
        "val_tokens": 0,
    }
    with open(os.path.join(folder, "index.json"), "w") as f:
        json.dump(index, f)


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def loader_worker(folder: str, batches: int, batch_size: int, seq_len: int) -> dict[str, float]:
    """In this process: draw ``batches`` batches (after 20 of warm-up) and report RSS and tokens/s."""
    import torch

    from elr_lightning.data import PreparedDataModule

    torch.set_num_threads(1)
    before = _status_kb("VmRSS")
    dm = PreparedDataModule(folder, seq_len=seq_len, batch_size=batch_size)
    dm.setup("fit")
    loader = iter(dm.train_dataloader())
    for _ in range(20):
        next(loader)
    start = time.perf_counter()
    cpu = time.process_time()
    for _ in range(batches):
        next(loader)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {
        "rss_before_mb": before / 1024,
        "rss_mb": _status_kb("VmRSS") / 1024,
        "rss_anon_mb": _status_kb("RssAnon") / 1024,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "tokens_per_s": batches * batch_size * seq_len / wall,
        "tokens_per_cpu_s": batches * batch_size * seq_len / cpu,
    }


def quickstart() -> tuple[Any, dict[str, Any]]:
    """The quickstart's ``ELRModule`` (``config/quickstart.yaml``) and its data arguments."""
    import yaml
    from jsonargparse import ArgumentParser

    from elr_lightning import ELRModule

    with open(os.path.join(ROOT, "config", "quickstart.yaml")) as f:
        config = yaml.safe_load(f)
    parser = ArgumentParser()
    parser.add_subclass_arguments(ELRModule, "model")
    module = parser.instantiate_classes(parser.parse_object({"model": config["model"]})).model
    return module, config["data"]["init_args"]


def step_starts(module: Any, steps: int, **fit: Any) -> list[float]:
    """``trainer.fit(module, **fit)`` for ``steps`` steps (fp32, no validation); when each step started (wall)."""
    import lightning.pytorch as pl

    times: list[float] = []

    class Clock(pl.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            times.append(time.perf_counter())

    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        precision=32,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[Clock()],
    )
    trainer.fit(module, **fit)
    return times


def quickstart_tokens_per_s(steps: int) -> float:
    """Training tokens/s of the quickstart model and batch (fp32, one thread), after 3 warm-up steps."""
    import torch

    from elr_lightning.data import TextDataModule

    torch.set_num_threads(1)
    module, data_args = quickstart()
    with tempfile.TemporaryDirectory() as cache:
        data = TextDataModule(
            seq_len=data_args["seq_len"], batch_size=data_args["batch_size"], max_bytes=2_000_000, cache_dir=cache
        )
        times = step_starts(module, steps + 4, datamodule=data)
    return steps * data_args["batch_size"] * data_args["seq_len"] / (times[-1] - times[3])


# ---- the quickstart step fed from a prepared folder against in memory (--step_time) ------------------


def evict(folder: str) -> None:
    """Drop the page-cache pages of ``folder``'s shards (``posix_fadvise(DONTNEED)``): the next reads go to the disk."""
    for name in os.listdir(os.path.join(folder, "shards")):
        fd = os.open(os.path.join(folder, "shards", name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class Waited:
    """A sized loader (Lightning then fetches no batch ahead) that times how long each batch is waited for."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.waits: list[float] = []

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Any:
        it = iter(self.loader)
        while True:
            start = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            self.waits.append(time.perf_counter() - start)
            yield batch


def step_time(folder: str, steps: int, warmup: int, rounds: int) -> dict[str, Any]:
    """The quickstart step fed from ``folder`` (read in the step, prefetched; warm, cold) against in memory.

    Returns ``{"cases": {name: [summed step seconds per round]}, "ratios": {name: [per-round ratio to
    in memory]}, "waits": {name: [seconds the loop waited for each timed batch]}}``: the wait is the
    part of the step on the data's account, and the least noisy figure on a loaded machine.
    """
    import torch

    from elr_lightning.data import PreparedDataModule

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    module, data_args = quickstart()

    def prepared(prefetch: int) -> Any:
        dm = PreparedDataModule(folder, seq_len=data_args["seq_len"], batch_size=data_args["batch_size"], prefetch=prefetch)
        dm.setup("fit")
        return dm.train_dataloader()

    first = iter(prepared(0))
    memory = [next(first) for _ in range(warmup + steps + 1)]
    cases: dict[str, Any] = {
        "in memory": lambda: memory,
        "read in the step, warm": lambda: prepared(0),
        "prefetch 2, warm": lambda: prepared(2),
        "read in the step, cold": lambda: prepared(0),
        "prefetch 2, cold": lambda: prepared(2),
    }
    names = list(cases)
    summed: dict[str, list[float]] = {name: [] for name in names}
    waits: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            loader = Waited(cases[name]())
            if name.endswith("cold"):
                evict(folder)
            times = step_starts(module, warmup + steps + 1, train_dataloaders=loader)
            summed[name].append(times[-1] - times[warmup])
            waits[name] += loader.waits[warmup + 1 : warmup + steps + 1]  # the batches of the timed steps
    ratios = {name: [t / m for t, m in zip(summed[name], summed["in memory"])] for name in names[1:]}
    tokens = data_args["seq_len"] * data_args["batch_size"]
    return {"cases": summed, "ratios": ratios, "waits": waits, "steps": steps, "warmup": warmup, "tokens_per_step": tokens}


def report_step_time(result: dict[str, Any]) -> None:
    """Print the step-time table: each case's median step against the in-memory one."""
    steps = result["steps"]
    memory = statistics.median(result["cases"]["in memory"]) / steps
    print("| case | ms/step (median of rounds) | over in memory, median (range) of rounds | data wait ms/step: mean, max |")
    print("|---|---|---|---|")
    for name in result["cases"]:
        ms = 1e3 * statistics.median(result["cases"][name]) / steps
        ratios = result["ratios"].get(name, [1.0])
        waits = result["waits"][name]
        print(f"| {name} | {ms:.1f} | {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) | "
              f"{1e3 * statistics.fmean(waits):.2f}, {1e3 * max(waits):.2f} |")
    print(f"target: prefetch 2 over in memory <= 1.02 (its mean wait is {statistics.fmean(result['waits']['prefetch 2, cold']) / memory:.4f} "
          "of the in-memory step, cold)")
# ---- elr prepare memory against input size (--prepare_rss) --------------------------------------------


def write_prepare_input(path: str, megabytes: float) -> int:
    """A file of at least ``megabytes`` MB made of the standard library's sources, repeated: plain text for
    ``.txt``, one ``{"text": source}`` record per line compressed with zstd (level 3) for ``.jsonl.zst``.

    Returns:
        The bytes of text (of JSONL, before compression) written.
    """
    from elr_lightning.data import default_corpus_files

    texts = []
    for p in default_corpus_files():
        data = open(p, "rb").read()
        if b"\0" not in data:
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                continue
            texts.append(data)
    target, written = int(megabytes * 1e6), 0
    with open(path, "wb") as raw:
        sink: Any = raw
        if path.endswith(".zst"):
            import zstandard

            sink = zstandard.ZstdCompressor(level=3).stream_writer(raw, closefd=False)
        while written < target:
            for data in texts:
                if path.endswith(".zst"):
                    data = (json.dumps({"text": data.decode("utf-8")}) + "\n").encode()
                sink.write(data)
                written += len(data)
                if written >= target:
                    break
        if sink is not raw:
            sink.close()
    return written


def prepare_worker(source: str, out: str, workers: int, shard_mb: float) -> dict[str, float]:
    """In this process: ``elr prepare`` one file; peak RSS of this process and of its worker processes."""
    from elr_lightning.data import prepare_corpus

    wall, cpu = _timed(lambda: prepare_corpus([source], out, workers=workers, shard_bytes=int(shard_mb * 2**20),
                                              progress=False))
    return {
        "main_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "worker_peak_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        "seconds": wall,
        "cpu_seconds": cpu,
    }


def prepare_rss(args: argparse.Namespace, work: str) -> dict[str, Any]:
    """Peak RSS of ``elr prepare --workers W`` on one text file and one ``.jsonl.zst`` of each size, each in a
    fresh process, the inputs written to ``work`` and deleted after their run."""
    rows = []
    for kind in ("txt", "jsonl.zst"):
        for megabytes in args.prepare_mb:
            source, out = os.path.join(work, f"input.{kind}"), os.path.join(work, "prepared")
            text_bytes = write_prepare_input(source, megabytes)
            row = {"input": kind, "text_mb": text_bytes / 1e6, "file_mb": os.path.getsize(source) / 1e6}
            done = subprocess.run(
                [sys.executable, __file__, "--prepare_worker", source, out, str(args.prepare_workers),
                 str(args.prepare_shard_mb)],
                check=True, capture_output=True, text=True,
            )
            row.update(json.loads(done.stdout.strip().splitlines()[-1]))
            with open(os.path.join(out, "index.json")) as f:
                row["shards"] = len(json.load(f)["shards"])
            rows.append(row)
            print(json.dumps(row), flush=True)
            os.remove(source)
            shutil.rmtree(out)
    return {"workers": args.prepare_workers, "shard_mb": args.prepare_shard_mb, "rows": rows}


def report_prepare(result: dict[str, Any]) -> None:
    """The RSS table: each input against the smallest of its kind."""
    print(f"\nelr prepare --workers {result['workers']} --shard_mb {result['shard_mb']} (byte tokenizer), peak RSS")
    print("| input | text MB | file MB | shards | main process MB | worker MB | worker / smallest | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    for row in result["rows"]:
        base = min((r for r in result["rows"] if r["input"] == row["input"]), key=lambda r: r["text_mb"])
        print(
            f"| {row['input']} | {row['text_mb']:.0f} | {row['file_mb']:.0f} | {row['shards']} | "
            f"{row['main_peak_rss_mb']:.0f} | {row['worker_peak_rss_mb']:.0f} | "
            f"{row['worker_peak_rss_mb'] / base['worker_peak_rss_mb']:.2f} | {row['seconds']:.0f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=16.0, help="MB of stdlib sources to tokenise")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved tokenisation rounds")
    parser.add_argument("--small_tokens", type=int, default=10_000_000)
    parser.add_argument("--big_tokens", type=int, default=2_000_000_000)
    parser.add_argument("--batches", type=int, default=2000, help="batches each loader process draws")
    parser.add_argument("--train_steps", type=int, default=12, help="timed quickstart training steps")
    parser.add_argument("--work", default=None, help="scratch folder (default: a temporary one, removed)")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "data.json"))
    parser.add_argument("--loader_worker", nargs=4, metavar=("FOLDER", "BATCHES", "BATCH", "SEQ"), help=argparse.SUPPRESS)
    parser.add_argument("--step_time", action="store_true", help="only the step-time table (see above)")
    parser.add_argument("--step_tokens", type=int, default=1_000_000_000, help="tokens of the --step_time folder")
    parser.add_argument("--step_rounds", type=int, default=3)
    parser.add_argument("--step_steps", type=int, default=20, help="timed steps per case and round")
    parser.add_argument("--prepare_rss", action="store_true", help="measure only elr prepare's RSS against input size")
    parser.add_argument("--prepare_mb", type=float, nargs="+", default=[200.0, 2000.0], help="input sizes, MB of text")
    parser.add_argument("--prepare_workers", type=int, default=2)
    parser.add_argument("--prepare_shard_mb", type=float, default=64.0, help="elr prepare --shard_mb")
    parser.add_argument("--prepare_worker", nargs=4, metavar=("SOURCE", "OUT", "WORKERS", "SHARD_MB"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.loader_worker:
        folder, batches, batch, seq = args.loader_worker
        print(json.dumps(loader_worker(folder, int(batches), int(batch), int(seq))))
        return
    if args.step_time:
        work = args.work or tempfile.mkdtemp(prefix="elr-bench-step-")
        try:
            folder = os.path.join(work, "step")
            write_synthetic(folder, args.step_tokens)  # byte ids: the quickstart's vocabulary
            result = step_time(folder, args.step_steps, 3, args.step_rounds)
        finally:
            if args.work is None:
                shutil.rmtree(work, ignore_errors=True)
        report_step_time(result)
        out = args.out.replace(".json", "_step.json")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "loader_worker"}, **result}, f, indent=1)
        return
    if args.prepare_worker:
        source, out, workers, shard_mb = args.prepare_worker
        print(json.dumps(prepare_worker(source, out, int(workers), float(shard_mb))))
        return
    if args.prepare_rss:
        work = args.work or tempfile.mkdtemp(prefix="elr-bench-prepare-")
        try:
            result = prepare_rss(args, work)
        finally:
            if args.work is None:
                shutil.rmtree(work, ignore_errors=True)
        report_prepare(result)
        out = os.path.join(os.path.dirname(args.out), "data_prepare.json")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        return
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    work = args.work or tempfile.mkdtemp(prefix="elr-bench-data-")
    results: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "loader_worker"}}
    try:
        files = corpus_files(args.mb)
        tokenizer = os.path.join(work, "bpe.json")
        train_tokenizer(files, tokenizer)
        rounds = [{w: tokenisation(files, tokenizer, w, work, r) for w in (1, 2)} for r in range(args.repeats)]
        results["tokenisation"] = {w: [r[w] for r in rounds] for w in (1, 2)}
        with open(os.path.join(ROOT, "config", "quickstart.yaml")) as f:
            import yaml

            shape = yaml.safe_load(f)["data"]["init_args"]
        results["loader"] = {}
        for name, tokens in (("small", args.small_tokens), ("big", args.big_tokens)):
            folder = os.path.join(work, name)
            write_synthetic(folder, tokens)
            out = subprocess.run(
                [sys.executable, __file__, "--loader_worker", folder, str(args.batches), str(shape["batch_size"]), str(shape["seq_len"])],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            results["loader"][name] = {"tokens": tokens, **json.loads(out.strip().splitlines()[-1])}
            shutil.rmtree(folder)
        results["quickstart_train_tokens_per_s"] = quickstart_tokens_per_s(args.train_steps)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    report(results)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


def report(results: dict[str, Any]) -> None:
    """Print the three tables with their ratios and targets."""
    print("| workers | MB | elr prepare MB/s | datasets.map MB/s | ratio, median (range) of rounds | ratio per CPU s |")
    print("|---|---|---|---|---|---|")
    for w, rounds in results["tokenisation"].items():
        ratios = sorted(r["ours_mb_s"] / r["reference_mb_s"] for r in rounds)
        cpu = statistics.median(r["ours_mb_per_cpu_s"] / r["reference_mb_per_cpu_s"] for r in rounds)
        ours = statistics.median(r["ours_mb_s"] for r in rounds)
        theirs = statistics.median(r["reference_mb_s"] for r in rounds)
        print(
            f"| {w} | {rounds[0]['mb']:.1f} | {ours:.2f} | {theirs:.2f} | {statistics.median(ratios):.2f} "
            f"({ratios[0]:.2f}-{ratios[-1]:.2f}) | {cpu:.2f} |"
        )
    print("target: ratio >= 0.9")
    small, big = results["loader"]["small"], results["loader"]["big"]
    print("\n| prepared set | tokens | RSS MB | RssAnon MB | peak RSS MB |")
    print("|---|---|---|---|---|")
    for name, r in (("small", small), ("big", big)):
        print(f"| {name} | {r['tokens']:.3g} | {r['rss_mb']:.1f} | {r['rss_anon_mb']:.1f} | {r['peak_rss_mb']:.1f} |")
    print(f"big / small RSS: {big['rss_mb'] / small['rss_mb']:.3f} (target within 1.10)")
    train = results["quickstart_train_tokens_per_s"]
    loader = big["tokens_per_s"]
    print(f"\nloader tokens/s (big set, one thread, wall): {loader:,.0f}; per CPU second {big['tokens_per_cpu_s']:,.0f}")
    print(f"quickstart training tokens/s (one thread, wall): {train:,.0f}; ratio {loader / train:.1f}x (target >= 20x)")


if __name__ == "__main__":
    main()
