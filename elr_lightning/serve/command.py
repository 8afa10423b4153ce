"""The ``elr serve`` command: parse the flags, read the checkpoint's architecture, run LitServe."""

from __future__ import annotations

import os
import signal
import socket
import sys
import warnings
from collections.abc import Mapping
from typing import Any, Literal, Optional

from elr_lightning.arguments import CommandParser, add_loops, command_parser
from elr_lightning.checkpoints.io import is_sharded_checkpoint, read_sharded_checkpoint, verify_checkpoint_path
from elr_lightning.errors import install_extra
from elr_lightning.config import ModelConfig
from elr_lightning.checkpoints.safe_load import read_checkpoint
from elr_lightning.serve.limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_REQUEST_BYTES
from elr_lightning.serve.memory import (
    available_bytes,
    check_fits,
    checkpoint_parameters,
    default_max_context,
    describe,
    resolve_accelerator,
    serving_memory,
)
from elr_lightning.checkpoints.tokenizer import checkpoint_tokenizer, choose_tokenizer
from elr_lightning.tokenizers import Tokenizer
from elr_lightning.checkpoints.trust import add_trust_argument, apply_trust_argument


def serve_parser() -> CommandParser:
    """The parser of ``elr serve``."""
    parser = command_parser(
        "serve",
        "Serve a checkpoint over an OpenAI-compatible /v1/completions with a per-request loop count.",
        deprecated={"--loops_default": "--loops", "--loops_max": "--max_loops"},
    )
    parser.add_argument("--ckpt_path", type=str, required=True, help="Checkpoint written by `elr fit`.")
    parser.add_argument("--port", type=int, default=8000, help="TCP port.")
    parser.add_argument("--host", type=Literal["127.0.0.1", "0.0.0.0"], default="127.0.0.1", help="Interface.")
    parser.add_argument("--max_batch_size", type=int, default=8, help="Most requests decoded at once, all k together.")
    parser.add_argument("--kv_cache", type=Literal["last_loop", "per_loop"], default="last_loop", help="KV policy.")
    add_loops(parser, "Loops of requests that give no `loops`", default="1", several=False, auto=True)
    parser.add_argument(
        "--max_loops", type=Optional[int], default=None,
        help="Largest k served, and the budget of `auto` requests; default the checkpoint's max_loops.",
    )  # fmt: skip
    parser.add_argument(
        "--tokenizer",
        type=Optional[str],
        default=None,
        help="'byte' or a tokenizer.json path; default: the one saved in the checkpoint (bytes if none).",
    )
    parser.add_argument(
        "--max_context",
        type=Optional[int],
        default=None,
        help="Positions (prompt plus completion) each cache slot holds; default min(arch.max_seq_len, 4096).",
    )
    parser.add_argument(
        "--max_request_bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="Largest request body accepted; a larger one gets a 413 before it is read.",
    )
    parser.add_argument(
        "--body_timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT_S,
        help="Seconds a client has to send its whole request body; a slower one gets a 408.",
    )
    parser.add_argument(
        "--chat_template", type=Optional[str], default=None,
        help="Jinja chat template file (e.g. an export's chat_template.jinja) for /v1/chat/completions.",
    )  # fmt: skip
    parser.add_argument("--accelerator", type=str, default="auto", help="LitServe accelerator: auto, cpu or cuda.")
    parser.add_argument("--dtype", type=Literal["float32", "bfloat16"], default="float32", help="Autocast dtype.")
    parser.add_argument(
        "--log_level",
        type=Literal["critical", "error", "warning", "info", "debug", "trace"],
        default="warning",
        help="Server log level (uvicorn's names); 'info' logs every finished request.",
    )
    add_trust_argument(parser)
    return parser


def check_port_free(host: str, port: int) -> None:
    """Refuse ``port`` on ``host`` if another process listens there, before any worker starts.

    Raises:
        OSError: The port is taken, naming it and the way out.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a closing socket is no owner
        try:
            probe.bind((host, port))
        except OSError as err:
            raise OSError(
                f"--port {port} on {host} is in use ({err.strerror or err}); stop the process that holds it or pick "
                "another --port"
            ) from None


def serving_tokenizer(raw: Mapping[str, Any], override: Optional[str], config: ModelConfig) -> Tokenizer:
    """The tokenizer to serve with: ``--tokenizer`` if given, else the checkpoint's, else bytes."""
    return choose_tokenizer(checkpoint_tokenizer(raw), override, config.vocab_size)


def without_broken_mcp() -> None:
    """Keep LitServe's MCP endpoint off unless LitServe can build it.

    LitServe 0.2.19 turns the endpoint on when the ``mcp`` package is importable but defines its server
    class only when ``fastmcp`` is, so with ``mcp`` alone (vLLM requires ``mcp>=2``: the ``vllm`` extras
    install it) every server fails at start with ``NameError: name 'MCPServer' is not defined``.
    ``elr serve`` uses no MCP. The HTTP workers are forked from this process and inherit the setting.
    """
    import importlib.util

    import litserve.server

    if importlib.util.find_spec("fastmcp") is None:
        litserve.server._MCP_AVAILABLE = False


