"""``elr prepare``: its parser and its entry point, which runs :func:`~elr_lightning.data.prepare.prepare_corpus`."""

from __future__ import annotations

from elr_lightning.arguments import CommandParser, command_parser
from elr_lightning.data.prepare import SHARD_BYTES, prepare_corpus


def prepare_parser() -> CommandParser:
    """The parser of ``elr prepare``."""
    parser = command_parser(
        "prepare",
        "Tokenise text, .jsonl[.gz|.zst] or parquet files into a prepared folder.",
        deprecated={"--text-field": "--text_field", "--val-fraction": "--val_fraction", "--shard-mb": "--shard_mb"},
    )
    parser.add_argument("sources", type=str, nargs="+", help="Files, folders or globs.")
    parser.add_argument("--out", type=str, required=True, help="The prepared folder (rerun to resume).")
    parser.add_argument("--tokenizer", type=str, default="byte", help="'byte' or a HF tokenizer.json.")
    parser.add_argument("--workers", type=int, default=1, help="Tokenising processes.")
    parser.add_argument("--text_field", type=str, default="text", help="JSON key or parquet column of the text.")
    parser.add_argument("--val_fraction", type=float, default=0.01, help="Share of documents held out.")
    parser.add_argument(
        "--shard_mb",
        type=float,
        default=SHARD_BYTES / 2**20,
        help="Input MiB per shard; larger files are cut into spans of this size, which bounds a worker's memory.",
    )
    return parser


def prepare_command(argv: list[str]) -> None:
    """``elr prepare SOURCES... --out DIR``: parse the arguments and run :func:`prepare_corpus`."""
    args = prepare_parser().parse_args(argv)
    index = prepare_corpus(
        args.sources,
        args.out,
        tokenizer=args.tokenizer,
        workers=args.workers,
        text_field=args.text_field,
        val_fraction=args.val_fraction,
        shard_bytes=int(args.shard_mb * 2**20),
    )
    print(
        f"{args.out}: {len(index['shards'])} shard(s), {index['train_tokens']} training and "
        f"{index['val_tokens']} validation tokens"
    )
