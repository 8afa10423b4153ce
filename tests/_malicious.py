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
from torch.distributed.checkpoint.metadata import MetadataIndex

from elr_lightning.config import ModelConfig
from elr_lightning.hf.export import save_module_checkpoint
from elr_lightning.module import ELRModule

#: The variable that names the marker file at the time the payload runs.
MARKER_ENV = "ELR_MARKER"

#: What the payloads run: create the marker file (a shell command would run the same way).
PAYLOAD = f"import os; open(os.environ.get({MARKER_ENV!r}, 'MARKER'), 'w').write('code from the file ran')"

#: The same as a shell command, for payloads that name ``subprocess.Popen`` or ``os.system``.
SHELL_PAYLOAD = f'echo "code from the file ran" > "${{{MARKER_ENV}:-MARKER}}"'

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


def cli_checkpoint(path: Path) -> dict[str, Any]:
    """A good checkpoint shaped as ``elr fit`` writes it: Lightning's instantiator and the module's class path."""
    raw = good_checkpoint(path)
    raw["hyper_parameters"]["_instantiator"] = "lightning.pytorch.cli.instantiate_module"
    raw["hyper_parameters"]["_class_path"] = "elr_lightning.ELRModule"
    return raw


def any_typed(path: Path, slot: str, spec: dict[str, Any]) -> Path:
    """A CLI checkpoint whose ``arch.<slot>`` (``mixers`` or ``rope_scaling``, typed ``Any`` inside) holds ``spec``.

    jsonargparse built class specifications found in such values, and a module already imported
    (``subprocess``, ``logging``) counted as trusted, so ``subprocess.Popen`` ran a shell command.
    The payload is in both ``hyper_parameters.arch`` and ``elr.arch``, so no architecture check stops it.
    """
    raw = cli_checkpoint(path)
    for arch in (raw["hyper_parameters"]["arch"], raw["elr"]["arch"]):
        arch[slot] = {"payload": spec}
    torch.save(raw, path)
    return path


def popen(shell: str = SHELL_PAYLOAD) -> dict[str, Any]:
    """A class specification that runs ``shell`` when built."""
    return {"class_path": "subprocess.Popen", "init_args": {"args": shell, "shell": True}}


def file_handler(victim: Path) -> dict[str, Any]:
    """A class specification that empties ``victim`` when built."""
    return {"class_path": "logging.FileHandler", "init_args": {"filename": str(victim), "mode": "w"}}


def long_class_path(path: Path) -> Path:
    """A checkpoint whose update rule's class path is over 512 characters (the trust check once skipped those)."""
    raw = good_checkpoint(path)
    raw["hyper_parameters"]["update"] = {"class_path": f"{EVIL_MODULE}." + "A" * 600, "init_args": {}}
    torch.save(raw, path)
    return path


def legacy_key(path: Path, key: str) -> Path:
    """A checkpoint naming ``elr_evil_plugin.Update`` under Lightning's legacy key ``key`` (``hparams`` or
    ``module_arguments``), which Lightning merges into the hyperparameters."""
    raw = good_checkpoint(path)
    del raw["hyper_parameters"]["update"]
    raw[key] = {"update": {"class_path": f"{EVIL_MODULE}.Update", "init_args": {"beta": 0.5}}}
    torch.save(raw, path)
    return path


def os_system_index(shell: str = SHELL_PAYLOAD) -> bytes:
    """A protocol-4 pickle of about 100 bytes: ``("torch.distributed.checkpoint.metadata", "os.system")(shell)``.

    Python's unpickler resolves a dotted name from the module it is given, and that module imports ``os``.
    """
    def text(value: str) -> bytes:
        raw = value.encode()
        return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE

    return b"\x80\x04" + text("torch.distributed.checkpoint.metadata") + text("os.system") + b"\x93" + text(shell) + b"\x85R."


def _sharded_base(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    folder.mkdir(parents=True)
    raw = good_checkpoint(folder / "full.ckpt")
    (folder / "full.ckpt").unlink()
    return raw, raw.pop("state_dict")


def sharded_os_system(folder: Path) -> Path:
    """A sharded checkpoint folder whose DCP index is :func:`os_system_index`."""
    raw, state = _sharded_base(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"state_dict": state}, checkpoint_id=str(folder), no_dist=True)
    (folder / ".metadata").write_bytes(os_system_index())
    torch.save(raw, folder / "meta.pt")
    return folder


def sharded_bytes_entry(folder: Path) -> Path:
    """A sharded folder whose index declares a weight's key as a non-tensor entry, which a shard holds as a pickle.

    torch's own load planner unpickles such an entry with ``torch.load(..., weights_only=False)``.
    """
    raw, state = _sharded_base(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"state_dict": state, "evil": Payload()}, checkpoint_id=str(folder), no_dist=True)  # torch.save'd
    with open(folder / ".metadata", "rb") as f:
        index = pickle.load(f)  # our own, just written
    key = f"state_dict.{next(iter(state))}"
    index.state_dict_metadata[key] = index.state_dict_metadata.pop("evil")
    index.storage_data[MetadataIndex(key)] = index.storage_data.pop(MetadataIndex("evil"))
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(index, f)
    torch.save(raw, folder / "meta.pt")
    return folder


# ---- round 3: sizes before shapes, shards outside the folder -----------------------------------------


def oversized(path: Path, **arch: Any) -> Path:
    """A good checkpoint whose ``arch`` (in ``hyper_parameters`` and ``elr``) declares ``arch``'s sizes."""
    raw = cli_checkpoint(path)
    for saved in (raw["hyper_parameters"]["arch"], raw["elr"]["arch"]):
        saved.update(arch)
    torch.save(raw, path)
    return path


