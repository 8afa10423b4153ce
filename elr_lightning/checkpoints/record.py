"""What an :class:`~elr_lightning.module.ELRModule` checkpoint records beside its weights, and what is checked
when one is saved or loaded."""

from __future__ import annotations

import dataclasses
import os
import posixpath
from typing import Any, Mapping, Optional

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.trainer.states import TrainerFn
from lightning_utilities.core.rank_zero import rank_zero_warn

from elr_lightning.checkpoints.io import listed, non_finite_tensors, state_dict_differences
from elr_lightning.checkpoints.schema import CheckpointConfigError
from elr_lightning.plugin_config import plain_hyperparameters
from elr_lightning.checkpoints.resume import check_resumed_schedule, planned_steps
from elr_lightning.checkpoints.tokenizer import checkpoint_tokenizer, tokenizer_state
from elr_lightning.checkpoints.trust import shown

#: ``arch`` fields that a checkpoint may differ in: they set the init, the RoPE table's length or route replay only.
ARCH_FREE_FIELDS = ("init_std", "max_seq_len", "route_replay")


def changed_arch_fields(saved_arch: Mapping[str, Any], arch: Mapping[str, Any]) -> list[str]:
    """The ``arch`` fields that both hold and that differ, :data:`ARCH_FREE_FIELDS` excepted, in ``arch``'s order."""
    return [key for key in arch if key in saved_arch and key not in ARCH_FREE_FIELDS and saved_arch[key] != arch[key]]


#: The fields of ``ModelCheckpoint``'s state that name files it may later delete or load.
CHECKPOINT_PATH_FIELDS = ("best_model_path", "kth_best_model_path", "last_model_path")


def _inside(path: str, folder: Optional[str]) -> bool:
    if folder is None or not path:
        return not path
    if "://" in folder or "://" in path:  # remote: compared as normalised strings
        return posixpath.normpath(path).startswith(posixpath.normpath(folder).rstrip("/") + "/")
    root = os.path.realpath(folder)
    return os.path.commonpath([os.path.realpath(path), root]) == root and os.path.realpath(path) != root


def drop_foreign_paths(trainer: Any, checkpoint: dict[str, Any]) -> list[str]:
    """Drop, from the checkpoint callbacks' saved state, every path outside the callback's own folder.

    ``ModelCheckpoint`` restores ``last_model_path``, ``best_model_path``, ``kth_best_model_path`` and
    ``best_k_models`` from a checkpoint and later deletes the files they name when it replaces them,
    so a checkpoint whose state named ``runs/x/checkpoints/../../../victim.txt`` would delete a
    user's file at the end of a resumed run. A path is kept only if it resolves (symbolic links
    followed) inside the ``dirpath`` of the callback that restores it; every other one is removed
    from ``checkpoint`` in place, with one warning line. Called by
    :meth:`~elr_lightning.module.ELRModule.on_load_checkpoint`, before Lightning restores the
    callbacks' state. Outside ``fit`` (``validate``, ``test``) no checkpoint callback saves or
    deletes a file, so nothing is dropped and nothing is said.

    Returns:
        The paths dropped.
    """
    state_fn = getattr(getattr(trainer, "state", None), "fn", None)
    if state_fn is not None and state_fn != TrainerFn.FITTING:
        return []
    dropped = []
    states = checkpoint.get("callbacks")
    for callback in getattr(trainer, "checkpoint_callbacks", []):
        state = states.get(callback.state_key) if isinstance(states, dict) else None
        if not isinstance(state, dict):
            continue
        folder = None if callback.dirpath is None else str(callback.dirpath)
        for field in CHECKPOINT_PATH_FIELDS:
            path = state.get(field)
            if isinstance(path, str) and not _inside(path, folder):
                dropped.append(path)
                state[field] = ""
        best = state.get("best_k_models")
        if isinstance(best, dict):
            foreign = [path for path in best if not (isinstance(path, str) and _inside(path, folder))]
            dropped += [str(path) for path in foreign]
            state["best_k_models"] = {path: score for path, score in best.items() if path not in foreign}
    dropped = list(dict.fromkeys(dropped))
    if dropped:
        rank_zero_warn(
            f"the checkpoint's callback state names {len(dropped)} file(s) outside the run's checkpoint folder "
            f"({shown(dropped[0])}{', ...' if len(dropped) > 1 else ''}); ignored: a checkpoint never names a file "
            "outside the run's own folder"
        )
    return dropped


