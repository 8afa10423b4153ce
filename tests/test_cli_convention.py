"""Every ``elr`` subcommand follows one command-line convention (:mod:`elr_lightning.arguments`).

The walk over every subcommand's parser (ELR's and Lightning's) fails on a flag that is not snake_case,
on a ``--loops`` that is not the shared grammar, and on an abbreviation that is accepted; the other
tests check the old spellings, the ``--loops`` grammar, the suggestions for unknown options, the
one-line errors and ``elr --help``.
"""

from __future__ import annotations

import importlib
import re
import socket
from argparse import ArgumentError
from pathlib import Path
from typing import Any, Optional

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elr_lightning.arguments import CommandParser, SuggestingParser, nearest
from elr_lightning.cli import EXTRA_COMMANDS, LIGHTNING_COMMANDS, help_text, main
from elr_lightning.lightning_cli import ELRCLI, make_cli
from elr_lightning.loop_points import LoopSpec

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "config" / "quickstart.yaml")

#: The one flag style: ``-h``, ``-c`` (Lightning's ``--config``), else snake_case words, dotted for nested
#: fields, ``+`` after a list field of Lightning's that appends (``--trainer.callbacks+``).
FLAG = re.compile(r"-[hc]|--[a-z][a-z0-9]*(_[a-z0-9]+)*(\.[a-z][a-z0-9_]*)*\+?")

#: The commands that take loop counts, and the forms each takes: (several, auto).
LOOP_FORMS = {
    "generate": (False, True),
    "eval": (True, True),
    "cost": (True, False),
    "estimate": (True, False),
    "serve": (False, True),
    "ablate": (True, False),
}


class _Built(Exception):
    """Raised by :class:`_Probe` with the parser LightningCLI built, before it parses anything."""


class _Probe(ELRCLI):
    def parse_arguments(self, parser: Any, args: Any) -> None:
        raise _Built(parser)


def _lightning_parsers() -> dict[str, SuggestingParser]:
    try:
        make_cli(_Probe, ["fit"])
    except _Built as built:
        return dict(built.args[0]._subcommands_action._name_parser_map)
    raise AssertionError("LightningCLI parsed without building its parser")


PARSERS: dict[str, SuggestingParser] = {name: command.make_parser(name) for name, command in EXTRA_COMMANDS.items()}
PARSERS.update(_lightning_parsers())


def _options(parser: SuggestingParser) -> list[str]:
    return [option for action in parser._actions for option in action.option_strings]


def test_every_subcommand_has_a_parser_of_the_convention() -> None:
    assert set(PARSERS) == set(EXTRA_COMMANDS) | set(LIGHTNING_COMMANDS)
    for name, parser in PARSERS.items():
        assert isinstance(parser, SuggestingParser) and not parser.allow_abbrev, name
        assert isinstance(parser, CommandParser) == (name in EXTRA_COMMANDS), name
        assert parser.exit_on_error is False, name  # errors reach `elr`, which prints them in one line


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_flags_are_snake_case(name: str) -> None:
    bad = [option for option in _options(PARSERS[name]) if not FLAG.fullmatch(option)]
    assert not bad, f"elr {name}: {bad} are not snake_case"


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_loop_options_are_the_shared_grammar(name: str) -> None:
    parser = PARSERS[name]
    loops = [a for a in parser._actions if a.dest == "loops" or a.dest.endswith(".loops")]
    if name not in LOOP_FORMS:
        assert not loops, name
        return
    (action,) = loops
    assert getattr(action, "_typehint", None) == Optional[LoopSpec], f"elr {name} --loops is not the shared parser"
    assert isinstance(parser, CommandParser) and parser.loop_forms == {"--loops": LOOP_FORMS[name]}


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_no_abbreviation_is_accepted(name: str) -> None:
    parser = PARSERS[name]
    options = _options(parser)
    deprecated = set(getattr(parser, "deprecated", {}))
    tried = 0
    for option in options:
        short = option[:-1]
        if len(short) < 4 or short in options or short in deprecated:
            continue
        tried += 1
        with pytest.raises(ArgumentError) as refused:
            parser.parse_args([short, "1"])
        message = str(refused.value)
        assert short.rsplit(".", 1)[-1].lstrip("-") in message, message
        if "unrecognized arguments" in message:
            assert "did you mean" in message, message
    assert tried


@pytest.mark.parametrize("name", sorted(n for n in EXTRA_COMMANDS if PARSERS[n].deprecated))
def test_old_spellings_parse_as_the_new_ones_with_one_notice(name: str, capsys) -> None:
    parser = PARSERS[name]
    for old, new in parser.deprecated.items():
        assert parser.modernise([old, "2"]) == [new, "2"] and parser.modernise([f"{old}=2"]) == [f"{new}=2"]
        notice = capsys.readouterr().err.splitlines()
        assert notice == [f"elr {name}: warning: {old} is deprecated and goes in the next release; write {new}"] * 2


@pytest.mark.parametrize("name", sorted(n for n in EXTRA_COMMANDS if PARSERS[n].legacy_switches))
def test_old_switch_values_become_the_switch(name: str, capsys) -> None:
    parser = PARSERS[name]
    for switch in parser.legacy_switches:
        assert parser.modernise([switch, "true"]) == [switch]
        assert parser.modernise([f"{switch}=False"]) == ["--no_" + switch[2:]]
        assert parser.modernise([switch, "--other"]) == [switch, "--other"]  # the switch alone is the new form
        assert len(capsys.readouterr().err.splitlines()) == 2


