"""Hostile files for the checkpoint-safety tests: each leaves a marker file behind if any of its code runs.

The marker's path is read from the ``ELR_MARKER`` environment variable when the code runs, so each
entry point can be run with its own marker. Every builder starts from a well-formed file (a real
ELR checkpoint, a real sharded folder, a real ``elr export`` folder), so a loader refuses it for the
one thing that is wrong with it, not for being broken otherwise.
"""

from __future__ import annotations

import json
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from elr_lightning.config import ModelConfig
from elr_lightning.hf.export import save_module_checkpoint
from elr_lightning.module import ELRModule

#: The variable that names the marker file at the time the payload runs.
MARKER_ENV = "ELR_MARKER"

#: What the payloads run: create the marker file (a shell command would run the same way).
PAYLOAD = f"import os; open(os.environ.get({MARKER_ENV!r}, 'MARKER'), 'w').write('code from the file ran')"

#: A module whose import runs code; the class-path variants name it. Its folder must be on ``sys.path``.
EVIL_MODULE = "elr_evil_plugin"
EVIL_MODULE_SOURCE = f'''"""Importing this module runs its top-level code: what a checkpoint must never cause."""
{PAYLOAD}

from elr_lightning.mixers import Attention
from elr_lightning.sampling import FixedLoops
from elr_lightning.updates import FixedDelta


class Update(FixedDelta):
    pass


class Mixer(Attention):
    pass


class Sampler(FixedLoops):
    pass
'''

#: The tiny architecture of every hostile checkpoint (the ``elr fit`` config of the tests fits it).
ARCH = dict(vocab_size=256, d_model=16, n_heads=2, n_in=1, n_rec=1, n_out=0, max_seq_len=32, max_loops=2)


class Payload:
    """Unpickling this object calls ``exec(PAYLOAD)``."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return exec, (PAYLOAD,)


def good_checkpoint(path: Path) -> dict[str, Any]:
    """Write a real checkpoint of a tiny ELR model at ``path``; return its contents."""
    torch.manual_seed(0)
    save_module_checkpoint(ELRModule(arch=ModelConfig(**ARCH)), path)
    return torch.load(path, weights_only=True)


def write_evil_module(folder: Path) -> Path:
    """Write :data:`EVIL_MODULE` into ``folder`` (put it on ``sys.path`` / ``PYTHONPATH``)."""
    path = folder / f"{EVIL_MODULE}.py"
    path.write_text(EVIL_MODULE_SOURCE)
    return path


def pickled_payload(path: Path) -> Path:
    """A checkpoint whose hyperparameters hold a pickled object that runs :data:`PAYLOAD` when unpickled.

    The form of a checkpoint of an earlier version (pickled plug-ins), with the plug-in replaced.
    """
    raw = good_checkpoint(path)
    raw["hyper_parameters"]["update"] = Payload()
    torch.save(raw, path)
    return path


def untrusted_plugin(path: Path) -> Path:
    """A checkpoint that loads with ``weights_only=True`` and names ``elr_evil_plugin.Update`` as its update rule."""
    raw = good_checkpoint(path)
    raw["hyper_parameters"]["update"] = {"class_path": f"{EVIL_MODULE}.Update", "init_args": {"beta": 0.5}}
    torch.save(raw, path)
    return path


def untrusted_mixer(path: Path) -> Path:
    """A checkpoint that loads with ``weights_only=True`` and names ``elr_evil_plugin.Mixer`` in ``arch.mixers``."""
    raw = good_checkpoint(path)
    for arch in (raw["hyper_parameters"]["arch"], raw["elr"]["arch"]):
        arch["mixers"] = {"attention": f"{EVIL_MODULE}.Mixer"}
    torch.save(raw, path)
    return path


def untrusted_in_a_string(path: Path) -> Path:
    """A checkpoint whose sampler takes another sampler given as a YAML string that names ``elr_evil_plugin.Sampler``.

    jsonargparse reads such a string as YAML, so the class path inside it is resolved (imported) too.
    """
    raw = good_checkpoint(path)
    raw["hyper_parameters"]["sampler"] = {
        "class_path": "elr_lightning.callbacks.delayed_mixed_depth.DelayedSampler",
        "init_args": {"after": f"class_path: {EVIL_MODULE}.Sampler", "switch_step": 1},
    }
    torch.save(raw, path)
    return path


def sharded(folder: Path, evil: str) -> Path:
    """A sharded (``torch.distributed.checkpoint``) checkpoint folder with a hostile ``.metadata`` or ``meta.pt``.

    Args:
        folder: The folder to create.
        evil: ``"metadata"``: DCP's index is a pickle that runs :data:`PAYLOAD`; ``"meta"``: ``meta.pt``
            holds the pickled payload.
    """
    folder.mkdir(parents=True)
    raw = good_checkpoint(folder / "full.ckpt")
    (folder / "full.ckpt").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"state_dict": raw.pop("state_dict")}, checkpoint_id=str(folder), no_dist=True)
    if evil == "meta":
        raw["hyper_parameters"]["update"] = Payload()
    elif evil == "metadata":
        (folder / ".metadata").write_bytes(pickle.dumps(Payload()))  # DCP reads it with pickle.load
    else:
        raise ValueError(f"evil={evil!r}")
    torch.save(raw, folder / "meta.pt")
    return folder


def hf_export_naming_untrusted_mixer(folder: Path, export: Path) -> Path:
    """``folder``: a copy of the ``elr export`` folder ``export`` whose ``config.json`` names ``elr_evil_plugin.Mixer``."""
    shutil.copytree(export, folder)
    config = json.loads((folder / "config.json").read_text())
    config["elr_arch"]["mixers"] = {"attention": f"{EVIL_MODULE}.Mixer"}
    (folder / "config.json").write_text(json.dumps(config))
    return folder
