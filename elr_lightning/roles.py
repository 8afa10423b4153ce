"""Parameter roles: how a parameter is initialised and which optimizer group it joins.

Seams declare the role of the parameters they own with :func:`set_role`. At construction the model
records every role by parameter name (:func:`role_table`, ``LoopedLM.roles``). Everything after that
(the model's one init routine :meth:`elr_lightning.model.LoopedLM.init_weights`, the param-group
builder, the switch callbacks, cost reports) looks roles up by name:
wrappers such as FSDP2's ``fully_shard`` replace parameter objects and drop their tags, but keep
their names. Nothing needs to know any implementation.
"""

from __future__ import annotations

import copy
from typing import Optional, TypeVar

from torch import nn

#: A module, or ``None``, as :func:`set_role` returns what it was given.
ModuleT = TypeVar("ModuleT", bound=Optional[nn.Module])

_INIT_ATTR = "_elr_init"
_GROUP_ATTR = "_elr_group"

#: Initialisations a parameter may ask for. ``module``: the owning module's
#: ``init_parameter(name, param)`` initialises it (in place, with ops that also work on DTensors).
INITS = ("normal", "zeros", "ones", "scaled_normal", "module")
#: Named optimizer groups. ``decay`` gets weight decay; the others do not.
GROUPS = ("decay", "no_decay", "gate", "conditioning")


def set_role(param: nn.Parameter, *, init: str | None = None, group: str | None = None) -> nn.Parameter:
    """Tag ``param`` with its init and optimizer group and return it.

    Args:
        param: The parameter to tag.
        init: One of :data:`INITS`; ``None`` leaves the default (see ``LoopedLM.init_weights``).
        group: One of :data:`GROUPS`; ``None`` leaves the default (matrices decay, vectors do not).
    """
    if init is not None:
        if init not in INITS:
            raise ValueError(f"init={init!r} must be one of {INITS}")
        setattr(param, _INIT_ATTR, init)
    if group is not None:
        if group not in GROUPS:
            raise ValueError(f"group={group!r} must be one of {GROUPS}")
        setattr(param, _GROUP_ATTR, group)
    return param


def set_module_role(module: nn.Module, *, init: str | None = None, group: str | None = None) -> nn.Module:
    """Apply :func:`set_role` to every parameter of ``module``."""
    for p in module.parameters():
        set_role(p, init=init, group=group)
    return module


def init_of(param: nn.Parameter) -> str | None:
    """The init a parameter asked for, or ``None``."""
    return getattr(param, _INIT_ATTR, None)


def group_of(param: nn.Parameter) -> str:
    """The optimizer group of ``param``: its tag, else ``decay`` for matrices and ``no_decay`` for vectors."""
    return getattr(param, _GROUP_ATTR, "decay" if param.ndim >= 2 else "no_decay")


#: A parameter's role: ``(init, group)``.
Role = tuple[Optional[str], str]


def role_table(module: nn.Module) -> dict[str, Role]:
    """``{name: (init, group)}`` for every parameter of ``module``, read from the tags."""
    return {name: (init_of(p), group_of(p)) for name, p in module.named_parameters()}


def copy_with_roles(module: ModuleT) -> ModuleT:
    """``copy.deepcopy(module)`` that keeps the role tags, which ``Parameter.__deepcopy__`` drops."""
    copied = copy.deepcopy(module)
    if module is not None:
        for (_, source), (_, target) in zip(module.named_parameters(), copied.named_parameters()):
            for attr in (_INIT_ATTR, _GROUP_ATTR):
                if hasattr(source, attr):
                    setattr(target, attr, getattr(source, attr))
    return copied
