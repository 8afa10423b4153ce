"""The ``elr`` command: LightningCLI's ``fit | validate | test | predict`` plus ELR's own tools."""

from __future__ import annotations

import sys
from typing import Callable, Optional

import torch
from lightning.pytorch.cli import LightningCLI

from elr_lightning.data import TextDataModule
from elr_lightning.module import ELRModule


class ELRCLI(LightningCLI):
    """LightningCLI with ELR's defaults: subclassable model and data by ``class_path``, seed 0."""


#: Subcommands that are not Lightning's; each takes the remaining arguments.
EXTRA_COMMANDS: dict[str, Callable[[list[str]], None]] = {}


def main(args: Optional[list[str]] = None) -> None:
    """Entry point of the ``elr`` console script."""
    torch.set_flush_denormal(True)
    argv = sys.argv[1:] if args is None else list(args)
    if argv and argv[0] in EXTRA_COMMANDS:
        EXTRA_COMMANDS[argv[0]](argv[1:])
        return
    ELRCLI(
        ELRModule,
        TextDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
