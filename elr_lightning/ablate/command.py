"""``elr ablate``: its parser and its entry point, which checks the arguments and runs :func:`run_ablation`."""

from __future__ import annotations

from typing import Optional

from elr_lightning.ablate.run import ARMS, run_ablation
from elr_lightning.arguments import CommandParser, add_loops, add_switch, command_parser


def ablate_parser() -> CommandParser:
    """The parser of ``elr ablate``."""
    parser = command_parser(
        "ablate",
        "Train the paper's ablation arms on one config (same data order and seed); write a Markdown table with the "
        "paper's checks, a loss-vs-k plot and one TensorBoard run per arm.",
    )
    parser.add_argument(
        "--config",
        type=str,
        action="append",
        required=True,
        help="An `elr fit` YAML file; several are merged as `elr fit` merges them (e.g. a callbacks fragment).",
    )
    parser.add_argument("--out", type=str, required=True, help="Output folder; rerun with the same one to resume.")
    parser.add_argument("--arms", type=Optional[str], default=None, help=f"Comma-separated subset of: {', '.join(ARMS)}.")
    parser.add_argument("--steps", type=Optional[int], default=None, help="trainer.max_steps of every arm.")
    parser.add_argument("--seeds", type=str, default="0", help="Comma-separated seeds; each arm runs once per seed.")
    add_loops(parser, "Loop counts every arm validates at (the baseline: k = 1); default the config's val_loops")
    add_switch(parser, "--subprocess", False, "Run each arm as its own `elr fit` process.", was_bool=True)
    parser.add_argument(
        "--reasoning",
        type=Optional[int],
        default=None,
        help="Score each arm's exact match on this many held-out reasoning instances per task and level.",
    )
    parser.add_argument(
        "--depth",
        type=Optional[int],
        default=None,
        help="Depth-task configs: score each arm's exact match on this many held-out instances per difficulty.",
    )
    return parser


def ablate_command(argv: list[str]) -> None:
    """``elr ablate --config F --out DIR [--arms a,b] [--steps N] [--seeds 0,1] [--loops 1-3] [--subprocess] [--reasoning N]``."""
    args = ablate_parser().parse_args(argv)
    arms = None if args.arms is None else [a.strip() for a in args.arms.split(",") if a.strip()]
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--seeds={args.seeds!r} must be comma-separated integers, e.g. 0,1") from None
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps={args.steps} must be >= 1")
    if args.reasoning is not None and args.reasoning < 1:
        raise ValueError(f"--reasoning={args.reasoning} must be >= 1 held-out instances per level")
    if args.depth is not None and args.depth < 1:
        raise ValueError(f"--depth={args.depth} must be >= 1 held-out instances per difficulty")
    config = args.config[0] if len(args.config) == 1 else args.config
    loops = None if args.loops is None else list(args.loops.counts)
    run_ablation(config, args.out, arms, args.steps, seeds, subprocesses=args.subprocess, reasoning=args.reasoning,
                 depth=args.depth, loops=loops)  # fmt: skip