def test_old_list_spellings_become_comma_lists(capsys) -> None:
    parser = PARSERS["estimate"]
    assert parser.modernise(["--loops", "[1, 3]", "--modes=[none, layer]"]) == ["--loops=1,3", "--modes=none,layer"]
    assert len(capsys.readouterr().err.splitlines()) == 2


def test_the_counted_old_spellings() -> None:
    """What an earlier release's users typed: 3 kebab-case flags, 2 renamed serve flags, 6 ``true|false`` switches,
    and ``[a, b]`` lists (``--loops`` of cost, estimate and ablate, ``--modes``)."""
    renamed = {old for parser in PARSERS.values() for old in getattr(parser, "deprecated", {})}
    switches = {(name, s) for name, parser in PARSERS.items() for s in getattr(parser, "legacy_switches", ())}
    assert renamed == {"--text-field", "--val-fraction", "--shard-mb", "--loops_default", "--loops_max"}
    assert len(switches) == 6


@given(st.lists(st.integers(1, 40), min_size=1, max_size=6), st.booleans())
def test_loop_spec_reads_lists_ranges_and_auto(counts: list[int], auto: bool) -> None:
    lo, hi = min(counts), max(counts)
    text = ",".join([*map(str, counts), f"{lo}-{hi}", *(["auto"] if auto else [])])
    spec = LoopSpec(text)
    assert spec.counts == tuple(range(lo, hi + 1)) and spec.auto == auto
    assert LoopSpec(str(spec)) == spec  # the normal form reads back


@pytest.mark.parametrize("text", ["0", "x", "3-1", "1,,2", "-1", "1.5", "aut"])
def test_loop_spec_refuses_what_is_not_the_grammar(text: str) -> None:
    with pytest.raises(ValueError, match="--loops"):
        LoopSpec(text)


def test_a_single_count_command_refuses_several(capsys) -> None:
    with pytest.raises(ValueError, match=r"--loops 1,2: give one loop count or auto"):
        PARSERS["generate"].parse_args(["--ckpt_path", "x", "--loops", "1,2"])
    with pytest.raises(ValueError, match=r"--loops auto: elr cost has no adaptive depth"):
        PARSERS["cost"].parse_args(["--config", "x", "--loops", "auto"])


@pytest.mark.parametrize(
    "name, choices, expected",
    [("max_step", ["max_steps", "min_steps"], "max_steps"), ("learning_rate", ["lr", "weight_decay"], "lr"),
     ("wd", ["lr", "weight_decay"], "weight_decay"), ("fitt", ["fit", "test"], "fit"), ("zzz", ["fit"], None)],
)  # fmt: skip
def test_nearest(name: str, choices: list[str], expected: Optional[str]) -> None:
    assert nearest(name, choices) == expected


@pytest.mark.parametrize(
    "argv, line",
    [
        (["fit", "--config", QUICKSTART, "--trainer.max_step", "20"],
         "elr fit: error: unrecognized arguments: --trainer.max_step 20; did you mean --trainer.max_steps?"),
        (["fit", "--config", QUICKSTART, "--model.init_args.learning_rate", "0.1"],
         "elr fit: error: model: Option 'learning_rate' is not accepted; did you mean lr?"),
        (["cost", "--config", QUICKSTART, "--loop", "2"],
         "elr cost: error: unrecognized arguments: --loop 2; did you mean --loops?"),
        (["cost", "--config", QUICKSTART, "--loops", "1,x"],
         "elr cost: error: --loops '1,x': 'x' is not a loop count; write e.g. --loops 1,2,4 or 1-4"),
        (["fitt"], "elr: error: 'fitt' is not a command; did you mean fit?"),
    ],
)  # fmt: skip
def test_a_mistake_is_one_line_in_the_command_prefix(argv: list[str], line: str, monkeypatch, capsys) -> None:
    monkeypatch.delenv("ELR_DEBUG", raising=False)
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 1
    assert capsys.readouterr().err.strip().splitlines() == [line]


def test_serve_refuses_a_port_in_use_before_loading_anything(monkeypatch, capsys) -> None:
    monkeypatch.delenv("ELR_DEBUG", raising=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        if port < 1024:
            pytest.skip("the system gave a privileged port")
        with pytest.raises(SystemExit) as stop:
            main(["serve", "--ckpt_path", "missing.ckpt", "--port", str(port)])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 1 and len(err) == 1
    assert err[0].startswith(f"elr serve: error: --port {port} on 127.0.0.1 is in use") and "another --port" in err[0]


def test_help_lists_elr_commands_first_then_lightnings(capsys) -> None:
    main(["--help"])
    out = capsys.readouterr().out
    assert out == help_text() + "\n"
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("  ")]
    assert listed == [*EXTRA_COMMANDS, *LIGHTNING_COMMANDS]
    assert all(len(line) <= 120 for line in out.splitlines())


#: Commands whose module is not yet their package's ``command`` module: the memory tools (moving into an
#: estimate/ package), the Hugging Face trio (hf/export.py and hf/retrofit.py) and the checkpoint upgrade.
NOT_YET_COMMAND_MODULES = {"cost", "estimate", "export", "import", "retrofit", "upgrade-checkpoint"}


def test_every_elr_command_lives_in_its_packages_command_module() -> None:
    """``cli.EXTRA_COMMANDS`` is the one index; each entry points at ``elr_lightning.<package>.command``."""
    for name, command in EXTRA_COMMANDS.items():
        if name in NOT_YET_COMMAND_MODULES:
            continue
        assert command.module.startswith("elr_lightning.") and command.module.endswith(".command"), (name, command.module)
        assert callable(getattr(importlib.import_module(command.module), command.run)), name
    assert NOT_YET_COMMAND_MODULES <= set(EXTRA_COMMANDS)
