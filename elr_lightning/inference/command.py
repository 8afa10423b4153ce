"""``elr generate``: stream a continuation of a prompt from a checkpoint at any loop count.

The command-line face of :mod:`elr_lightning.inference.generate`: argument parsing, prompt and checkpoint
checks, streaming detokenisation and the ``--stats`` report.
"""

from __future__ import annotations

import sys
import time
import warnings
from typing import Literal, Optional

import torch

from elr_lightning.arguments import CommandParser, add_loops, add_switch, command_parser
from elr_lightning.inference.cache import (
    CACHE_POLICIES,
    KVCache,
    kv_cache_bytes,
    layer_caches,
    recurrent_state_bytes,
    resolve_policy,
)
from elr_lightning.config import ModelConfig
from elr_lightning.errors import refuse_unread_flags
from elr_lightning.inference.generate import generate
from elr_lightning.inference.open import open_checkpoint
from elr_lightning.tokenizers import IncrementalDecoder
from elr_lightning.checkpoints.trust import add_trust_argument


def generate_parser() -> CommandParser:
    """The parser of ``elr generate``."""
    parser = command_parser("generate", "Stream a continuation of a prompt from an ELR checkpoint at any loop count.")
    parser.add_argument("--ckpt_path", type=str, required=True, help="Checkpoint written by `elr fit`.")
    parser.add_argument("--prompt", type=Optional[str], default=None, help="Prompt text.")
    parser.add_argument("--prompt_file", type=Optional[str], default=None, help="Read the prompt from this file.")
    add_loops(parser, "Loop count k, or auto for depth per token", default="1", several=False, auto=True)
    parser.add_argument("--max_loops", type=Optional[int], default=None, help="Budget of --loops auto (arch.max_loops).")
    parser.add_argument(
        "--threshold", type=Optional[float], default=None, help="Exit threshold of --loops auto; default 0.001."
    )
    parser.add_argument(
        "--exit_criterion", type=Optional[Literal["kl", "delta"]], default=None,
        help="Exit criterion of --loops auto; default kl.",
    )  # fmt: skip
    parser.add_argument(
        "--kv_cache", type=Literal["per_loop", "last_loop"], default="per_loop", help="KV-cache policy."
    )
    parser.add_argument(
        "--max_new_tokens",
        type=Optional[int],
        default=None,
        help="Tokens to generate; default: up to arch.max_seq_len.",
    )
    parser.add_argument("--temperature", type=float, default=1.0, help="Softmax temperature; 0 is greedy.")
    parser.add_argument("--top_k", type=Optional[int], default=None, help="Top-k filter.")
    parser.add_argument("--top_p", type=Optional[float], default=None, help="Nucleus (top-p) filter.")
    parser.add_argument("--seed", type=Optional[int], default=None, help="Sampling seed.")
    parser.add_argument(
        "--tokenizer",
        type=Optional[str],
        default=None,
        help="'byte' or a tokenizer.json path; default: the one saved in the checkpoint (bytes if none).",
    )
    add_switch(parser, "--allow_extrapolation", False, "Allow --loops above the checkpoint's max_loops (with a warning).")
    add_switch(
        parser, "--fold", None,
        "Decode with the conditioning constants of --loops computed once (default, the model's serve_folded); "
        "--no_fold runs the conditioner per token.",
    )  # fmt: skip
    add_switch(parser, "--stats", False, "Print KV memory and tokens/s to stderr.")
    parser.add_argument("--device", type=str, default="cpu", help="Device to run on, e.g. cpu or cuda.")
    add_trust_argument(parser)
    parser.add_argument(
        "--dtype", type=Literal["float32", "bfloat16"], default="float32", help="bfloat16 runs under autocast."
    )
    add_switch(parser, "--echo_prompt", True, "Print the prompt before the continuation.")
    return parser


