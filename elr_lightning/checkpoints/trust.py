"""Which code a checkpoint may name: the library's own classes and those of modules the user trusts, nothing else.

A checkpoint names code by class path: each plug-in as ``{"class_path": ..., "init_args": ...}``
(:mod:`elr_lightning.plugin_config`), a layer of one's own in ``arch.mixers`` or a pattern entry,
an ``ELRModule`` subclass in Lightning's ``_class_path``. Resolving such a name imports its module,
and an import runs the module's top-level code; building the class runs its constructor. So a
class path read from a checkpoint (or an export's ``config.json``) is resolved by
:func:`trusted_class` alone, which accepts a name only if

- it lies in a trusted module: ``elr_lightning`` and below, or a module the user trusts by name, with
  everything below it: ``--trust_module my_lab`` on the commands that open checkpoints, the
  :data:`TRUST_ENV` environment variable (``ELR_TRUST_MODULES=my_lab,other``; processes started by
  the command inherit it), or :func:`trust_modules` in Python. That a module is already imported
  is no trust: ``subprocess``, ``os`` and ``logging`` always are;
- it is a class defined in a trusted module (not one a trusted module merely imported);
- it is a subclass of the seam the field is for (a state update, a loop sampler, a conditioner, a
  token or channel mixer, an ``ELRModule``).

The name is checked as a string before anything is imported, so an untrusted one imports nothing;
it is refused in one line naming the module, the field and the way out. Which fields hold class
paths, and that every other value is plain data, is the schema of
:mod:`elr_lightning.checkpoints.schema`. A YAML config given to ``elr fit`` is the user's own and
imports what it names, as in LightningCLI.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any, Optional, Union

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
    """The modules (and everything below them) that checkpoints may name: ``elr_lightning`` and the user's."""
    return sorted({_OWN, *_trusted, *_parse(os.environ.get(TRUST_ENV, ""), TRUST_ENV)})


def _parse(names: str, field: str) -> list[str]:
    parsed = [name.strip() for name in names.split(",") if name.strip()]
    bad = [name for name in parsed if not all(part.isidentifier() for part in name.split("."))]
    if bad:
        raise ValueError(f"{field}: {', '.join(map(repr, bad))} is not a module name; give e.g. my_lab or my_lab.rules")
    return parsed


def is_trusted(module: str, trusted: Optional[list[str]] = None) -> bool:
    """Whether the dotted ``module`` is a trusted module or lies below one (:func:`trusted_modules` by default)."""
    trusted = trusted_modules() if trusted is None else trusted
    return any(module == name or module.startswith(name + ".") for name in trusted)


def shown(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for one-line messages about hostile values."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 15]}... ({len(text)} chars)"


def trusted_class(path: Any, base: Union[type, tuple[type, ...]], field: str, source: str) -> type:
    """The class a checkpoint names by ``path``, imported only if its module is trusted.

    Args:
        path: The class path, e.g. ``my_lab.rules.MyUpdate``.
        base: The class it must be (a subclass of), or several.
        field: Where the checkpoint names it, for messages (``hyper_parameters.update.class_path``).
        source: The file, for messages.

    Raises:
        UntrustedModuleError: ``path`` lies outside the trusted modules; nothing was imported.
        ValueError: ``path`` is not a class path, names nothing, or names something that is not a
            subclass of ``base`` defined in a trusted module.
    """
    if not isinstance(path, str) or not _DOTTED.fullmatch(path):
        raise ValueError(f"{source!r}: {field}={shown(path)} is not a class path such as my_lab.rules.MyUpdate")
    top = path.split(".")[0]
    if not is_trusted(path):
        raise UntrustedModuleError(
            f"{source!r} names {shown(path)} ({field}), and resolving it would import the module {top!r}, running "
            f"its code; a checkpoint may only name classes of elr_lightning and of modules you trust: if you trust "
            f"{top!r}, add {TRUST_FLAG} {top} (or set {TRUST_ENV}={top})"
        )
    found = _resolve(path)
    kinds = " or ".join(cls.__name__ for cls in (base if isinstance(base, tuple) else (base,)))
    if not isinstance(found, type) or not issubclass(found, base):
        what = (
            "nothing importable" if found is None
            else f"{found.__qualname__}, which is not a {kinds} subclass" if isinstance(found, type)
            else f"a {type(found).__name__}, not a class"
        )  # fmt: skip
        raise ValueError(f"{source!r}: {field}={path!r} names {what}; give the class path of a {kinds}")
    if not is_trusted(found.__module__):
        raise UntrustedModuleError(
            f"{source!r}: {field}={path!r} is a class of the module {found.__module__!r}, which a trusted module "
            f"imported; a checkpoint names a class where it is defined, in a trusted module"
        )
    return found


def _resolve(path: str) -> Any:
    """The object at the dotted ``path`` (all of it in trusted modules), or ``None`` if nothing is there."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:i])
        try:
            found: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name is not None and module_name.startswith(err.name):
                continue  # that prefix is no module: look for the class in its parent
            raise
        for attribute in parts[i:]:
            found = getattr(found, attribute, None)
        return found
    return None


def _class_paths(value: Any) -> Iterator[str]:
    """Every ``class_path`` string in ``value`` and every dotted string a layer pattern may name, at any depth."""
    if isinstance(value, str):
        if _DOTTED.fullmatch(value):
            yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _class_paths(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _class_paths(item)


def named_packages(value: Any) -> list[str]:
    """The top-level packages, other than ``elr_lightning``, whose classes ``value`` (a config) may name.

    Every dotted string counts: plug-ins' ``class_path`` entries, and layers in ``arch.mixers`` and
    pattern entries, which are class paths written as plain strings.
    """
    return sorted({path.split(".")[0] for path in _class_paths(value) if not is_trusted(path, [_OWN])})


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
