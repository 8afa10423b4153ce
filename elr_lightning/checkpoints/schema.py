"""A checkpoint's configuration is plain data, checked against the constructors it is for; only trusted seams are built.

What a checkpoint says about its model (Lightning's ``hyper_parameters``, with the legacy
``hparams`` and ``module_arguments`` that Lightning merges into them, and the library's ``elr``
entry) is read as data and checked field by field against the type hints of the constructor it
feeds, before anything is built:

- a number, string or boolean field holds one; a list, tuple or mapping field holds those of its
  element types; a dataclass field (``arch``: :class:`~elr_lightning.config.ModelConfig`) is a
  mapping of its fields, by the types its ``SCHEMA_HINTS`` narrows;
- a field typed by a seam's base class (a state update, a loop sampler, a conditioner: the
  classes of :class:`~elr_lightning.plugin_config.RecordsInitArgs`) holds
  ``{"class_path": ..., "init_args": {...}}``; the class path is resolved by
  :func:`~elr_lightning.checkpoints.trust.trusted_class` (a subclass of that seam, defined in a trusted module,
  nothing imported otherwise) and its ``init_args`` are checked against that class's constructor
  in turn. The layers ``arch.mixers`` and the pattern entries name are checked the same way;
- every free-form field (typed ``Any``, or not typed) is a leaf of plain types: ``None``, a
  boolean, a number, a string, or a list of them. A mapping there is refused, so no class
  specification can hide where something else would build it.

Nothing else is ever turned into an object: no string is read as YAML, no class path outside a
seam's field is resolved, and Lightning's ``_instantiator`` is never used (the module's
constructor is called with the checked arguments). A value that breaks the schema is refused in
one line naming the field (:class:`CheckpointConfigError`); an untrusted module, naming the way
to trust it (:class:`~elr_lightning.checkpoints.trust.UntrustedModuleError`).
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Optional, TypeVar, Union

from elr_lightning.plugin_config import RecordsInitArgs
from elr_lightning.checkpoints.trust import LIGHTNING_INSTANTIATORS, shown, trusted_class

__all__ = [
    "CheckpointConfigError",
    "build_plugin",
    "check_checkpoint_config",
    "checked_arch",
    "module_arguments",
    "plugin_from_config",
]

#: Keys Lightning merges into the hyperparameters before ``hyper_parameters`` itself (older checkpoints).
LEGACY_HPARAMS_KEYS = ("hparams", "module_arguments")

_PLAIN = (type(None), bool, int, float, str)

#: The type a plug-in argument is rebuilt as.
T = TypeVar("T")


class CheckpointConfigError(ValueError):
    """A checkpoint's configuration breaks its schema: a value of the wrong type, or a class where data belongs."""


@dataclasses.dataclass
class _Context:
    source: str
    build: bool

    def error(self, message: str, at: str) -> CheckpointConfigError:
        """The one-line refusal of the value ``at`` (a field's path): the file, the field, then ``message``."""
        return CheckpointConfigError(f"{self.source!r}: {at}: {message}")


