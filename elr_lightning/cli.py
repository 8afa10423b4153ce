"""The ``elr`` command: LightningCLI's ``fit | validate | test | predict`` plus ELR's own tools."""

from __future__ import annotations

import sys
import warnings
from typing import Any, Callable, Optional

import torch

from elr_lightning.ablate import main as ablate_main
from elr_lightning.cost import main as cost_main
from elr_lightning.data.prepare import prepare_command
from elr_lightning.errors import DEBUG_ENV, DEBUG_FLAG, debug_requested, report_errors
from elr_lightning.generate_cli import generate_command
from elr_lightning.hf.export import export_command, import_command
from elr_lightning.hf.retrofit import retrofit_command
from elr_lightning.lightning_cli import ELRCLI, make_cli
from elr_lightning.serve.command import serve_command
from elr_lightning.upgrade import upgrade_command


def _eval_module() -> Any:
    try:  # lm-eval is an optional extra: imported when used
        from elr_lightning.eval import command
    except ImportError as err:
        raise SystemExit(f"elr eval: error: {err}") from None
    return command


def _estimate(argv: list[str]) -> None:
    try:  # torch's memory tools (torch.distributed._tools) are newer than the oldest torch we run on
        from elr_lightning.estimate_report import main as estimate_main
    except ImportError as err:
        raise SystemExit(f"elr estimate: error: {err}; it needs torch >= 2.6") from None
    estimate_main(argv)


def _eval(argv: list[str]) -> None:
    _eval_module().eval_command(argv)


def _eval_tasks(argv: list[str]) -> None:
    _eval_module().eval_tasks_command(argv)


#: Subcommands that are not Lightning's; each takes the remaining arguments.
EXTRA_COMMANDS: dict[str, Callable[[list[str]], None]] = {
    "ablate": ablate_main,
    "cost": cost_main,
    "estimate": _estimate,
    "eval": _eval,
    "eval-tasks": _eval_tasks,
    "export": export_command,
    "generate": generate_command,
    "import": import_command,
    "prepare": prepare_command,
    "retrofit": retrofit_command,
    "serve": serve_command,
    "upgrade-checkpoint": upgrade_command,
}


def main(args: Optional[list[str]] = None) -> None:
    """Entry point of the ``elr`` console script.

    A failure prints one line naming the field or file and exits with status 1; ``--debug`` (or
    ``ELR_DEBUG=1``) shows the traceback instead (see :mod:`elr_lightning.errors`).
    """
    debug, argv = debug_requested(sys.argv[1:] if args is None else list(args))
    if args is None:
        sys.argv[1:] = argv  # Lightning's launchers re-run sys.argv for the other ranks
    with report_errors(debug):
        run(argv if args is not None else None)


def run(args: Optional[list[str]] = None) -> None:
    """Run one ``elr`` command (``args``, else ``sys.argv[1:]``); exceptions propagate to ``main``."""
    argv = sys.argv[1:] if args is None else list(args)
    torch.set_flush_denormal(True)  # subnormals slowed CPU backward passes several-fold mid-run
    # Lightning's own use of a deprecated torch pytree API; nothing a user can act on.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    if argv and argv[0] in EXTRA_COMMANDS:
        EXTRA_COMMANDS[argv[0]](argv[1:])
        return
    if not argv or argv[0] in ("-h", "--help"):
        print(f"ELR commands besides Lightning's: {', '.join(sorted(EXTRA_COMMANDS))} (elr COMMAND --help)")
        print(f"{DEBUG_FLAG} (or {DEBUG_ENV}=1) shows the traceback of a failure")
    make_cli(ELRCLI, args)


if __name__ == "__main__":
    main()
