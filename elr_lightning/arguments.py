"""The one command-line convention of every ``elr`` subcommand, in the parser they all share.

* **Flags are snake_case**, as LightningCLI's are (``--ckpt_path``, ``--trainer.max_steps``).
* **A switch is** ``--name`` **to turn it on and** ``--no_name`` **to turn it off** (:func:`add_switch`).
* **Loop counts share one grammar**: ``3``, ``1,2,3``, ``1-4``, ``auto``
  (:class:`~elr_lightning.loop_points.LoopSpec`, :func:`add_loops`); each command says which forms it takes.
* **No prefix matching**: ``--max_step`` is not taken for ``--max_steps``. An unknown option is an
  error that names the nearest valid one (:class:`SuggestingParser`, which ``elr fit`` and the other
  Lightning subcommands use too).
* **Old spellings keep working for one release** (:attr:`CommandParser.deprecated`), each with a
  one-line notice on stderr naming the new one.

A parse error is raised, not printed: ``elr`` prints it as one line, ``elr <command>: error: ...``
(:mod:`elr_lightning.errors`).
"""

from __future__ import annotations

import difflib
import re
import sys
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn, Optional

from jsonargparse import ActionYesNo, ArgumentParser
from jsonargparse.typing import register_type

from elr_lightning.loop_points import LoopSpec

__all__ = [
    "CommandParser",
    "SuggestingParser",
    "add_loops",
    "add_switch",
    "command_parser",
    "deprecation_notice",
    "nearest",
]

register_type(LoopSpec, serializer=str, deserializer=LoopSpec)

#: The values a switch of an earlier release took as ``--name true``; each is now ``--name`` or ``--no_name``.
_SWITCH_VALUES = {"true": True, "yes": True, "false": False, "no": False}

_UNRECOGNIZED = re.compile(r"unrecognized arguments: (-{1,2}[^\s=]+)")
_NOT_ACCEPTED = re.compile(r"^Option '([^']+)' is not accepted$")
_GROUP_KEY = re.compile(r"^Group '([^']+)' does not accept option '([^']+)'$")
_SUBCOMMAND_KEY = re.compile(r"^Subcommand '([^']+)' does not accept option '([^']+)'$")


def _initials(name: str) -> str:
    """``--learning_rate`` -> ``lr``: the first letters of the words of a snake_case name."""
    return "".join(word[0] for word in name.lstrip("-").split("_") if word)


def nearest(name: str, choices: Iterable[str]) -> Optional[str]:
    """The choice closest to ``name`` (a misspelt option or command), if any is close.

    Close is a similar spelling (``max_step``, ``max_steps``), or one name being the initials of the
    other's words (``learning_rate``, ``lr``).
    """
    choices = list(choices)
    found = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    if found:
        return found[0]
    short = [c for c in choices if "_" not in name.lstrip("-") or "_" not in c.lstrip("-")]
    return next((c for c in short if _initials(c) == name.lstrip("-") or _initials(name) == c.lstrip("-")), None)


class SuggestingParser(ArgumentParser):
    """A jsonargparse parser whose error for an unknown option names the nearest valid one.

    ``--trainer.max_step 20`` gets ``unrecognized arguments: --trainer.max_step 20; did you mean
    --trainer.max_steps?``, and an init argument a class does not take (``--model.init_args.learning_rate``)
    gets ``Option 'learning_rate' is not accepted; did you mean lr?``. jsonargparse builds the parser of a
    ``class_path``'s arguments with the class of its parent, so those suggestions come from this class too.
    """

    def error(self, message: str, ex: Optional[Exception] = None) -> NoReturn:
        """Raise (``exit_on_error=False``) or print ``message``, with the nearest valid option when one is unknown."""
        if "did you mean" not in message:
            message += self._suggestion(message)
        super().error(message, ex)

    def _suggestion(self, message: str) -> str:
        option = _UNRECOGNIZED.search(message)
        if option:
            found = nearest(option.group(1), self._option_string_actions)
            return f"; did you mean {found}?" if found else f"; {self.prog} --help lists the options"
        keys = [action.dest for action in self._actions if action.dest != "help"]
        key = _NOT_ACCEPTED.match(message)
        if key:
            found = nearest(key.group(1), keys)
            return f"; did you mean {found}?" if found else ""
        group = _GROUP_KEY.match(message)
        if group:
            prefix = group.group(1) + "."
            found = nearest(group.group(2), [k[len(prefix) :] for k in keys if k.startswith(prefix)])
            return f"; did you mean {prefix}{found}?" if found else ""
        sub = _SUBCOMMAND_KEY.match(message)
        if sub and self._subcommands_action is not None:
            parser = self._subcommands_action._name_parser_map.get(sub.group(1))
            if parser is not None:
                found = nearest(sub.group(2), [a.dest for a in parser._actions])
                return f"; did you mean {found}?" if found else ""
        return ""


def deprecation_notice(prog: str, old: str, new: str) -> None:
    """Print the one-line notice that ``old`` (a spelling of an earlier release) is now ``new``."""
    print(f"{prog}: warning: {old} is deprecated and goes in the next release; write {new}", file=sys.stderr)