def with_hparams(path: Path, **hparams: Any) -> Path:
    """A good checkpoint whose ``hyper_parameters`` hold ``hparams`` (e.g. a list-valued ``_instantiator``)."""
    raw = cli_checkpoint(path)
    raw["hyper_parameters"].update(hparams)
    torch.save(raw, path)
    return path


def depth_checkpoint(path: Path, **datamodule: Any) -> Path:
    """A checkpoint of a parity model whose saved data module says ``datamodule`` (``eval_difficulties``, ...)."""
    from elr_lightning.checkpoints.tokenizer import tokenizer_state
    from elr_lightning.tokenizers import CharTokenizer

    raw = good_checkpoint(path)
    raw["elr"]["tokenizer"] = tokenizer_state(CharTokenizer("01^"))
    raw["datamodule_hyper_parameters"] = {"task": "parity", **datamodule}
    torch.save(raw, path)
    return path


def deflated_member(path: Path, mib: int = 4095) -> Path:
    """A good checkpoint with one more record: ``mib`` MiB of zeros, deflated to a few MiB, with a right CRC.

    ``zipfile`` writes it through a compressor that repeats one fully flushed deflate segment per
    MiB (each is independent of the data before it), so building it costs a CRC pass, not compression.
    """
    import zipfile
    import zlib

    good_checkpoint(path)
    zeros = bytes(1 << 20)
    shared = zlib.compressobj(9, zlib.DEFLATED, -15)
    segment = shared.compress(zeros) + shared.flush(zlib.Z_FULL_FLUSH)

    class Repeat:
        def compress(self, data: bytes) -> bytes:
            return segment

        def flush(self) -> bytes:
            return shared.flush()

    original = zipfile._get_compressor
    zipfile._get_compressor = lambda *args, **kwargs: Repeat()
    try:
        with zipfile.ZipFile(path, "a") as archive:
            info = zipfile.ZipInfo(f"{path.stem}/data/bomb")
            info.compress_type = zipfile.ZIP_DEFLATED
            with archive.open(info, "w", force_zip64=True) as member:
                for _ in range(mib):
                    member.write(zeros)
    finally:
        zipfile._get_compressor = original
    return path


def sharded_good(folder: Path) -> Path:
    """A well-formed sharded checkpoint folder of the tiny model."""
    raw, state = _sharded_base(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"state_dict": state}, checkpoint_id=str(folder), no_dist=True)
    torch.save(raw, folder / "meta.pt")
    return folder


def _rewrite_index(folder: Path, change: Any) -> Path:
    with open(folder / ".metadata", "rb") as f:
        index = pickle.load(f)  # our own, just written
    change(index)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(index, f)
    return folder


def sharded_storage_at(folder: Path, where: str, victim: Path) -> Path:
    """A sharded folder whose index stores the embedding in ``where``: ``absolute`` (``victim``), ``dotdot``
    (``victim`` by ``..``), ``symlink`` (a link in the folder to ``victim``) or ``fifo`` (a FIFO in the folder)."""
    import dataclasses
    import os

    sharded_good(folder)
    if where == "symlink":
        os.symlink(victim, folder / "link.distcp")
    elif where == "fifo":
        os.mkfifo(folder / "pipe.distcp")
    relative = {"absolute": str(victim), "dotdot": os.path.relpath(victim, folder), "symlink": "link.distcp",
                "fifo": "pipe.distcp"}[where]  # fmt: skip

    def change(index: Any) -> None:
        key = next(k for k in index.storage_data if k.fqn == "state_dict.model.embed.weight")
        index.storage_data[key] = dataclasses.replace(index.storage_data[key], relative_path=relative, offset=0)

    return _rewrite_index(folder, change)


def sharded_huge_tensor(folder: Path, rows: int = 4_000_000, width: int = 128) -> Path:
    """A sharded folder whose index declares the embedding as ``rows x width`` floats over its few real bytes."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    sharded_good(folder)

    def change(index: Any) -> None:
        entry = index.state_dict_metadata["state_dict.model.embed.weight"]
        entry.size = torch.Size([rows, width])
        entry.chunks = [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([rows, width]))]

    return _rewrite_index(folder, change)


def linked_meta(folder: Path, victim: Path) -> Path:
    """A sharded folder whose ``meta.pt`` is a link to a file outside it."""
    import os

    sharded_good(folder)
    (folder / "meta.pt").unlink()
    os.symlink(victim, folder / "meta.pt")
    return folder


def repeated_view(path: Path, rows: int = 50_000_000) -> Path:
    """A checkpoint of ``rows`` tokens whose embedding and head are one float repeated (stride 0): 2 KB on disk.

    Its ``arch`` and its shapes agree, so only the bytes behind the shapes tell it from a real one.
    """
    raw = cli_checkpoint(path)
    for saved in (raw["hyper_parameters"]["arch"], raw["elr"]["arch"]):
        saved["vocab_size"] = rows
    for key in ("model.embed.weight", "model.head.weight"):
        raw["state_dict"][key] = torch.zeros(1).expand(rows, ARCH["d_model"])
    torch.save(raw, path)
    return path


def sharded_overlapping(folder: Path) -> Path:
    """A sharded folder whose index stores every tensor in the same bytes of one shard (each read anew)."""
    import dataclasses

    sharded_good(folder)

    def change(index: Any) -> None:
        first = next(iter(index.storage_data.values()))
        for key, info in index.storage_data.items():
            index.storage_data[key] = dataclasses.replace(
                info, relative_path=first.relative_path, offset=0, length=max(info.length, first.length)
            )

    return _rewrite_index(folder, change)


def fifo_checkpoint(path: Path) -> Path:
    """A FIFO named like a checkpoint: opening it to read blocks until someone writes."""
    import os

    os.mkfifo(path)
    return path
