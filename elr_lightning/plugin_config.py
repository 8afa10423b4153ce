"""Plug-ins as plain data in a checkpoint's hyperparameters, rebuilt on load by jsonargparse.

A module built in Python receives its plug-ins (state-update rule, loop sampler, conditioner) as
objects. Pickled into the hyperparameters, they made every checkpoint need ``torch.load(...,
weights_only=False)``, which runs code from the file. Instead the hyperparameters hold each plug-in
the way LightningCLI's config already describes it::

    {"class_path": "elr_lightning.updates.FixedDelta", "init_args": {"beta": 0.3}}

recursively where a plug-in takes another plug-in, so the file loads with ``weights_only=True``.
:func:`~elr_lightning.checkpoints.schema.build_plugin` rebuilds such a description through the
checkpoint schema: only a trusted subclass of the seam's base class, with arguments that fit its
constructor.

The description holds a plug-in's constructor arguments, not its state: the weights are in the
``state_dict``, and state that is neither (an attribute set by hand after construction) is not
saved, as with any LightningCLI config. The constructor arguments come from
:class:`RecordsInitArgs`, the metaclass of every seam's base class, which records them at
construction; an instance made without its constructor (unpickled from an old checkpoint) has
its arguments read back from the attributes of the same names, accepted only where a plug-in
rebuilt from them matches the instance. A plug-in whose arguments cannot be recovered, or which
takes an argument that is neither plain data nor a plug-in (a tensor, a function), raises
:class:`PluginConfigError` naming the field and the fix.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Mapping

from torch import Tensor

_RECORD = "_elr_init_args"
_PLAIN = (type(None), bool, int, float, str)


class PluginConfigError(ValueError):
    """A plug-in cannot be described by its ``class_path`` and ``init_args``."""


class RecordsInitArgs(type):
    """Metaclass that records the arguments each instance was constructed with.

    The seams' base classes (``StateUpdate``, ``LoopSampler``, ``Conditioner``) use it, so every
    subclass, a user's own included, is described by :func:`plugin_config` with no code of its own.
    Only a real construction records: ``copy.deepcopy`` keeps the original's record; unpickling
    (which bypasses the constructor) leaves none.
    """

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        instance = super().__call__(*args, **kwargs)
        bound = inspect.signature(cls.__init__).bind(instance, *args, **kwargs)
        instance.__dict__[_RECORD] = dict(list(bound.arguments.items())[1:])
        return instance


def own_attributes(obj: Any) -> dict[str, Any]:
    """``vars(obj)`` without the constructor arguments that :class:`RecordsInitArgs` recorded."""
    return {name: value for name, value in vars(obj).items() if name != _RECORD}


def _recorded_args(obj: Any, field: str) -> dict[str, Any]:
    """The constructor arguments of ``obj``: recorded at construction, else read back and checked."""
    cls = type(obj)
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    recorded = obj.__dict__.get(_RECORD)
    if recorded is not None:
        args: dict[str, Any] = {}
        for p in params:
            value = recorded.get(p.name)
            if p.kind is p.VAR_POSITIONAL and value:
                raise PluginConfigError(
                    f"{field}: {cls.__qualname__} was given positional arguments for *{p.name}, which a class_path + "
                    "init_args config cannot name; give its __init__ named parameters"
                )
            if p.kind is p.VAR_KEYWORD:
                args.update(value or {})
            elif p.name in recorded and p.kind is not p.VAR_POSITIONAL:
                args[p.name] = value
        return args
    # No record (an instance from an old checkpoint): the attributes named like the parameters.
    named = [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    args = {p.name: getattr(obj, p.name) for p in named if hasattr(obj, p.name)}
    fix = (
        f"build it by calling {cls.__qualname__}(...), or keep each constructor argument in an attribute of "
        "the same name"
    )
    try:
        fresh = cls(**args)
    except Exception as err:
        raise PluginConfigError(
            f"{field}: the constructor arguments of {cls.__qualname__} cannot be recovered "
            f"({type(err).__name__}: {err}); {fix}"
        ) from err
    mine = vars(obj)
    differ = sorted(
        name
        for name, value in vars(fresh).items()
        if not name.startswith("_") and name != "training" and _is_plain(value)
        and not (_is_plain(mine.get(name)) and mine.get(name, value) == value)
    )
    if differ:
        raise PluginConfigError(
            f"{field}: {cls.__qualname__} rebuilt from the attributes named like its constructor arguments "
            f"differs in {', '.join(differ)}; {fix}"
        )
    return args


def _is_plain(value: Any) -> bool:
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (list, tuple)):
        return all(map(_is_plain, value))
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return False


def plain_value(value: Any, field: str) -> Any:
    """``value`` as data that ``torch.load(..., weights_only=True)`` reads and jsonargparse parses.

    Numbers, strings, ``None`` and containers of them stay (tuples become lists); a dataclass
    becomes the dict of its fields; a ``class_path`` dict is checked recursively; any other object
    becomes its :func:`plugin_config`.

    Args:
        value: A hyperparameter's value.
        field: Its name in messages, e.g. ``model.init_args.update``.

    Raises:
        PluginConfigError: Naming the field that cannot be described, and the fix.
    """
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (list, tuple)):
        return [plain_value(v, f"{field}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        for key in value:
            if not isinstance(key, str):
                raise PluginConfigError(f"{field}: key {key!r} is not a string; use string keys")
        return {key: plain_value(v, f"{field}.{key}") for key, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain_value(dataclasses.asdict(value), field)
    return plugin_config(value, field)


def plain_hyperparameters(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """Every hyperparameter as :func:`plain_value`, named ``model.init_args.<name>`` in errors."""
    return {name: plain_value(value, f"model.init_args.{name}") for name, value in hparams.items()}


def plugin_config(obj: Any, field: str) -> dict[str, Any]:
    """``{"class_path": ..., "init_args": {...}}`` of a plug-in object, recursively plain.

    Raises:
        PluginConfigError: ``obj`` is a tensor or a function, its class cannot be imported by name (defined in
            ``__main__`` or inside a function), its constructor arguments cannot be recovered, or one
            of them cannot be described.
    """
    cls = type(obj)
    if isinstance(obj, (Tensor, type)) or inspect.isroutine(obj) or not hasattr(obj, "__dict__"):
        raise PluginConfigError(
            f"{field} is a {cls.__name__}, which a checkpoint's hyperparameters cannot hold as data; "
            "pass numbers, strings, lists or plug-in objects to the constructor, and keep tensors in the state_dict"
        )
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        raise PluginConfigError(
            f"{field}: {cls.__qualname__} is defined in {'__main__' if cls.__module__ == '__main__' else 'a function'}, "
            "so a checkpoint cannot name its class; define it at the top level of an importable module"
        )
    args = _recorded_args(obj, field)
    init_args = {name: plain_value(value, f"{field}.init_args.{name}") for name, value in args.items()}
    return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": init_args}