def _read_prompt(prompt: Optional[str], prompt_file: Optional[str]) -> str:
    """The prompt text of ``--prompt`` or ``--prompt_file``, refused with the flag's name unless it is UTF-8."""
    if prompt_file is None:
        try:
            (prompt or "").encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(
                f"--prompt holds bytes that are not UTF-8 (position {err.start}); pass UTF-8 text or use --prompt_file"
            ) from err
        return prompt or ""
    try:
        with open(prompt_file, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as err:
        raise ValueError(
            f"--prompt_file {prompt_file!r} is not UTF-8 text (byte {err.start}: {err.reason}); convert it to UTF-8"
        ) from err
    except OSError as err:
        raise ValueError(f"--prompt_file {prompt_file!r} cannot be read: {err.strerror or err}") from err


def generate_command(argv: list[str]) -> None:
    """``elr generate``: stream a checkpoint's continuation of a prompt to stdout.

    Args:
        argv: The arguments after ``generate``; see ``elr generate --help``.

    Raises:
        ValueError: No or empty prompt, ``--loops`` above the checkpoint's ``arch.max_loops``
            without ``--allow_extrapolation``, a bad checkpoint, or a too-long request.
        FileNotFoundError: A missing checkpoint, prompt file or tokenizer file.
    """
    args = generate_parser().parse_args(argv)
    loops = args.loops.single
    if loops != "auto":
        flags = {"--max_loops": args.max_loops, "--threshold": args.threshold, "--exit_criterion": args.exit_criterion}
        refuse_unread_flags(flags, "--loops auto", "pass --loops auto")
    if (args.prompt is None) == (args.prompt_file is None):
        raise ValueError("give exactly one of --prompt and --prompt_file")
    text = _read_prompt(args.prompt, args.prompt_file)
    device = torch.device(args.device)
    opened = open_checkpoint(args.ckpt_path, args.trust_module, args.tokenizer, device)
    if not text:
        raise ValueError("the prompt is empty; pass some text with --prompt or --prompt_file")
    model, module, tokenizer = opened.model, opened.module, opened.tokenizer
    config = model.config
    budget = loops if loops != "auto" else args.max_loops or config.max_loops
    if budget < 1:
        raise ValueError(f"--max_loops {budget} must be >= 1")
    if budget > config.max_loops:
        message = (
            f"--loops {loops} (budget {budget}) is above the checkpoint's arch.max_loops={config.max_loops}, the loop budget "
            "it was trained for"
        )
        if not args.allow_extrapolation:
            raise ValueError(f"{message}; pass --allow_extrapolation to run it anyway")
        warnings.warn(f"{message}; extrapolating", stacklevel=2)
    ids = tokenizer.encode(text)
    if not ids:
        raise ValueError("the prompt encodes to no tokens; pass some text with --prompt or --prompt_file")
    max_new = args.max_new_tokens
    if max_new is None:
        max_new = config.max_seq_len - len(ids) + 1
        if max_new < 1:
            raise ValueError(
                f"the prompt has {len(ids)} tokens, more than arch.max_seq_len={config.max_seq_len}; shorten it"
            )
    if len(ids) + max_new - 1 > config.max_seq_len:  # before the prompt is echoed: the stream checks it lazily
        raise ValueError(
            f"a prompt of {len(ids)} tokens plus --max_new_tokens {max_new} needs {len(ids) + max_new - 1} positions, "
            f"more than arch.max_seq_len={config.max_seq_len}; shorten the prompt or lower --max_new_tokens"
        )
    cache = resolve_policy(args.kv_cache)(max_len=max(1, len(ids) + max_new - 1))
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else None
    decoder = IncrementalDecoder(tokenizer)
    if args.echo_prompt:
        sys.stdout.write(text)
        sys.stdout.flush()
    start = time.perf_counter()
    first_at, generated = start, 0

    def write(tokens: torch.Tensor) -> None:
        nonlocal first_at, generated
        if generated == 0:
            first_at = time.perf_counter()
        generated += 1
        token = int(tokens[0])
        if token != tokenizer.eos_id:
            sys.stdout.write(decoder.push(token))
            sys.stdout.flush()

    out = generate(
        model,
        torch.tensor([ids]),
        loops=loops,
        max_loops=args.max_loops,
        threshold=args.threshold,
        exit_criterion=args.exit_criterion,
        max_new_tokens=max_new,
        kv_cache=cache,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        eos_id=tokenizer.eos_id,
        seed=args.seed,
        autocast_dtype=dtype,
        fold=args.fold,
        callback=write,
    )
    end = time.perf_counter()
    sys.stdout.write(decoder.flush() + "\n")
    sys.stdout.flush()
    if args.stats:
        used = out.loops_used[0, 1:generated]
        if loops == "auto":
            threshold = 1e-3 if args.threshold is None else args.threshold
            depth = f"loops auto (budget {budget}, {args.exit_criterion or 'kl'} threshold {threshold:g})"
        else:
            depth = f"loops k={loops}  D_eff={config.effective_depth(loops)}"
        _print_stats(config, depth, budget, args.kv_cache, cache, len(ids), generated, first_at - start, end - first_at)
        if used.numel():
            counts = ", ".join(f"k={k}: {n}" for k, n in zip(*(t.tolist() for t in used.unique(return_counts=True))))
            mean = used.float().mean().item()
            sys.stderr.write(
                f"loops per decoded token: mean {mean:.2f} (D_eff {config.effective_depth(mean):.2f}), min "
                f"{used.min().item()}, max {used.max().item()}; {counts}\n"
            )


def _print_stats(
    config: ModelConfig,
    depth: str,
    loops: int,
    policy: str,
    cache: KVCache,
    prompt_tokens: int,
    generated: int,
    prefill_s: float,
    decode_s: float,
) -> None:
    dtype = cache.dtype or torch.float32
    tokens = max(cache.offset, 1)

    def mib(n: int) -> str:
        return f"{n / 2**20:.3f} MiB"

    lines = [
        f"{depth}  kv_cache={policy}  dtype={dtype}  (KV figures at {loops} loops)",
        f"KV cache: attention {mib(cache.nbytes())} used for {cache.offset} tokens, "
        f"{mib(cache.nbytes(used=False))} allocated; recurrent state {mib(cache.state_nbytes())}",
    ]
    for name in CACHE_POLICIES:
        n = kv_cache_bytes(config, loops, name, tokens, dtype)
        state = recurrent_state_bytes(config, loops, name, dtype)
        lines.append(
            f"  {name:9s}: {layer_caches(config, loops, name)} layer caches, KV {n // tokens} B/token, "
            f"{mib(n)} for {tokens} tokens; recurrent state {mib(state)}"
        )
    prefill_rate = prompt_tokens / max(prefill_s, 1e-9)
    lines.append(f"prefill: {prompt_tokens} tokens in {prefill_s:.3f} s ({prefill_rate:.1f} tok/s)")
    decoded = generated - 1
    if decoded > 0:
        lines.append(f"decode: {decoded} tokens in {decode_s:.3f} s ({decoded / max(decode_s, 1e-9):.1f} tok/s)")
    sys.stderr.write("\n".join(lines) + "\n")