class CommandParser(SuggestingParser):
    """The parser of one ``elr`` subcommand (made by :func:`command_parser`).

    Attributes:
        deprecated: Old spellings and the new one each stands for, e.g. ``{"--val-fraction": "--val_fraction"}``;
            read for one release, each with a notice.
        loop_forms: For each option added by :func:`add_loops`, ``(takes_several, takes_auto)``.
        legacy_switches: Switches that an earlier release spelt ``--name true|false``.
        legacy_lists: Comma-separated options that an earlier release spelt as a list, ``[1, 2]``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.deprecated: dict[str, str] = {}
        self.loop_forms: dict[str, tuple[bool, bool]] = {}
        self.legacy_switches: set[str] = set()
        self.legacy_lists: set[str] = set()

    def parse_args(self, args: Optional[Sequence[str]] = None, *rest: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """Parse ``args`` after rewriting old spellings (with a notice each); check the ``--loops`` forms.

        Raises:
            argparse.ArgumentError: An unknown option (naming the nearest valid one) or a bad value.
            ValueError: A loop option given a form its command does not take.
        """
        parsed = super().parse_args(self.modernise(list(sys.argv[1:] if args is None else args)), *rest, **kwargs)
        for option, (several, auto) in self.loop_forms.items():
            spec = parsed.get(option.lstrip("-"))
            if spec is None:
                continue
            if spec.auto and not auto:
                raise ValueError(f"{option} {spec}: {self.prog} has no adaptive depth; give loop counts, e.g. {option} 1-4")
            if not several:
                spec.single  # noqa: B018 - raises for several values
        return parsed

    def modernise(self, argv: list[str]) -> list[str]:
        """``argv`` with each old spelling (:attr:`deprecated`, ``--switch true|false``, ``--loops [1, 2]``)
        replaced by the current one, and a notice printed for each."""
        out: list[str] = []
        i = 0
        while i < len(argv):
            token = argv[i]
            i += 1
            if token == "--":
                out += argv[i - 1 :]
                break
            name, eq, value = token.partition("=")
            if name in self.deprecated:
                deprecation_notice(self.prog, name, self.deprecated[name])
                name = self.deprecated[name]
            if name in self.legacy_switches:
                if not eq and i < len(argv) and argv[i].lower() in _SWITCH_VALUES:
                    value, i = argv[i], i + 1
                if value:
                    new = name if _SWITCH_VALUES.get(value.lower(), True) else "--no_" + name[2:]
                    deprecation_notice(self.prog, f"{name} {value}", new)
                    out.append(new)
                    continue
            listed = value if eq else (argv[i] if i < len(argv) else "")
            if name in self.legacy_lists and listed.lstrip().startswith("["):
                i += 0 if eq else 1
                new = ",".join(part.strip() for part in listed.strip(" []").split(","))
                deprecation_notice(self.prog, f"{name} {listed}", f"{name} {new}")
                name, eq, value = name, "=", new
            out.append(name + eq + value)
        return out


def command_parser(command: str, description: str, deprecated: Optional[dict[str, str]] = None) -> CommandParser:
    """The parser of ``elr <command>``: errors raised (``elr`` prints them in one line), no prefix matching.

    Args:
        command: The subcommand, e.g. ``"generate"``.
        description: What the command does, for ``--help``.
        deprecated: Old option spellings and their new ones (:attr:`CommandParser.deprecated`).
    """
    parser = CommandParser(prog=f"elr {command}", description=description, exit_on_error=False, allow_abbrev=False)
    parser.deprecated.update(deprecated or {})
    return parser


def add_switch(parser: ArgumentParser, name: str, default: Optional[bool], help: str, was_bool: bool = False) -> None:
    """Add the switch ``--name`` / ``--no_name`` to ``parser``.

    Args:
        parser: A :func:`command_parser`.
        name: The option, e.g. ``"--stats"``.
        default: Its value when neither form is given (``None``: the command decides).
        help: What turning it on does.
        was_bool: An earlier release spelt it ``--name true|false``; that spelling is read for one
            more release, with a notice.
    """
    parser.add_argument(name, action=ActionYesNo, default=default, help=help)
    if was_bool and isinstance(parser, CommandParser):
        parser.legacy_switches.add(name)


def add_loops(
    parser: ArgumentParser,
    help: str,
    default: Optional[str] = None,
    several: bool = True,
    auto: bool = False,
    name: str = "--loops",
) -> None:
    """Add a loop option in the one grammar (:class:`~elr_lightning.loop_points.LoopSpec`) to ``parser``.

    Args:
        parser: A :func:`command_parser`.
        help: What the loop counts select.
        default: The default in the grammar (``"1"``), or ``None``: the command decides.
        several: Whether the command takes several counts (``1,2,3``, ``1-4``) or one.
        auto: Whether it takes ``auto`` (adaptive depth per token).
        name: The option.
    """
    forms = ("3, 1,2,3 or 1-4" if several else "a count such as 3") + (", auto" if auto else "")
    parser.add_argument(
        name,
        type=Optional[LoopSpec],
        default=None if default is None else LoopSpec(default),
        help=f"{help} ({forms}).",
    )
    if isinstance(parser, CommandParser):
        parser.loop_forms[name] = (several, auto)
        parser.legacy_lists.add(name)
