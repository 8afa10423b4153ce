"""The ``elr`` command: LightningCLI's ``fit | validate | test | predict`` plus ELR's own tools."""

from __future__ import annotations

import sys
import warnings
from typing import Callable, Optional

import torch
from lightning.pytorch.cli import LightningCLI
from typing_extensions import override

from elr_lightning.ablate import main as ablate_main
from elr_lightning.cost import main as cost_main
from elr_lightning.data import TextDataModule, resolve_sources
from elr_lightning.generation import generate_command
from elr_lightning.module import ELRModule
from elr_lightning.tokenizers import load_tokenizer


class ELRCLI(LightningCLI):
    """LightningCLI with ELR's defaults: subclassable model and data by ``class_path``, seed 0."""

    @override
    def before_instantiate_classes(self) -> None:
        """Check data paths before the model is built, so a typo fails in seconds, not after allocating."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        init_args = config.get("data", {}).get("init_args", {}) or {}
        if "sources" in init_args:
            resolve_sources(init_args["sources"])
        if "tokenizer" in init_args:
            load_tokenizer(init_args["tokenizer"])


#: Subcommands that are not Lightning's; each takes the remaining arguments.
EXTRA_COMMANDS: dict[str, Callable[[list[str]], None]] = {
    "ablate": ablate_main,
    "cost": cost_main,
    "generate": generate_command,
}


def main(args: Optional[list[str]] = None) -> None:
    """Entry point of the ``elr`` console script."""
    torch.set_flush_denormal(True)  # subnormals slowed CPU backward passes several-fold mid-run
    # Lightning's own use of a deprecated torch pytree API; nothing a user can act on.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    argv = sys.argv[1:] if args is None else list(args)
    if argv and argv[0] in EXTRA_COMMANDS:
        EXTRA_COMMANDS[argv[0]](argv[1:])
        return
    if not argv or argv[0] in ("-h", "--help"):
        print(f"ELR commands besides Lightning's: {', '.join(sorted(EXTRA_COMMANDS))} (elr COMMAND --help)")
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
