"""Which modules a checkpoint may name: a checkpoint is data, and opening one never imports new code.

A checkpoint names code by class path: each plug-in as ``{"class_path": ..., "init_args": ...}``
(:mod:`elr_lightning.plugin_config`), a layer of one's own in ``arch.mixers`` or a pattern entry,
an ``ELRModule`` subclass in Lightning's ``_class_path``. Resolving such a name imports its module,
and an import runs the module's top-level code. So before anything is built from a checkpoint,
every dotted name in its hyperparameters (any string that names an importable module, wherever it
stands, since jsonargparse also resolves plain strings given to plug-in arguments, and reads a
string as YAML: ``"class_path: a.B"``) is checked without importing anything
(:func:`check_checkpoint_names`). A name may only lead to:

- the library's own modules (``elr_lightning`` and below);
- modules already imported (in ``sys.modules``): importing them again runs nothing;
- modules the user trusts by name, with everything below them: ``--trust_module my_lab`` on the
  commands that open checkpoints, the :data:`TRUST_ENV` environment variable
  (``ELR_TRUST_MODULES=my_lab,other``; processes started by the command inherit it), or
  :func:`trust_modules` in Python.

Any other importable module is refused in one line, naming the module, the field and the way out.
A YAML config given to ``elr fit`` is the user's own and imports what it names, as in LightningCLI.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections.abc import Iterator, Mapping
from typing import Any, Optional

import yaml

#: Environment variable: comma-separated modules (and everything below them) that checkpoints may name.
TRUST_ENV = "ELR_TRUST_MODULES"

#: The command-line flag of the commands that open checkpoints; the same form as :data:`TRUST_ENV`.
TRUST_FLAG = "--trust_module"

#: Lightning's instantiators, which Lightning itself allows by this exact name and no other.
LIGHTNING_INSTANTIATORS = frozenset(
    {"lightning.pytorch.cli.instantiate_module", "pytorch_lightning.cli.instantiate_module"}
)

_OWN = "elr_lightning"
_trusted: set[str] = set()
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class UntrustedModuleError(ValueError):
    """A checkpoint names a module that opening it would import, and the user has not trusted it."""


def trust_modules(*names: str) -> None:
    """Let checkpoints opened by this process name the modules ``names`` and everything below them.

    Args:
        names: Module names, each also comma-separated as in :data:`TRUST_ENV` (``"my_lab,other"``).

    Raises:
        ValueError: A name that is not a dotted Python module name.
    """
    _trusted.update(_parse(",".join(names), "trust_modules"))


def trusted_modules() -> list[str]:
    """The modules (and everything below them) that checkpoints may name, besides those already imported."""
    return sorted({_OWN, *_trusted, *_parse(os.environ.get(TRUST_ENV, ""), TRUST_ENV)})


def _parse(names: str, field: str) -> list[str]:
    parsed = [name.strip() for name in names.split(",") if name.strip()]
    bad = [name for name in parsed if not all(part.isidentifier() for part in name.split("."))]
    if bad:
        raise ValueError(f"{field}: {', '.join(map(repr, bad))} is not a module name; give e.g. my_lab or my_lab.rules")
    return parsed


def _is_trusted(module: str, trusted: list[str]) -> bool:
    return any(module == name or module.startswith(name + ".") for name in trusted)


def untrusted_import(name: str, trusted: Optional[list[str]] = None) -> Optional[str]:
    """The module that resolving the dotted ``name`` would import and run, if it is not trusted; else ``None``.

    Follows ``name`` prefix by prefix as an import does (``a``, then ``a.b``, ...): a prefix that is
    trusted ends the walk (all below it is trusted), one already imported is passed, and the first
    other one that an import would find (``importlib.util.find_spec``, which runs no module code:
    its parent is already imported) is the answer. A prefix that no import would find ends the walk
    too: nothing below it can be imported. Namespace packages (folders without ``__init__.py``) run
    no code and are passed.

    Args:
        name: A dotted name such as ``my_lab.rules.MyUpdate``.
        trusted: The trusted modules; :func:`trusted_modules` by default.
    """
    trusted = trusted_modules() if trusted is None else trusted
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        module = ".".join(parts[:i])
        if _is_trusted(module, trusted):
            return None
        if module in sys.modules:
            continue
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError, AttributeError):  # the parent is a plain module, not a package
            return None
        if spec is None:
            return None
        if spec.origin is None and spec.submodule_search_locations is not None:  # a namespace package
            importlib.import_module(module)  # runs no code, and lets find_spec look inside it
            continue
        return module
    return None


def _strings(
    value: Any, field: str, parse: bool = False, seen: Optional[dict[int, Any]] = None
) -> Iterator[tuple[str, str]]:
    """Every string in ``value`` with its field; with ``parse``, also those of the YAML or JSON that a string holds.

    jsonargparse reads a string given for a plug-in or a dict as YAML (``"class_path: a.B"``,
    ``'{"class_path": "a.B"}'``), so a class path can hide inside a string. Containers are visited
    once each (YAML aliases may share or nest them).
    """
    seen = {} if seen is None else seen  # id -> container, kept alive so that no id is reused
    if isinstance(value, str):
        yield field, value
        if parse and not _DOTTED.fullmatch(value):
            try:
                parsed = yaml.load(value, Loader=_YAML_LOADER)
            except yaml.YAMLError:
                return
            if parsed != value:
                yield from _strings(parsed, field, parse, seen)
    elif isinstance(value, (Mapping, list, tuple)) and id(value) not in seen:
        seen[id(value)] = value
        items = value.items() if isinstance(value, Mapping) else enumerate(value)
        for key, item in items:
            yield from _strings(item, f"{field}.{key}" if isinstance(value, Mapping) else f"{field}[{key}]", parse, seen)


def check_checkpoint_names(data: Mapping[str, Any], source: str, fields: tuple[str, ...] = ("hyper_parameters", "elr")) -> None:
    """Refuse ``data`` (a loaded checkpoint) if any string in ``fields`` would import an untrusted module.

    Args:
        data: The checkpoint's dictionary (or ``config.json`` of an export).
        source: The file, for the message.
        fields: The top-level entries to check.

    Raises:
        UntrustedModuleError: Naming the module, the field that names it and how to trust it.
    """
    trusted = trusted_modules()
    for top in fields:
        # The ``elr`` entry is read by the library only (never by jsonargparse), and its tokenizer is a long JSON text.
        for field, value in _strings(data.get(top), top, parse=top != "elr"):
            if len(value) > 512 or not _DOTTED.fullmatch(value):
                continue
            if field.endswith("._instantiator") and value in LIGHTNING_INSTANTIATORS:
                continue  # Lightning refuses any other instantiator itself
            module = untrusted_import(value, trusted)
            if module is not None:
                raise UntrustedModuleError(
                    f"{source!r} names {value!r} ({field}), and resolving it would import the module {module!r}, "
                    f"running its code; a checkpoint may only name elr_lightning, modules already imported and "
                    f"modules you trust: if you trust {module.split('.')[0]!r}, add {TRUST_FLAG} "
                    f"{module.split('.')[0]} (or set {TRUST_ENV}={module.split('.')[0]})"
                )


def named_packages(value: Any, class_paths_only: bool = True) -> list[str]:
    """The top-level packages, other than ``elr_lightning``, that ``value`` (a config) names.

    Args:
        value: A config or a checkpoint's hyperparameters.
        class_paths_only: Only ``class_path`` entries; else every dotted name (layers in
            ``arch.mixers`` and pattern entries are class paths written as plain strings).
    """
    found = {
        text.split(".")[0]
        for field, text in _strings(value, "")
        if (field.endswith(".class_path") or not class_paths_only)
        and _DOTTED.fullmatch(text)
        and not _is_trusted(text, [_OWN])
    }
    return sorted(found)


def add_trust_argument(parser: Any) -> None:
    """Add :data:`TRUST_FLAG` to a command's (jsonargparse) parser."""
    parser.add_argument(
        TRUST_FLAG,
        type=Optional[str],
        default=None,
        help="Comma-separated modules (and those below them) that the checkpoint may name as plug-ins or layers: "
        f"importing them runs their code, so only modules you trust. Also from {TRUST_ENV}.",
    )


def apply_trust_argument(value: Optional[str]) -> None:
    """Trust the modules of a parsed :data:`TRUST_FLAG` in this process, and in processes it starts."""
    if value:
        names = _parse(value, TRUST_FLAG)
        _trusted.update(names)
        os.environ[TRUST_ENV] = ",".join(dict.fromkeys([*_parse(os.environ.get(TRUST_ENV, ""), TRUST_ENV), *names]))