def check_sizes_before_build(
    target: type,
    arguments: Mapping[str, Any],
    checkpoint: Mapping[str, Any],
    source: str,
    available: Optional[int] = None,
    strict: Optional[bool] = None,
) -> None:
    """Refuse a checkpoint whose configuration declares sizes its tensors do not hold, before anything real is built.

    A few bytes of configuration (``arch.vocab_size = 50_000_000``, a width, a layer count) would
    otherwise allocate gigabytes when the module is built, before the state dict's shapes are
    compared. Here the architecture is validated (its bounds: :data:`~elr_lightning.config.MAX_LOOPS`,
    :data:`~elr_lightning.config.MAX_SEQ_LEN`), its layer count is compared with the number of tensors
    present (every layer holds at least one), and then ``target`` is built on the meta device, which
    allocates no memory, and every tensor's shape (and, loading strictly, name) compared with the
    checkpoint's. The shapes must
    be backed by data: a tensor may not declare more bytes than its storage holds (a view that
    repeats one value, stride 0, declares any shape over 4 bytes), and the state dict's tensors
    together at most twice the file's bytes (tied weights count twice).

    Args:
        target: The ``ELRModule`` class the checkpoint names.
        arguments: Its checked constructor arguments (:func:`~elr_lightning.checkpoints.schema.module_arguments`).
        checkpoint: The checkpoint read as data.
        source: The file, for messages.
        available: The bytes of the file the checkpoint was read from; ``None`` where its sizes
            were bounded otherwise (a sharded folder's index).
        strict: ``False`` (``load_from_checkpoint(strict=False)``) skips the comparison of the tensors'
            names, as the load does; shapes are compared always.

    Raises:
        CheckpointConfigError: One line naming the field or the first tensors whose shapes differ.
    """
    from elr_lightning.config import ModelConfig

    state = checkpoint.get("state_dict")
    arch = arguments.get("arch")
    if not isinstance(state, Mapping) or arch is None:
        return
    _check_tensors_backed(state, source, available)
    try:
        config = ModelConfig(**arch) if isinstance(arch, Mapping) else arch
    except (ValueError, TypeError) as err:
        raise CheckpointConfigError(f"{source!r}: hyper_parameters.{err}") from None
    layers = config.n_in + config.n_rec + config.n_out
    if layers > len(state):
        raise CheckpointConfigError(
            f"{source!r}: hyper_parameters.arch declares {layers} layers (n_in + n_rec + n_out), but the checkpoint "
            f"holds {len(state)} tensors; it does not describe its own weights, use another checkpoint"
        )
    with torch.device("meta"):
        probe = target(**{**arguments, "arch": config})
    own = probe.state_dict()
    shapes = [
        f"{key} {tuple(state[key].shape)} in the file, {tuple(tensor.shape)} by hyper_parameters"
        for key, tensor in own.items()
        if hasattr(state.get(key), "shape") and tuple(state[key].shape) != tuple(tensor.shape)
    ]
    if shapes:
        raise CheckpointConfigError(
            f"{source!r}: hyper_parameters.arch does not fit the checkpoint's tensors ({listed(shapes, 2)}); "
            "it was changed after saving, use another checkpoint"
        )
    if strict is not False and probe.strict_loading:
        problems = state_dict_differences(state, own)
        if problems:
            raise CheckpointConfigError(
                f"{source!r}: its hyper_parameters do not describe its tensors: {'; '.join(problems)}; build the "
                "model with the checkpoint's own values, or use another checkpoint"
            )


def _check_tensors_backed(state: Mapping[str, Any], source: str, available: Optional[int]) -> None:
    """Refuse state-dict tensors that declare more bytes than their storage, or than the file, holds."""
    total = 0
    for key, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):  # a meta tensor keeps its storage's size too
            continue
        declared = tensor.numel() * tensor.element_size()
        held = tensor.untyped_storage().nbytes()
        if declared > held:
            raise CheckpointConfigError(
                f"{source!r}: state_dict.{key} declares {list(tensor.shape)} ({declared} bytes) over {held} bytes of "
                "data (a view that repeats them), which building the model would allocate; use another checkpoint"
            )
        total += declared
    if available is not None and total > 2 * available:
        raise CheckpointConfigError(
            f"{source!r}: the state_dict's tensors declare {total} bytes over a file of {available} (they share their "
            "data), which building the model would allocate; use another checkpoint"
        )


