"""The ``elr`` command: ELR's own tools (:data:`EXTRA_COMMANDS`) and LightningCLI's ``fit | validate | test``.

Every subcommand follows one convention (:mod:`elr_lightning.arguments`) and reports a mistake in
one line, ``elr <command>: error: ...``, with exit status 1 (:mod:`elr_lightning.errors`).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import warnings
from typing import Any, Callable, Optional

import torch

from elr_lightning.arguments import nearest
from elr_lightning.errors import DEBUG_ENV, DEBUG_FLAG, debug_requested, report_errors


@dataclasses.dataclass(frozen=True)
class Command:
    """One of ELR's own subcommands, imported when it runs (some need an optional extra).

    Attributes:
        summary: Its line in ``elr --help``.
        module: The module that holds it.
        run: The name of its function of the arguments after the subcommand.
        parser: The name of its function that builds its parser (a
            :func:`~elr_lightning.arguments.command_parser`).
        needs: What to install when the module cannot be imported and its own error does not say
            (``elr_lightning.eval`` names its extra itself).
    """

    summary: str
    module: str
    run: str
    parser: str
    needs: str = ""

    def load(self, name: str) -> Any:
        """The command's module.

        Raises:
            ImportError: It needs something not installed, naming what to install.
        """
        try:
            return importlib.import_module(self.module)
        except ImportError as err:
            raise ImportError(f"{err}; elr {name} needs {self.needs}" if self.needs else str(err)) from None

    def make_parser(self, name: str) -> Any:
        """The command's parser, as it parses the command line."""
        return getattr(self.load(name), self.parser)()


#: ELR's subcommands, in the order ``elr --help`` lists them.
EXTRA_COMMANDS: dict[str, Command] = {
    "generate": Command(
        "stream a continuation of a prompt at any loop count k, or auto (depth per token)",
        "elr_lightning.inference.command", "generate_command", "generate_parser",
    ),
    "eval": Command(
        "accuracy at every k: lm-evaluation-harness tasks, or a depth task's exact match",
        "elr_lightning.eval.command", "eval_command", "eval_parser",
    ),
    "eval-tasks": Command(
        "build the offline data of elr eval's local tasks",
        "elr_lightning.eval.command", "eval_tasks_command", "eval_tasks_parser",
    ),
    "cost": Command(
        "parameters, FLOPs and KV memory per k of a config (eq. 1, 3 and 5)",
        "elr_lightning.estimate.cost", "main", "cost_parser",
    ),
    "estimate": Command(
        "per-rank peak training memory per k, and the largest micro-batch that fits",
        "elr_lightning.estimate.command", "main", "estimate_parser", "torch >= 2.6 (torch.distributed._tools)",
    ),
    "serve": Command(
        "OpenAI-compatible completions server, k (or auto) per request",
        "elr_lightning.serve.command", "serve_command", "serve_parser",
    ),
    "ablate": Command(
        "train the paper's ablation arms on a config and check its claims",
        "elr_lightning.ablate.command", "ablate_command", "ablate_parser",
    ),
    "prepare": Command(
        "tokenise a corpus into a prepared folder, in parallel",
        "elr_lightning.data.command", "prepare_command", "prepare_parser",
    ),
    "export": Command(
        "write a checkpoint as a Hugging Face folder (safetensors + remote code)",
        "elr_lightning.hf.export", "export_command", "export_parser",
    ),
    "import": Command(
        "turn an elr export folder back into a checkpoint",
        "elr_lightning.hf.export", "import_command", "import_parser",
    ),
    "retrofit": Command(
        "turn a pretrained Llama, Mistral or Qwen model into an ELR checkpoint and config",
        "elr_lightning.hf.retrofit", "retrofit_command", "retrofit_parser",
    ),
    "upgrade-checkpoint": Command(
        "convert a checkpoint of an earlier version (pickled plug-ins), once",
        "elr_lightning.checkpoints.upgrade", "upgrade_command", "upgrade_parser",
    ),
}  # fmt: skip

#: LightningCLI's subcommands that ``elr`` runs, each with its line in ``elr --help``.
LIGHTNING_COMMANDS: dict[str, str] = {
    "fit": "train from a config: --config FILE, --section.field overrides, --ckpt_path to resume",
    "validate": "validation loss and bits per byte at every k of val_loops, from --ckpt_path",
    "test": "the same as validate, on the data module's test split (the text data modules: the held-out split)",
}


def help_text() -> str:
    """``elr --help``: ELR's commands first, one line each, then Lightning's."""
    width = max(map(len, [*EXTRA_COMMANDS, *LIGHTNING_COMMANDS])) + 2
    lines = [
        "usage: elr COMMAND [options]      elr COMMAND --help lists a command's options",
        "",
        "Elastic Latent Recurrence: a looped language model trained once, run at any loop count k.",
        "",
        "ELR commands:",
        *(f"  {name:<{width}}{command.summary}" for name, command in EXTRA_COMMANDS.items()),
        "",
        "Lightning commands (LightningCLI):",
        *(f"  {name:<{width}}{summary}" for name, summary in LIGHTNING_COMMANDS.items()),
        "",
        f"{DEBUG_FLAG} (or {DEBUG_ENV}=1) shows the traceback of a failure.",
    ]
    return "\n".join(lines)


def main(args: Optional[list[str]] = None) -> None:
    """Entry point of the ``elr`` console script.

    A failure prints one line naming the field or file and exits with status 1; ``--debug`` (or
    ``ELR_DEBUG=1``) shows the traceback instead (see :mod:`elr_lightning.errors`).
    """
    debug, argv = debug_requested(sys.argv[1:] if args is None else list(args))
    if args is None:
        sys.argv[1:] = argv  # Lightning's launchers re-run sys.argv for the other ranks
    command = argv[0] if argv and (argv[0] in EXTRA_COMMANDS or argv[0] in LIGHTNING_COMMANDS) else None
    with report_errors(debug, command=command):
        run(argv if args is not None else None)


def run(args: Optional[list[str]] = None) -> None:
    """Run one ``elr`` command (``args``, else ``sys.argv[1:]``); exceptions propagate to ``main``.

    Raises:
        ValueError: No command, or one that is neither ELR's nor Lightning's (naming the nearest).
    """
    from elr_lightning.lightning_cli import ELRCLI, make_cli

    argv = sys.argv[1:] if args is None else list(args)
    torch.set_flush_denormal(True)  # subnormals slowed CPU backward passes several-fold mid-run
    # Lightning's own use of a deprecated torch pytree API; nothing a user can act on.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    name = argv[0] if argv else None
    if name in EXTRA_COMMANDS:
        command = EXTRA_COMMANDS[name]
        runner: Callable[[list[str]], None] = getattr(command.load(name), command.run)
        runner(argv[1:])
        return
    if name in ("-h", "--help"):
        print(help_text())
        return
    if name not in LIGHTNING_COMMANDS:
        known = [*EXTRA_COMMANDS, *LIGHTNING_COMMANDS]
        found = nearest(name, known) if name else None
        what = "no command given" if name is None else f"{name!r} is not a command"
        hint = f"; did you mean {found}?" if found else "; elr --help lists them"
        if name is None:
            print(help_text(), file=sys.stderr)
        raise ValueError(what + hint)
    make_cli(ELRCLI, args)


if __name__ == "__main__":
    main()
