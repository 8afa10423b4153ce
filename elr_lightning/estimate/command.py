"""``elr estimate``'s command line: its parser and ``main``."""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

from elr_lightning.arguments import CommandParser, add_loops, add_switch, command_parser
from elr_lightning.estimate.cache import CACHE_ENV, default_cache_dir
from elr_lightning.estimate.report import MODES, EstimateInterrupted, format_memory_report, memory_report


def estimate_parser() -> CommandParser:
    """The parser of ``elr estimate``."""
    parser = command_parser(
        "estimate",
        "Per-rank peak memory of one training step of a config, for every k and backward setting, traced on fake "
        "tensors (nothing is allocated).",
    )
    parser.add_argument("--config", type=str, action="append", required=True, help="An `elr fit` YAML file; repeat to merge.")
    parser.add_argument("--devices", type=Optional[int], default=None, help="Devices per node (default: trainer.devices).")
    parser.add_argument("--num_nodes", type=Optional[int], default=None, help="Nodes (default: trainer.num_nodes).")
    parser.add_argument(
        "--strategy", type=Optional[str], default=None, help="single, ddp or fsdp instead of the config's trainer.strategy."
    )
    parser.add_argument(
        "--device_memory", type=Optional[str], default=None,
        help="Memory per device, e.g. 80GB or 79.6GiB; default: this machine's RAM for a CPU config, its first GPU's "
        "memory for a GPU one (80GB assumed without a GPU).",
    )  # fmt: skip
    parser.add_argument(
        "--headroom", type=Optional[float], default=None,
        help="Fraction of device memory held back; default 0.25 of CPU RAM (what glibc keeps), 0.10 of a GPU's "
        "(context, NCCL, caching allocator).",
    )  # fmt: skip
    parser.add_argument("--accelerator", type=Optional[str], default=None, help="cpu, gpu or auto: the run's device.")
    add_switch(parser, "--cpu_offload", None, "FSDP2's CPU offload instead of the strategy's init_args.cpu_offload.")
    parser.add_argument(
        "--host_memory", type=Optional[str], default=None,
        help="RAM per node for offloaded state, e.g. 2TB; default: this machine's where it has the GPU, else not checked.",
    )  # fmt: skip
    parser.add_argument("--micro_batch", type=Optional[int], default=None, help="Sequences per rank (default: data.batch_size).")
    parser.add_argument("--seq_len", type=Optional[int], default=None, help="Tokens per sequence (default: data.seq_len).")
    add_loops(parser, "Loop counts of the rows; default 1..K")
    parser.add_argument("--modes", type=str, default="none,loop,layer", help=f"Rows' backward settings, some of {','.join(MODES)}.")
    parser.legacy_lists.add("--modes")
    add_switch(parser, "--search", True, "Search the largest micro-batch that fits.", was_bool=True)
    add_switch(parser, "--conditioning", True, "Eq. 4 conditioning on (after the switch) or off.", was_bool=True)
    parser.add_argument(
        "--gdp_kernels", type=str, default="auto",
        help="GDP layers: fla (its kernels, as on a GPU), torch (chunked path), auto (fla in half precision).",
    )  # fmt: skip
    parser.add_argument(
        "--activation_checkpointing", type=Optional[str], default=None,
        help="The run's none, loop or layer instead of the config's (the verdict and search are about it).",
    )  # fmt: skip
    parser.add_argument("--backprop_loops", type=Optional[int], default=None, help="The run's instead of the config's.")
    add_switch(parser, "--json", False, "Print JSON instead of a table.", was_bool=True)
    add_switch(
        parser, "--exact", False,
        "Trace every step (minutes to hours for a large config) instead of extrapolating k past 4 from k = 3 and 4.",
    )  # fmt: skip
    parser.add_argument(
        "--workers", type=Optional[int], default=None,
        help="Processes tracing steps at once (default: this machine's cores, at most 4; 1: this process alone).",
    )  # fmt: skip
    parser.add_argument(
        "--cache_dir", type=Optional[str], default=None,
        help=f"Where traced steps are kept for later runs (default: ${CACHE_ENV}, else ~/.cache/elr-lightning/estimate).",
    )  # fmt: skip
    add_switch(parser, "--cache", True, "Read and keep traced steps in --cache_dir (--no_cache: trace every step).")
    return parser


def main(argv: list[str]) -> None:
    """``elr estimate --config FILE [--devices N] [--num_nodes M] [--device_memory 80GB] [--micro_batch B] [--exact]
    [--json]``; Ctrl-C prints the rows traced so far and exits with status 130."""
    args = estimate_parser().parse_args(argv)
    try:
        report = memory_report(
            args.config,
            devices=args.devices,
            num_nodes=args.num_nodes,
            strategy=args.strategy,
            device_memory=args.device_memory,
            headroom=args.headroom,
            micro_batch=args.micro_batch,
            seq_len=args.seq_len,
            loops=None if args.loops is None else list(args.loops.counts),
            modes=[mode.strip() for mode in args.modes.split(",") if mode.strip()],
            search=args.search,
            conditioning=args.conditioning,
            gdp_kernels=args.gdp_kernels,
            activation_checkpointing=args.activation_checkpointing,
            backprop_loops=args.backprop_loops,
            progress=sys.stderr,
            accelerator=args.accelerator,
            cpu_offload=args.cpu_offload,
            host_memory=args.host_memory,
            exact=args.exact,
            workers=args.workers if args.workers is not None else min(4, os.cpu_count() or 1),
            cache_dir=(args.cache_dir or default_cache_dir()) if args.cache else None,
        )
    except EstimateInterrupted as stop:
        print(json.dumps(stop.report, indent=2) if args.json else format_memory_report(stop.report))
        sys.exit(130)
    print(json.dumps(report, indent=2) if args.json else format_memory_report(report))


__all__ = ["estimate_parser", "main"]
