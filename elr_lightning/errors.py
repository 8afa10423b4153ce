"""How the ``elr`` command reports a failure: one readable line, the traceback only on request.

Every ``elr`` subcommand runs inside :func:`report_errors`. A mistake (a bad value, a missing or
damaged file, a diverged run) prints ``elr <command>: error: <message>`` on stderr and exits with
status 1; the message names the field or file and the fix. An exception that is not one of
:data:`USER_ERRORS` is most likely a bug: it prints its type and message and a second line that
says how to see the traceback. ``--debug`` anywhere on the command line, or ``ELR_DEBUG=1`` in the
environment, lets every exception through with its full traceback.

Errors that jsonargparse wraps (a value that fails a ``class_path``'s ``__init__``, a value of the
wrong type) are unwrapped to the message that names the field.
"""

from __future__ import annotations

import json
import os
import re
import sys
from argparse import ArgumentError
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

from lightning.fabric.utilities.exceptions import MisconfigurationException

#: The environment variable that, set to anything but ``""`` or ``"0"``, shows tracebacks.
DEBUG_ENV = "ELR_DEBUG"

#: The command-line flag that does the same (removed from the arguments before parsing).
DEBUG_FLAG = "--debug"

#: Exception types that describe a user's mistake; they are printed without a "bug" hint.
USER_ERRORS: tuple[type[BaseException], ...] = (
    ValueError, OSError, FloatingPointError, ArgumentError, LookupError, ImportError,
    MisconfigurationException,  # Lightning's own: e.g. `elr test` with a data module that has no test split
)  # fmt: skip


#: The distribution this package is installed as (its extras are ``pip install "elr-lightning[NAME]"``).
DISTRIBUTION = "elr-lightning"


def _editable_checkout() -> Optional[str]:
    """The folder of the checkout this package is installed from in editable mode, else ``None``.

    Read from the distribution's ``direct_url.json`` (PEP 610): ``dir_info.editable`` with a
    ``file://`` URL.
    """
    from importlib.metadata import PackageNotFoundError, distribution
    from urllib.parse import unquote, urlparse
    from urllib.request import url2pathname

    try:
        text = distribution(DISTRIBUTION).read_text("direct_url.json")
        record = json.loads(text) if text else {}
    except (PackageNotFoundError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("dir_info"), dict):
        return None
    url = record.get("url")
    if not record["dir_info"].get("editable") or not isinstance(url, str) or not url.startswith("file:"):
        return None
    return url2pathname(unquote(urlparse(url).path))


def install_extra(extra: str) -> str:
    """The command that installs the optional extra ``extra`` where the user is.

    An editable install (``pip install -e .`` of a checkout) gets ``pip install -e ".[extra]"`` from
    inside the checkout, or with the checkout's folder from anywhere else; any other install gets
    the registry's ``pip install "elr-lightning[extra]"``. Every "needs the X extra" message uses this.

    Args:
        extra: The name of an extra of ``pyproject.toml`` (``eval``, ``hf``, ``serve``, ...).
    """
    checkout = _editable_checkout()
    if checkout is None:
        return f'pip install "{DISTRIBUTION}[{extra}]"'
    try:
        here = os.path.samefile(checkout, os.getcwd())
    except OSError:
        here = False
    return f'pip install -e "{"." if here else checkout}[{extra}]"'


def is_integer(value: object, minimum: int = 1) -> bool:
    """Whether ``value`` is an integer >= ``minimum``; ``True`` is not (YAML's ``true`` would pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def refuse_unread_flags(flags: dict[str, object], reader: str, fix: str) -> None:
    """Refuse, in one line naming each, the ``flags`` that were given (not ``None``) but are only read with ``reader``.

    Args:
        flags: Each flag's value by name (``"--threshold"``), ``None`` where it was not given.
        reader: What reads them, e.g. ``"--loops auto"``.
        fix: How to give ``reader``, e.g. ``"add auto, e.g. --loops 1-3,auto"``.

    Raises:
        ValueError: Some flag was given.
    """
    given = [name for name, value in flags.items() if value is not None]
    if given:
        verb, them = ("is", "it") if len(given) == 1 else ("are", "them")
        raise ValueError(f"{' and '.join(given)} {verb} only read with {reader}; {fix}, or drop {them}")


def debug_requested(argv: list[str]) -> tuple[bool, list[str]]:
    """Whether tracebacks are wanted, and ``argv`` without the ``--debug`` flag.

    Setting the flag also sets :data:`DEBUG_ENV`, so processes that a launcher starts from this one
    (DDP ranks) show their tracebacks too.
    """
    if DEBUG_FLAG in argv:
        os.environ[DEBUG_ENV] = "1"
        argv = [a for a in argv if a != DEBUG_FLAG]
    return os.environ.get(DEBUG_ENV, "") not in ("", "0"), argv


def _raised_by_jsonargparse(err: BaseException) -> bool:
    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return f"{os.sep}jsonargparse{os.sep}" in tb.tb_frame.f_code.co_filename


def root_cause(err: BaseException) -> BaseException:
    """The exception that jsonargparse's wrappers (``Does not validate against any ...``) hide."""
    seen: set[int] = set()
    while (
        err.__cause__ is not None
        and id(err) not in seen
        and _raised_by_jsonargparse(err)
        and not isinstance(err, ArgumentError)  # its message names the key; its cause does not
    ):
        seen.add(id(err))
        err = err.__cause__
    return err


