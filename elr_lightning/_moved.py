"""The import paths of 0.1 that moved when the package root was grouped by concern: one table, one finder.

``import elr_lightning.generation`` (or ``from elr_lightning.trust import trust_modules``, or a YAML
``class_path: elr_lightning.checkpoint_io.AtomicCheckpointIO``) keeps working for one release: the old
module is a thin module that reads every name from its new home, and importing it warns once with a
``DeprecationWarning`` that names the new path. The finder is installed by ``elr_lightning/__init__.py``
and answers only the names of :data:`MOVED_MODULES`; every other import is left to the other finders.
Remove this module (and its import in ``__init__``) in the release after next.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Sequence
from typing import Any, Optional

#: Old module -> new module (the changelog lists them too).
MOVED_MODULES: dict[str, str] = {
    "elr_lightning.checkpoint_io": "elr_lightning.checkpoints.io",
    "elr_lightning.checkpoint_schema": "elr_lightning.checkpoints.schema",
    "elr_lightning.safe_load": "elr_lightning.checkpoints.safe_load",
    "elr_lightning.trust": "elr_lightning.checkpoints.trust",
    "elr_lightning.module_checkpoint": "elr_lightning.checkpoints.record",
    "elr_lightning.resume": "elr_lightning.checkpoints.resume",
    "elr_lightning.tokenizer_checkpoint": "elr_lightning.checkpoints.tokenizer",
    "elr_lightning.upgrade": "elr_lightning.checkpoints.upgrade",
    "elr_lightning.generation": "elr_lightning.inference.generate",
    "elr_lightning.decode": "elr_lightning.inference.decode",
    "elr_lightning.prompts": "elr_lightning.inference.prompts",
    "elr_lightning.serving": "elr_lightning.inference.fold",
    "elr_lightning.cache": "elr_lightning.inference.cache",
    "elr_lightning.generate_cli": "elr_lightning.inference.command",
    "elr_lightning.ablate_report": "elr_lightning.ablate.report",
    "elr_lightning.estimate_fla": "elr_lightning.estimate.fla",
    "elr_lightning.estimate_fit": "elr_lightning.estimate.fit",
    "elr_lightning.estimate_report": "elr_lightning.estimate.report",
    "elr_lightning.cost": "elr_lightning.estimate.cost",
}

#: Names that left their old module for another than the module's new home: old module -> {name: new module}.
MOVED_NAMES: dict[str, dict[str, str]] = {
    "elr_lightning.checkpoint_io": {
        name: "elr_lightning.files"
        for name in (
            "TEMPORARY_NAME", "fsync_folder", "remove_orphans", "replace_atomically", "save_figure", "write_atomically",
            "write_file",
        )
    },
    "elr_lightning.estimate_report": {
        **{name: "elr_lightning.estimate.hardware" for name in (
            "DEFAULT_DEVICE_MEMORY", "detected_device_memory", "detected_host_memory", "device_count", "parse_memory",
        )},
        **{name: "elr_lightning.estimate.target" for name in (
            "accelerator_type", "gdp_choice", "geometry_of_config", "layout_of_config", "meta_builder", "target_of_config",
        )},
        **{name: "elr_lightning.estimate.budget" for name in ("Budget", "per_k_verdict", "verdict")},
        **{name: "elr_lightning.estimate.command" for name in ("estimate_parser", "main")},
    },
    "elr_lightning.cost": {name: "elr_lightning.lightning_cli" for name in ("build_module", "merged_config")},
}  # fmt: skip


class _Forwarding(types.ModuleType):
    """An old module path: reading a name reads it from the module it moved to."""

    def __init__(self, name: str, new: str) -> None:
        super().__init__(name, f"Moved to {new}; see elr_lightning._moved.")
        self.__moved_to__ = new

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        home = MOVED_NAMES.get(self.__name__, {}).get(attr, self.__moved_to__)
        return getattr(importlib.import_module(home), attr)

    def __dir__(self) -> list[str]:
        return sorted(set(dir(importlib.import_module(self.__moved_to__))) | set(MOVED_NAMES.get(self.__name__, {})))


class _MovedLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        new = MOVED_MODULES[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}; import from there ({spec.name} goes in the release after next)",
            DeprecationWarning,
            stacklevel=2,  # the importing line: warnings skips the import system's frames when it counts
        )
        return _Forwarding(spec.name, new)

    def exec_module(self, module: types.ModuleType) -> None:
        importlib.import_module(MOVED_MODULES[module.__name__])


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds the old paths of :data:`MOVED_MODULES`, and nothing else."""

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[types.ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        """A spec that builds the forwarding module for an old path; ``None`` (not mine) for any other name."""
        if fullname not in MOVED_MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedLoader())


def install() -> None:
    """Put :class:`MovedFinder` first on ``sys.meta_path``, once: the old names are the package's own, so no
    other finder (such as an editable install's, which maps the package to its checkout) answers them."""
    if not any(isinstance(finder, MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())