def _leaf(value: Any, field: str, ctx: _Context) -> Any:
    """A free-form value: ``None``, a boolean, number or string, or a list of them (tuples become lists)."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (list, tuple)):
        return [_leaf(item, f"{field}[{i}]", ctx) for i, item in enumerate(value)]
    kind = "a mapping" if isinstance(value, Mapping) else f"a {type(value).__name__}"
    raise ctx.error(
        f"{kind} where a free-form value must be plain data (null, a boolean, number or string, or a list of them); "
        "a checkpoint builds classes only in the fields of a seam",
        at=field,
    )


def _kind(hint: Any) -> str:
    """Which Python values a hint can take: ``"mapping"``, ``"sequence"`` or ``"scalar"``."""
    origin = typing.get_origin(hint) or hint
    if origin in (dict, Mapping) or _is_mapping_type(hint):
        return "mapping"
    if origin in (list, tuple, Sequence):
        return "sequence"
    return "scalar"


def _is_mapping_type(hint: Any) -> bool:
    return isinstance(hint, type) and (
        dataclasses.is_dataclass(hint) or typing.is_typeddict(hint) or isinstance(hint, RecordsInitArgs)
    )


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _check(value: Any, hint: Any, field: str, ctx: _Context) -> Any:
    """``value`` checked against the type ``hint``; with ``ctx.build``, seam specifications built."""
    if hint in (Any, object, inspect.Parameter.empty):
        return _leaf(value, field, ctx)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Union or (hasattr(types, "UnionType") and origin is types.UnionType):
        return _check_union(value, args, field, ctx)
    if origin is Literal:
        if not any(value == arg and type(value) is type(arg) for arg in args):
            raise ctx.error(f"{shown(value)} is not one of {list(args)}", at=field)
        return value
    if hint is type(None):
        if value is not None:
            raise ctx.error(f"{shown(value)} must be null", at=field)
        return None
    if hint in (bool, int, float, str):
        ok = isinstance(value, bool) if hint is bool else isinstance(value, str) if hint is str else (
            isinstance(value, (int, float) if hint is float else int) and not isinstance(value, bool)
        )
        if not ok:
            raise ctx.error(f"{shown(value)} must be {'a number' if hint is float else f'a {hint.__name__}'}", at=field)
        return value
    if origin in (list, tuple, Sequence) or hint in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ctx.error(f"{shown(value)} must be a list", at=field)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ctx.error(f"{shown(value)} must have {len(args)} entries", at=field)
            return [_check(item, arg, f"{field}[{i}]", ctx) for i, (item, arg) in enumerate(zip(value, args))]
        item_hint = args[0] if args else Any
        return [_check(item, item_hint, f"{field}[{i}]", ctx) for i, item in enumerate(value)]
    if origin in (dict, Mapping) or hint is dict:
        value_hint = args[1] if len(args) == 2 else Any
        return {key: _check(item, value_hint, f"{field}.{key}", ctx) for key, item in _mapping(value, field, ctx).items()}
    if isinstance(hint, type) and typing.is_typeddict(hint):
        return _check_fields(value, typing.get_type_hints(hint), field, ctx, required=hint.__required_keys__)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _check_dataclass(value, hint, field, ctx)
    if isinstance(hint, RecordsInitArgs):
        return _plugin(value, hint, field, ctx)
    raise ctx.error(f"a {_type_name(hint)} cannot be read from a checkpoint; only plain data and seams can", at=field)


def _check_union(value: Any, options: tuple[Any, ...], field: str, ctx: _Context) -> Any:
    if value is None and type(None) in options:
        return None
    candidates = [option for option in options if option is not type(None)]
    kind = "mapping" if isinstance(value, Mapping) else "sequence" if isinstance(value, (list, tuple)) else "scalar"
    matching = [option for option in candidates if _kind(option) == kind] or candidates
    errors: list[CheckpointConfigError] = []
    for option in matching:
        try:
            return _check(value, option, field, ctx)
        except CheckpointConfigError as err:
            errors.append(err)
    if len(errors) == 1:
        raise errors[0]
    raise ctx.error(f"{shown(value)} is none of {', '.join(map(_type_name, candidates))}", at=field)


def _mapping(value: Any, field: str, ctx: _Context) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ctx.error(f"{shown(value)} must be a mapping", at=field)
    for key in value:
        if not isinstance(key, str):
            raise ctx.error(f"key {shown(key)} must be a string", at=field)
    return value


def _check_fields(
    value: Any, hints: dict[str, Any], field: str, ctx: _Context, required: frozenset[str] = frozenset()
) -> dict[str, Any]:
    mapping = _mapping(value, field, ctx)
    unknown = sorted(set(mapping) - set(hints))
    if unknown:
        raise ctx.error(f"is not a field here; the fields are {sorted(hints)}", at=f"{field}.{unknown[0]}")
    missing = sorted(required - set(mapping))
    if missing:
        raise ctx.error("is missing", at=f"{field}.{missing[0]}")
    return {key: _check(item, hints[key], f"{field}.{key}", ctx) for key, item in mapping.items()}


def _check_dataclass(value: Any, hint: type, field: str, ctx: _Context) -> dict[str, Any]:
    """A dataclass's fields as a mapping, checked by their types (narrowed by its ``SCHEMA_HINTS``), and the
    classes it names (its ``schema_classes``) resolved as trusted, their arguments checked."""
    hints = {f.name: typing.get_type_hints(hint)[f.name] for f in dataclasses.fields(hint)}
    checked = _check_fields(value, hints | getattr(hint, "SCHEMA_HINTS", {}), field, ctx)
    for at, path, bases, init_args, leading in getattr(hint, "schema_classes", lambda _: ())(checked):
        found = trusted_class(path, bases, f"{field}.{at}", ctx.source)
        _check_arguments(found.__init__, init_args, f"{field}.{at.removesuffix('.class_path')}.init_args", ctx, leading)
    return checked


def _parameters(fn: Any, skip: int) -> tuple[list[inspect.Parameter], dict[str, Any]]:
    """The parameters of ``fn`` after the first ``skip`` (``self``, a mixer's config) and their type hints."""
    params = list(inspect.signature(fn).parameters.values())[skip:]
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # a hint that does not resolve reads as no hint: plain data only
        hints = {}
    return params, hints


def _check_arguments(fn: Any, given: Any, field: str, ctx: _Context, skip: int = 1) -> dict[str, Any]:
    """Keyword arguments for ``fn`` checked against its signature: known names, each by its type hint."""
    given = _mapping(given, field, ctx)
    params, hints = _parameters(fn, skip)
    named = {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    checked = {}
    for key, value in given.items():
        if key not in named and not takes_any:
            raise ctx.error(f"is not an argument; the arguments are {sorted(named)}", at=f"{field}.{key}")
        checked[key] = _check(value, hints.get(key, Any) if key in named else Any, f"{field}.{key}", ctx)
    return checked


def _plugin(value: Any, base: type, field: str, ctx: _Context) -> Any:
    """A seam's ``{"class_path", "init_args"}``: a trusted subclass of ``base``, its arguments checked."""
    if not isinstance(value, Mapping):
        raise ctx.error(f"a {base.__name__} is given as {{class_path: ..., init_args: {{...}}}}, not {shown(value)}", at=field)
    spec = _mapping(value, field, ctx)
    if set(spec) - {"class_path", "init_args"} or "class_path" not in spec:
        raise ctx.error(
            f"a {base.__name__} is given as {{class_path: ..., init_args: {{...}}}}, not a mapping with the keys {sorted(spec)}",
            at=field,
        )
    cls = trusted_class(spec["class_path"], base, f"{field}.class_path", ctx.source)
    init_args = _check_arguments(cls.__init__, spec.get("init_args") or {}, f"{field}.init_args", ctx)
    if not ctx.build:
        return {"class_path": spec["class_path"], "init_args": init_args}
    try:
        return cls(**init_args)
    except (TypeError, ValueError) as err:
        raise ctx.error(f"{err}", at=f"{field}.init_args") from err


def plugin_from_config(value: Mapping[str, Any], base: type, field: str, source: str = "config") -> Any:
    """Build the seam plug-in that ``value`` (``{"class_path": ..., "init_args": {...}}``) describes.

    The class must be a subclass of ``base`` defined in a trusted module (:mod:`elr_lightning.checkpoints.trust`),
    and every argument must fit its constructor's type hints, nested plug-ins included.

    Args:
        value: The description, as a checkpoint's hyperparameters hold it.
        base: The seam's base class.
        field: Where it stands, for messages (``model.init_args.update``).
        source: The file or config it comes from, for messages.

    Raises:
        UntrustedModuleError: The class lies in a module that is not trusted; nothing was imported.
        CheckpointConfigError: A value breaks the schema, or the constructor refuses it.
    """
    return _check(value, base, field, _Context(source, build=True))


def checked_arch(arch: Any, field: str, source: str) -> dict[str, Any]:
    """An ``arch`` mapping checked against :class:`~elr_lightning.config.ModelConfig`, its layers resolved as trusted.

    The fields are checked by their types; each entry of ``mixers`` (used or not) and each pattern
    entry that is a class path must name a trusted token or channel mixer, and a mixer's ``init_args``
    must fit its constructor (:meth:`~elr_lightning.config.ModelConfig.schema_classes`). Nothing is
    built: ``ModelConfig(**checked_arch(...))`` imports only trusted modules.

    Raises:
        UntrustedModuleError: A layer lies in a module that is not trusted.
        CheckpointConfigError: A field breaks the schema.
    """
    from elr_lightning.config import ModelConfig

    return _check_dataclass(arch, ModelConfig, field, _Context(source, build=False))


def _hyperparameters(
    raw: Mapping[str, Any], source: str, overrides: Optional[Mapping[str, Any]]
) -> tuple[dict[str, Any], dict[str, str]]:
    """The hyperparameters Lightning would pass on, merged as it merges them, and the entry each came from."""
    ctx = _Context(source, build=False)
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    entries = [(key, raw.get(key)) for key in (*LEGACY_HPARAMS_KEYS, "hyper_parameters")] + [("hparams_file", overrides)]
    for key, entry in entries:
        if entry is not None:
            merged.update(_mapping(entry, key, ctx))
            origin.update(dict.fromkeys(entry, key))
    return merged, origin


def module_arguments(
    raw: Mapping[str, Any], cls: type, source: str, overrides: Optional[Mapping[str, Any]] = None
) -> tuple[type, dict[str, Any]]:
    """The class and constructor arguments a Lightning checkpoint describes, every one checked.

    Merges ``hparams``, ``module_arguments`` and ``hyper_parameters`` (then ``overrides``) as Lightning
    does. ``_class_path`` names the class, which must be a trusted subclass of ``cls``;
    ``_instantiator`` may only be Lightning's own, and is dropped. The arguments are complete: one
    for every constructor parameter (its default where the checkpoint has none), so nothing the file
    holds reaches the constructor unchecked. Plug-ins stay ``{"class_path", "init_args"}`` mappings,
    checked: the constructor builds them (:func:`plugin_from_config`).

    Args:
        raw: The checkpoint, as ``torch.load(..., weights_only=True)`` returns it.
        cls: The class the caller loads (``ELRModule``).
        source: The file, for messages.
        overrides: Hyperparameters that replace the checkpoint's (a ``hparams_file``).

    Returns:
        ``(class, arguments)``.

    Raises:
        UntrustedModuleError: A class lies in a module that is not trusted; nothing of it was imported.
        CheckpointConfigError: A value breaks the schema, naming the field.
    """
    hparams, origin = _hyperparameters(raw, source, overrides)
    ctx = _Context(source, build=False)
    instantiator = hparams.pop("_instantiator", None)
    if instantiator is not None and not (isinstance(instantiator, str) and instantiator in LIGHTNING_INSTANTIATORS):
        at = f"{origin['_instantiator']}._instantiator"
        raise ctx.error(f"{shown(instantiator)} is not Lightning's instantiator", at=at)
    class_path = hparams.pop("_class_path", None)
    field = f"{origin.get('_class_path')}._class_path"
    target = cls if class_path is None else trusted_class(class_path, cls, field, source)
    params, hints = _parameters(target.__init__, 1)
    named = {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    arguments = {}
    for name, param in named.items():
        if name in hparams:
            arguments[name] = _check(hparams[name], hints.get(name, Any), f"{origin[name]}.{name}", ctx)
        elif param.default is not param.empty:
            arguments[name] = param.default
        else:
            raise ctx.error(f"is missing, and {target.__name__} needs it", at=f"hyper_parameters.{name}")
    if any(p.kind is p.VAR_KEYWORD for p in params):  # passed on to ``cls``: checked by its hints, else as leaves
        _, base_hints = _parameters(cls.__init__, 1)
        arguments |= {
            key: _check(value, base_hints.get(key, Any), f"{origin[key]}.{key}", ctx)
            for key, value in hparams.items() if key not in named
        }  # fmt: skip
    return target, arguments


def check_checkpoint_config(raw: Any, source: str, cls: Optional[type] = None) -> None:
    """Check what a loaded checkpoint says about its model, building nothing.

    Checks the ``elr`` entry: ``arch`` against :class:`~elr_lightning.config.ModelConfig`
    (:func:`checked_arch`), everything else as plain data; and, given ``cls`` (``ELRModule``), the
    hyperparameters against it or the subclass its ``_class_path`` names (:func:`module_arguments`).

    Raises:
        UntrustedModuleError: A class lies in a module that is not trusted.
        CheckpointConfigError: A value breaks the schema, naming the field.
    """
    if not isinstance(raw, Mapping):
        return
    if cls is not None:
        module_arguments(raw, cls, source)
    elr = raw.get("elr")
    if elr is None:
        return
    ctx = _Context(source, build=False)
    for key, value in _mapping(elr, "elr", ctx).items():
        if key == "arch":
            checked_arch(value, "elr.arch", source)
        else:
            _plain_tree(value, f"elr.{key}", ctx)


def _plain_tree(value: Any, field: str, ctx: _Context) -> None:
    """Plain data at any depth: mappings with string keys, lists and plain leaves (the ``elr`` entry's records)."""
    if isinstance(value, Mapping):
        for key, item in _mapping(value, field, ctx).items():
            _plain_tree(item, f"{field}.{key}", ctx)
    else:
        _leaf(value, field, ctx)


def build_plugin(value: Optional[T | Mapping[str, Any]], base: type[T], field: str) -> Optional[T]:
    """The plug-in that ``value`` describes: itself if it is an object or ``None``, else built from its description.

    A ``{"class_path": ..., "init_args": {...}}`` dict (as
    :func:`~elr_lightning.plugin_config.plugin_config` writes it into every checkpoint) is built by
    :func:`plugin_from_config`: only a subclass of ``base`` defined in a trusted module
    (:mod:`elr_lightning.checkpoints.trust`), with arguments that fit its constructor's type hints, nested
    plug-ins included. A description is data, so it
    names code only the user trusts: ``elr_lightning``'s own and the modules given to
    :func:`~elr_lightning.checkpoints.trust.trust_modules` (a YAML config builds its plug-ins through
    LightningCLI instead, and hands this function objects).

    Raises:
        UntrustedModuleError: The class lies in a module that is not trusted; nothing was imported.
        ValueError: The dict does not describe a subclass of ``base`` or its arguments, naming ``field``.
    """
    if not isinstance(value, Mapping):
        return value
    return plugin_from_config(value, base, field)