_PARSER_KEY = re.compile(r'Parser key "([^"]+)":\s*(.*)')
_NOISE = ("Does not validate against", "Subtypes:", "Errors:", "Given value", "Problem with given class_path")
#: A registered type's own message, which names the flag: jsonargparse's ``Not of type X:`` before it is dropped.
_OWN_MESSAGE = re.compile(r"^Not of type \w+: (--\S+ .*)$")


def summarise_parser_error(message: str) -> str:
    """One line from jsonargparse's nested message: the dotted key of the bad value and what is wrong.

    ``Parser key "model": ... Problem with given class_path ...: Parser key "lr": Expected a <class
    'float'>. Got value: abc`` becomes ``model.init_args.lr: Expected a <class 'float'>. Got value: abc``.
    """
    keys: list[str] = []
    detail = ""
    after_class_path = False
    for raw in message.splitlines():
        line = raw.strip().lstrip("-").strip()
        match = _PARSER_KEY.match(line)
        if match:
            if after_class_path:
                keys.append("init_args")
            keys.append(match.group(1))
            after_class_path = False
            detail = match.group(2)
            if detail:
                break
        elif line.startswith("Problem with given class_path"):
            after_class_path = True
        elif keys and line and not line.startswith(_NOISE):
            detail = line
            break
    if not keys:
        return " ".join(line.strip() for line in message.splitlines() if line.strip())
    own = _OWN_MESSAGE.match(detail)
    if own:
        return own.group(1)
    return f"{'.'.join(keys)}: {detail}" if detail else ".".join(keys)


def error_lines(err: BaseException, command: Optional[str] = None) -> list[str]:
    """What ``elr`` prints for ``err``: one line for a user's mistake, two for a likely bug.

    Args:
        err: The exception.
        command: The subcommand that raised it, named in the prefix: ``elr <command>: error: ...``.
    """
    prefix = f"elr {command}:" if command else "elr:"
    cause = root_cause(err)
    if isinstance(cause, ArgumentError) or (cause is err and _raised_by_jsonargparse(err)):
        message = summarise_parser_error(str(cause))
    else:
        text = cause.args[0] if isinstance(cause, KeyError) and cause.args else cause  # str(KeyError) adds quotes
        message = " ".join(part.strip() for part in str(text).splitlines() if part.strip())
    if isinstance(cause, USER_ERRORS):
        return [f"{prefix} error: {message or type(cause).__name__}"]
    return [
        f"{prefix} error: {type(cause).__name__}: {message}",
        f"{prefix} this looks like a bug; rerun with {DEBUG_FLAG} (or {DEBUG_ENV}=1) for the traceback and report it",
    ]


@contextmanager
def report_errors(debug: bool, stream: Optional[object] = None, command: Optional[str] = None) -> Iterator[None]:
    """Turn an exception escaping the block into :func:`error_lines` on stderr and exit status 1.

    ``KeyboardInterrupt`` exits with status 130 and one line. ``SystemExit`` (``--help``, parser
    exits) passes through untouched.

    Args:
        debug: Let every exception through with its traceback instead; an error that jsonargparse
            wraps (a config value refused by a class's ``__init__``) is let through as the error
            itself, so the traceback ends where it was raised, not in the parser's dump of the
            config.
        stream: Where to print; ``sys.stderr`` by default.
        command: The subcommand running in the block, named in each line's prefix.
    """
    if debug:
        try:
            yield
        except Exception as err:
            cause = root_cause(err)
            if cause is err:
                raise
            raise cause from cause.__cause__
        return
    out = sys.stderr if stream is None else stream
    try:
        yield
    except KeyboardInterrupt:
        print(f"elr {command}: interrupted" if command else "elr: interrupted", file=out)  # type: ignore[call-overload]
        sys.exit(130)
    except Exception as err:
        print("\n".join(error_lines(err, command)), file=out)  # type: ignore[call-overload]
        sys.exit(1)