def record_checkpoint(module: LightningModule, checkpoint: dict[str, Any]) -> None:
    """Fill ``checkpoint`` for :meth:`~elr_lightning.module.ELRModule.on_save_checkpoint` (``module``); refuse non-finite weights.

    Writes the hyperparameters as plain data (:func:`~elr_lightning.plugin_config.plain_value`, so the
    file loads with ``torch.load(..., weights_only=True)``) and ``checkpoint["elr"]``: the
    architecture, the loop schedule's inputs when attached to a trainer, and the tokenizer.

    An update that makes the weights non-finite is only seen by the next forward pass; a checkpoint
    saved in between would replace (with ``save_top_k: 1``, delete) the last good one. Every rank
    checks its own tensors and all agree, so no file is written and every rank stops.

    Raises:
        FloatingPointError: Naming the first non-finite tensors.
        PluginConfigError: A plug-in cannot be saved as its ``class_path`` and ``init_args``, naming the
            field and the fix. Nothing is written; the last checkpoint is kept.
    """
    if "hyper_parameters" in checkpoint:
        checkpoint["hyper_parameters"] = plain_hyperparameters(checkpoint["hyper_parameters"])
    bad = non_finite_tensors(checkpoint)
    attached = module._trainer is not None  # also called outside a run, e.g. by ``elr import``
    if not (module.trainer.strategy.reduce_boolean_decision(not bad, all=True) if attached else not bad):
        found = f"non-finite values in {listed(bad)}" if bad else "non-finite values on another rank"
        step = module.trainer.global_step if attached else checkpoint.get("global_step", 0)
        raise FloatingPointError(
            f"not saving the checkpoint of step {step}: {found}; the last good checkpoint "
            "is kept. Lower model.init_args.lr, raise warmup_steps, or set trainer.gradient_clip_val"
        )
    checkpoint["elr"] = {"arch": dataclasses.asdict(module.arch)}
    if attached:
        checkpoint["elr"]["schedule"] = {
            "num_shards": module.num_shards(),
            "seed": module.seed,
            "total_steps": planned_steps(module.trainer),
        }
    if module.tokenizer is not None:
        checkpoint["elr"]["tokenizer"] = tokenizer_state(module.tokenizer)


def check_loaded_checkpoint(module: LightningModule, checkpoint: dict[str, Any]) -> None:
    """Refuse a checkpoint of another architecture, or with(out) heads ``module`` (an ``ELRModule``) lacks (has).

    For :meth:`~elr_lightning.module.ELRModule.on_load_checkpoint`: compares the ``arch`` saved by :func:`record_checkpoint`
    field by field, and (unless ``strict_loading`` is off) the names and shapes of the checkpoint's
    tensors with the module's, before Lightning's strict load; a resumed fit must keep its loop
    schedule's inputs. Restores the saved tokenizer unless :meth:`~elr_lightning.module.ELRModule.setup` already took one
    from the data module (a resumed run keeps the data's tokenizer). Paths in the checkpoint callbacks'
    saved state that lie outside their folders are dropped (:func:`drop_foreign_paths`).

    Raises:
        ValueError: Naming every difference and the fix.
    """
    problems = []
    saved_arch = checkpoint.get("elr", {}).get("arch")
    if saved_arch is not None:
        mine = dataclasses.asdict(module.arch)
        problems += [
            f"arch.{key}: checkpoint {saved_arch[key]!r}, this model {mine[key]!r}"
            for key in changed_arch_fields(saved_arch, mine)
        ]
    state = checkpoint.get("state_dict")
    if state is not None and module.strict_loading:
        problems += state_dict_differences(state, module.state_dict())
    if problems:
        raise ValueError(
            "this checkpoint does not fit this model:\n  - " + "\n  - ".join(problems) + "\nBuild the model "
            "with the checkpoint's model.init_args (its hyper_parameters), or start a new run from it with "
            "elr_lightning.callbacks.DelayedMixedDepth(init_from=...)"
        )
    if module._trainer is not None:
        drop_foreign_paths(module.trainer, checkpoint)
    if module._trainer is not None and module.trainer.state.fn == "fit":
        check_resumed_schedule(
            checkpoint.get("elr", {}).get("schedule"),
            module.trainer,
            ranks=module.data_parallel_layout()[1],
            virtual_ranks=module.virtual_ranks,
            seed=module.seed,
        )
    if module.tokenizer is None:
        module.tokenizer = checkpoint_tokenizer(checkpoint)
