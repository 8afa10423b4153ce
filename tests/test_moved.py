"""The import paths that moved in the regroup (issue 46) keep working for a release, each with a warning."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import pytest

import elr_lightning
from elr_lightning._moved import MOVED_MODULES, MOVED_NAMES


def fresh_import(name: str):
    sys.modules.pop(name, None)
    if hasattr(elr_lightning, name.rsplit(".", 1)[1]):
        delattr(elr_lightning, name.rsplit(".", 1)[1])
    return importlib.import_module(name)


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_an_old_module_path_warns_with_its_new_home_and_reads_its_names(old: str) -> None:
    new = MOVED_MODULES[old]
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new};"):
        module = fresh_import(old)
    home = importlib.import_module(new)
    public = getattr(home, "__all__", None) or [n for n in vars(home) if not n.startswith("_")]
    assert public
    for name in public:
        assert getattr(module, name) is getattr(home, name), name
    with pytest.raises(AttributeError):
        module.no_such_name  # noqa: B018


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_an_old_path_is_no_module_of_the_package_any_more(old: str) -> None:
    """The table never shadows a real module, and every new home exists."""
    assert importlib.util.find_spec(MOVED_MODULES[old]) is not None
    stem = old.split(".", 1)[1].replace(".", "/")
    root = elr_lightning.__path__[0]
    assert not (os.path.exists(f"{root}/{stem}.py") or os.path.isdir(f"{root}/{stem}"))


def test_names_that_moved_to_another_module_are_read_from_there() -> None:
    for old, names in MOVED_NAMES.items():
        with pytest.warns(DeprecationWarning):
            module = fresh_import(old)
        for name, new in names.items():
            assert getattr(module, name) is getattr(importlib.import_module(new), name)
            assert name in dir(module)


def test_the_guides_old_imports_still_run() -> None:
    """What the 0.1 docs showed: ``from elr_lightning.generation import generate, load_model`` and friends."""
    sys.modules.pop("elr_lightning.generation", None)
    sys.modules.pop("elr_lightning.trust", None)
    with pytest.warns(DeprecationWarning):
        from elr_lightning.generation import generate, load_model
        from elr_lightning.trust import trust_modules
    from elr_lightning.checkpoints.trust import trust_modules as new_trust
    from elr_lightning.inference.generate import generate as new_generate, load_model as new_load

    assert (generate, load_model, trust_modules) == (new_generate, new_load, new_trust)


def test_a_yaml_class_path_at_an_old_module_still_builds() -> None:
    """A config written for 0.1 may name ``elr_lightning.checkpoint_io.AtomicCheckpointIO`` as a trainer plugin."""
    from jsonargparse import ArgumentParser
    from lightning.pytorch.plugins.io import CheckpointIO

    from elr_lightning.checkpoints.io import AtomicCheckpointIO

    sys.modules.pop("elr_lightning.checkpoint_io", None)
    parser = ArgumentParser()
    parser.add_argument("--io", type=CheckpointIO)
    with pytest.warns(DeprecationWarning, match="checkpoint_io moved to elr_lightning.checkpoints.io"):
        config = parser.parse_args(["--io", '{"class_path": "elr_lightning.checkpoint_io.AtomicCheckpointIO"}'])
        built = parser.instantiate_classes(config)
    assert type(built.io) is AtomicCheckpointIO