def serve_command(argv: list[str]) -> None:
    """``elr serve``: run the completions server until SIGINT or SIGTERM.

    Raises:
        ImportError: LitServe is not installed.
        ValueError: A bad flag, or a checkpoint that is not an ELR checkpoint, is damaged, holds a
            pickled object or names an untrusted module: the same one line as ``elr generate``, given
            before any worker starts.
        FileNotFoundError: No file at ``--ckpt_path``.
    """
    args = serve_parser().parse_args(argv)
    if not 1024 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} must be in 1024..65535")
    check_port_free(args.host, args.port)
    try:
        import litserve as ls
    except ImportError as err:
        raise ImportError(f"elr serve needs LitServe; install it with {install_extra('serve')}") from err
    from elr_lightning.inference.generate import load_model
    from elr_lightning.serve.api import CompletionsSpec, ELRServeAPI
    from elr_lightning.serve.chat import ChatTemplate, special_texts

    apply_trust_argument(args.trust_module)  # exported: the workers inherit it
    if args.log_level not in ("debug", "trace"):
        # A request that makes the tokenizer's Rust code panic is answered alone (a 400); the panic hook's
        # message still goes to stderr, but without a stack trace per request.
        os.environ["RUST_BACKTRACE"] = "0"
    verify_checkpoint_path(args.ckpt_path, "--ckpt_path")
    if is_sharded_checkpoint(args.ckpt_path):
        raw = read_sharded_checkpoint(args.ckpt_path, weights=False)
    else:
        raw = read_checkpoint(args.ckpt_path)
    # Every check of the workers' load (plug-ins, tensor names and shapes), on the meta device, before any starts;
    # the architecture is the one the workers build (hyper_parameters.arch, checked against elr.arch there).
    config = load_model(args.ckpt_path, meta=True)[0].config
    if not isinstance(raw, Mapping):
        raise ValueError(f"--ckpt_path {args.ckpt_path!r} is not a Lightning checkpoint")
    tokenizer = serving_tokenizer(raw, args.tokenizer, config)
    params = checkpoint_parameters(raw, config)
    del raw
    loops_max = config.max_loops if args.max_loops is None else args.max_loops
    if loops_max < 1:
        raise ValueError(f"--max_loops {loops_max} must be >= 1")
    if loops_max > config.max_loops:
        warnings.warn(
            f"--max_loops {loops_max} is above the checkpoint's arch.max_loops={config.max_loops}, the loop budget it "
            "was trained for; loops above it extrapolate"
        )
    loops_default = args.loops.single
    if loops_default != "auto" and not 1 <= loops_default <= loops_max:
        raise ValueError(f"--loops {loops_default} must be in 1..--max_loops ({loops_max}), or auto")
    if args.max_batch_size < 1:
        raise ValueError(f"--max_batch_size {args.max_batch_size} must be >= 1")
    if args.max_request_bytes < 1:
        raise ValueError(f"--max_request_bytes {args.max_request_bytes} must be >= 1")
    if not 0 < args.body_timeout < float("inf"):
        raise ValueError(f"--body_timeout {args.body_timeout} must be a number of seconds > 0")
    max_context = default_max_context(config) if args.max_context is None else args.max_context
    if not 1 <= max_context <= config.max_seq_len:
        raise ValueError(f"--max_context {max_context} must be in 1..arch.max_seq_len ({config.max_seq_len})")
    memory = serving_memory(config, args.kv_cache, loops_max, args.max_batch_size, max_context, args.dtype, params)
    print(describe(memory, args.kv_cache, loops_max, args.max_batch_size, max_context), file=sys.stderr, flush=True)
    accelerator = resolve_accelerator(args.accelerator)
    check_fits(memory, available_bytes(accelerator), accelerator)
    name = os.path.splitext(os.path.basename(args.ckpt_path))[0]
    chat = None if args.chat_template is None else ChatTemplate.from_file(args.chat_template, *special_texts(tokenizer))
    spec = CompletionsSpec(
        config, tokenizer, name, loops_default, loops_max, max_context, args.max_request_bytes, args.body_timeout,
        chat_template=chat,
    )
    api = ELRServeAPI(args.ckpt_path, spec, args.kv_cache, args.max_batch_size, args.dtype, args.log_level)
    without_broken_mcp()
    server = ls.LitServer(api, accelerator=args.accelerator, devices=1, workers_per_device=1, timeout=False)

    main_pid = os.getpid()

    def stop(signum: int, frame: Any) -> None:
        if os.getpid() == main_pid:
            raise KeyboardInterrupt  # LitServer shuts its workers down on KeyboardInterrupt
        raise SystemExit(0)  # a forked HTTP worker that LitServer is terminating: exit quietly

    signal.signal(signal.SIGTERM, stop)
    server.run(
        host=args.host, port=args.port, num_api_servers=1, generate_client_file=False, log_level=args.log_level
    )
