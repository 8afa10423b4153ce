"""``elr upgrade-checkpoint OLD NEW --trust``: convert a checkpoint of an earlier version, running its code once.

Checkpoints of elr-lightning before plug-ins were saved as ``class_path`` + ``init_args`` hold the
plug-ins as pickled objects, which no loader of the library unpickles (:mod:`elr_lightning.checkpoints.safe_load`).
This command is the explicit, local way out for a file its owner made or trusts: it unpickles OLD
(running the code the file names) and creates NEW, which holds only tensors and plain data.
"""

from __future__ import annotations

import os
import sys

from elr_lightning.arguments import CommandParser, add_switch, command_parser
from elr_lightning.checkpoints.io import upgrade_checkpoint, verify_checkpoint_path
from elr_lightning.checkpoints.safe_load import UnsafeCheckpointError, load_weights_only
from elr_lightning.checkpoints.trust import TRUST_FLAG, named_packages


def upgrade_parser() -> CommandParser:
    """The parser of ``elr upgrade-checkpoint``."""
    parser = command_parser(
        "upgrade-checkpoint",
        "Convert a checkpoint of an earlier elr-lightning (plug-ins pickled as objects) into one that "
        "loads without running code. THIS RUNS CODE FROM OLD: unpickling calls whatever the file names, so use it "
        "only on a file you made or trust, and say so with --trust. NEW is created, never replaced; OLD is kept.",
    )
    parser.add_argument("old", type=str, help="The checkpoint to convert; its code runs.")
    parser.add_argument("new", type=str, help="The checkpoint to create; it must not exist.")
    add_switch(parser, "--trust", False, "You made or trust OLD: run the code it names to convert it.")
    return parser


def upgrade_command(argv: list[str]) -> None:
    """``elr upgrade-checkpoint OLD NEW --trust``.

    Raises:
        UnsafeCheckpointError: OLD holds pickled objects and ``--trust`` is not given.
        FileExistsError: NEW exists.
    """
    args = upgrade_parser().parse_args(argv)
    verify_checkpoint_path(args.old, "OLD")
    if os.path.lexists(args.new):
        raise FileExistsError(f"NEW {args.new!r} exists; elr upgrade-checkpoint never replaces a file, give a new path")
    try:
        load_weights_only(args.old)
    except UnsafeCheckpointError as err:
        if not args.trust:
            raise UnsafeCheckpointError(
                f"OLD {args.old!r} holds a pickled object ({err.refused}): converting it runs code from the file. "
                "Add --trust if you made or trust it",
                err.refused,
            ) from None
    else:
        print(f"elr: {args.old} already loads without running code; nothing to convert, {args.new} not written",
              file=sys.stderr)  # fmt: skip
        return
    upgrade_checkpoint(args.old, args.new, trust=True)
    print(f"wrote {args.new}: it loads without running code")
    packages = named_packages(load_weights_only(args.new).get("hyper_parameters"))
    if packages:
        print(f"it names plug-ins of {', '.join(packages)}: load it with {TRUST_FLAG} {','.join(packages)}")
