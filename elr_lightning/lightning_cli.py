"""``ELRCLI``: LightningCLI with ELR's defaults and its checks of ``--ckpt_path``; and a config-only parse."""

from __future__ import annotations

import dataclasses
import glob
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any, Optional, Union

import torch
import yaml
from jsonargparse import ArgumentParser
from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override

from elr_lightning.arguments import SuggestingParser
from elr_lightning.callbacks.exclusive_save_config import ExclusiveSaveConfig
from elr_lightning.checkpoints.io import verify_checkpoint_path
from elr_lightning.config import ModelConfig
from elr_lightning.data import resolve_sources
from elr_lightning.module import ELRModule
from elr_lightning.checkpoints.record import changed_arch_fields
from elr_lightning.checkpoints.safe_load import load_weights_only
from elr_lightning.tokenizers import load_tokenizer


#: ``ELRModule`` arguments that a resumed ``fit`` cannot change: the restored optimizer and LR
#: schedule carry the checkpoint's values.
OPTIMIZER_FIELDS = ("lr", "weight_decay", "betas", "warmup_steps", "min_lr_ratio")


class ELRArgumentParser(SuggestingParser, LightningArgumentParser):
    """LightningCLI's parser, with an unknown option's error naming the nearest valid one (:class:`SuggestingParser`)."""


class ELRCLI(LightningCLI):
    """LightningCLI with ELR's defaults: subclassable model and data by ``class_path``, seed 0.

    ``--ckpt_path`` is checked before anything loads it (:func:`verify_checkpoint_path`), and the
    checkpoint's hyperparameters never silently replace the command line's: an architecture that
    differs from the checkpoint's is refused naming the fields, as ``load_from_checkpoint`` does,
    and so is an optimizer setting that differs when resuming ``fit``. No option is taken for a
    longer one it begins (``--trainer.max_step`` is an error naming ``--trainer.max_steps``), and
    ``predict`` is not a subcommand: nothing would write its per-sequence losses.
    """

    @staticmethod
    @override
    def subcommands() -> dict[str, set[str]]:
        """``fit``, ``validate`` and ``test``, as LightningCLI defines them."""
        return {name: skip for name, skip in LightningCLI.subcommands().items() if name != "predict"}

    @override
    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        """Each parser (the main one and every subcommand's) raises its errors and matches no prefixes."""
        return super().init_parser(**{"exit_on_error": False, "allow_abbrev": False, **kwargs})

    @override
    def before_instantiate_classes(self) -> None:
        """Check data paths before the model is built, so a typo fails in seconds, not after allocating."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        strategy = (config.get("trainer") or {}).get("strategy")
        if isinstance(strategy, str) and "." in strategy:
            raise ValueError(
                f"--trainer.strategy {strategy!r} is a class path, not a Lightning strategy name; give it as "
                f"--trainer.strategy.class_path {strategy} (in YAML: strategy: {{class_path: {strategy}}})"
            )
        if self.subcommand in ("validate", "test"):
            log_into_checkpoint_run(config, self.subcommand)
        init_args = config.get("data", {}).get("init_args", {}) or {}
        if "sources" in init_args:
            resolve_sources(init_args["sources"])
        if "tokenizer" in init_args:
            load_tokenizer(init_args["tokenizer"])

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Any:
        """Lightning's trainer; with :class:`~elr_lightning.callbacks.StepProgressBar` where Lightning would pick its rich bar unconfigured."""
        from lightning.pytorch.callbacks import ProgressBar
        from lightning.pytorch.utilities.imports import _RICH_AVAILABLE

        from elr_lightning.callbacks.step_progress_bar import StepProgressBar

        trainer = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        callbacks = trainer.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, list) else [callbacks]
        shows_bar = trainer.get("enable_progress_bar") is not False
        if _RICH_AVAILABLE and shows_bar and not any(isinstance(c, ProgressBar) for c in callbacks):
            kwargs["callbacks"] = [*callbacks, StepProgressBar()]
        return super().instantiate_trainer(**kwargs)

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """``--skip_memory_check``: train even where the estimated step exceeds the GPU."""
        parser.add_argument(
            "--skip_memory_check", type=bool, default=False,
            help="On a GPU, train even where the estimated peak memory of a step exceeds the device.",
        )  # fmt: skip

    def before_fit(self) -> None:
        """On a GPU, log the run's estimated peak memory per rank once, and refuse a step that does not fit."""
        from elr_lightning.estimate.cache import default_cache_dir
        from elr_lightning.estimate.fit import log_fit_estimate  # it reads configs through this module

        config = self.config[self.subcommand] if self.subcommand else self.config
        log_fit_estimate(
            self.trainer, self.model, self.datamodule, check=not config.get("skip_memory_check", False),
            cache_dir=default_cache_dir(),
        )  # fmt: skip

    @override
    def _parse_ckpt_path(self) -> None:
        # Lightning's version merges the checkpoint's hyperparameters over the command line, so a new
        # d_model or lr was ignored without a word (and config.yaml disagreed with hparams.yaml).
        subcommand = self.config.get("subcommand")
        if not subcommand:
            return
        config = self.config[subcommand]
        ckpt_path = config.get("ckpt_path")
        if ckpt_path is None:
            return
        if ckpt_path == "last" and not os.path.exists("last"):
            ckpt_path = config["ckpt_path"] = resolve_last_checkpoint(config.get("trainer"), subcommand)
            if ckpt_path is None:
                return
        verify_checkpoint_path(str(ckpt_path), "--ckpt_path")
        if not os.path.isfile(str(ckpt_path)):
            return
        path = str(ckpt_path)
        checkpoint = load_weights_only(path)  # mapped: only the small hparams entries are read
        model = config.get("model")
        mine = model.get("init_args") if model is not None and "init_args" in model else model
        problems = checkpoint_conflicts(checkpoint, mine.as_dict() if mine is not None else {}, subcommand)
        if problems:
            raise ValueError(
                f"--ckpt_path {path!r} does not fit this command's model: {'; '.join(problems)}. "
                "Use the checkpoint's values (its run's config.yaml), or start a new run from its weights with "
                "elr_lightning.callbacks.DelayedMixedDepth(init_from=...)"
            )


def log_into_checkpoint_run(config: Any, subcommand: str) -> None:
    """Point ``validate``'s or ``test``'s logger into the run folder of its checkpoint, not a new version.

    A checkpoint that ``elr fit`` wrote, ``<run>/checkpoints/<name>.ckpt``, is scored with its logs
    in ``<run>/validate`` (or ``<run>/test``): the run's events stay together, and no new
    ``version_N`` folder appears beside the run, where it would move a later ``elr fit`` off the
    paths it would otherwise take. Only a logger of the config (a ``class_path`` with a
    ``save_dir``) whose ``version`` is not set is pointed there; any other checkpoint, or a logger
    given its own version, logs where Lightning puts it.
    """
    ckpt_path = config.get("ckpt_path")
    trainer = config.get("trainer") or {}
    logger = trainer.get("logger") if hasattr(trainer, "get") else None
    init_args = logger.get("init_args") if hasattr(logger, "get") and logger.get("class_path") else None
    if not isinstance(ckpt_path, str) or init_args is None or "save_dir" not in init_args:
        return
    folder = os.path.dirname(os.path.abspath(ckpt_path))
    if os.path.basename(folder) != "checkpoints" or init_args.get("version") is not None:
        return
    init_args["save_dir"], init_args["name"], init_args["version"] = os.path.dirname(folder), "", subcommand


def last_checkpoint_patterns(trainer: Any) -> list[str]:
    """Where ``last.ckpt`` files of earlier runs of a trainer config lie, as glob patterns.

    Every run logs to a new ``version_N`` folder, so Lightning's own ``ckpt_path="last"`` (which
    looks in the new run's folder only) never finds the previous run's checkpoint. These patterns
    cover the version folders of the configured loggers (``save_dir/name/version_*/checkpoints``),
    Lightning's default one under ``default_root_dir``, and every checkpoint callback's ``dirpath``.
    """

    def get(node: Any, key: str, default: Any = None) -> Any:
        return node.get(key, default) if hasattr(node, "get") else default

    root = str(get(trainer, "default_root_dir") or os.getcwd())
    logger = get(trainer, "logger", True)
    loggers = logger if isinstance(logger, list) else [logger]
    log_roots = [os.path.join(root, "lightning_logs")] if logger is True or logger is None else []
    for entry in loggers:
        init_args = get(entry, "init_args") or {}
        save_dir = get(init_args, "save_dir") or get(init_args, "root_dir")
        if save_dir is not None:
            log_roots.append(os.path.join(str(save_dir), str(get(init_args, "name", "lightning_logs") or "")))
    patterns = [os.path.join(glob.escape(r), "version_*", "checkpoints", "last*.ckpt") for r in log_roots]
    patterns.append(os.path.join(glob.escape(root), "checkpoints", "last*.ckpt"))
    for callback in get(trainer, "callbacks") or []:
        dirpath = get(get(callback, "init_args") or {}, "dirpath")
        if dirpath:
            patterns.append(os.path.join(glob.escape(str(dirpath)), "last*.ckpt"))
    return list(dict.fromkeys(patterns))


def resolve_last_checkpoint(trainer: Any, subcommand: str) -> Optional[str]:
    """``--ckpt_path last``: the newest ``last*.ckpt`` of :func:`last_checkpoint_patterns`.

    Args:
        trainer: The parsed ``trainer`` config.
        subcommand: ``fit`` starts from scratch when there is none (a command that resumes itself
            after a crash, run for the first time); every other subcommand needs one.

    Returns:
        The checkpoint path, or ``None`` for a ``fit`` with none to resume.

    Raises:
        FileNotFoundError: No checkpoint was found for a subcommand other than ``fit``.
    """
    patterns = last_checkpoint_patterns(trainer)
    found = [path for pattern in patterns for path in glob.glob(pattern)]
    searched = ", ".join(patterns)
    if not found:
        if subcommand == "fit":
            print(f"elr: --ckpt_path last: no last.ckpt in {searched}; training from scratch", file=sys.stderr)
            return None
        raise FileNotFoundError(
            f"--ckpt_path last: no last.ckpt in {searched}; give the checkpoint file itself to --ckpt_path"
        )
    newest = max(found, key=lambda path: (os.path.getmtime(path), path))
    print(f"elr: --ckpt_path last: {newest}", file=sys.stderr)
    return newest


def checkpoint_conflicts(checkpoint: dict[str, Any], init_args: dict[str, Any], subcommand: str) -> list[str]:
    """Where the command's ``ELRModule`` arguments differ from a checkpoint's, as ``field: ours vs theirs``.

    Compares the architecture (all of ``arch`` but the fields a checkpoint may differ in) for every
    subcommand, and :data:`OPTIMIZER_FIELDS` for ``fit``.
    """
    saved_arch = checkpoint.get("elr", {}).get("arch")
    hparams = checkpoint.get("hyper_parameters", {}) or {}
    problems = []
    if saved_arch is not None:
        arch = dataclasses.asdict(ModelConfig(**(init_args.get("arch") or {})))
        problems += [
            f"model.init_args.arch.{key} is {arch[key]!r}, the checkpoint's {saved_arch[key]!r}"
            for key in changed_arch_fields(saved_arch, arch)
        ]
    if subcommand == "fit":
        for key in OPTIMIZER_FIELDS:
            if key in hparams and key in init_args and _plain(init_args[key]) != _plain(hparams[key]):
                problems.append(
                    f"model.init_args.{key} is {init_args[key]!r}, the checkpoint's {hparams[key]!r} (a resumed "
                    "run restores the optimizer and LR schedule)"
                )
    return problems


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, (tuple, list)) else value


class ConfigOnlyCLI(ELRCLI):
    """Parses and merges configs exactly as ``elr fit`` does, and instantiates nothing.

    ``ConfigOnlyCLI(ELRModule, TextDataModule, ..., run=False, args=["--config", a, "--config", b])``
    leaves the merged config (``trainer``, ``model``, ``data``) in ``.config``: later files and
    flags override earlier ones, ``callbacks+`` appends, as for training.
    """

    @override
    def before_instantiate_classes(self) -> None:
        """Nothing: the data paths need not exist to read a config."""

    @override
    def instantiate_classes(self) -> None:
        """Nothing: only the parsed config is wanted."""


def make_cli(
    cls: type[ELRCLI],
    args: Optional[list[str]] = None,
    run: bool = True,
    trainer_defaults: Optional[dict[str, Any]] = None,
) -> ELRCLI:
    """``cls`` with ``elr``'s settings: any ``ELRModule`` and ``LightningDataModule`` by ``class_path``,
    seed 0, the claimed log folder, parse errors raised (``elr`` prints them in one line).
    ``trainer_defaults`` are passed on to LightningCLI (e.g. extra callbacks of an in-process run).

    ``elr``'s subcommands pass ``args`` on purpose while ``sys.argv`` holds their own flags, so
    LightningCLI's warning about having both is silenced here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"LightningCLI's args parameter is intended")
        return cls(
            ELRModule,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            seed_everything_default=0,
            save_config_callback=ExclusiveSaveConfig,
            save_config_kwargs={"overwrite": True},
            parser_class=ELRArgumentParser,
            run=run,
            trainer_defaults=trainer_defaults,
            args=args,
        )


def merged_config(paths: Union[str, Sequence[str]]) -> dict[str, Any]:
    """The ``elr fit`` configuration of one or more YAML files, merged exactly as ``elr fit`` merges them.

    Later files override earlier ones and ``trainer.callbacks+`` appends (so a callbacks fragment
    such as ``callbacks/delayed_mixed_depth.yaml`` counts); nothing is instantiated.

    Raises:
        FileNotFoundError: A path does not exist.
        ValueError: The files hold no ``model`` section.
    """
    paths = [paths] if isinstance(paths, str) else list(paths)
    for path in paths:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--config {path!r} does not exist")
    cli = make_cli(ConfigOnlyCLI, [arg for path in paths for arg in ("--config", path)], run=False)
    config = cli.parser.dump(cli.config, format="yaml", skip_none=False, skip_link_targets=False)
    merged = yaml.safe_load(config) or {}
    if not (merged.get("model") or {}).get("class_path"):
        raise ValueError(
            f"{', '.join(paths)} has no 'model' section; pass an `elr fit` config such as config/quickstart.yaml"
        )
    return merged


def build_module(config: dict[str, Any]) -> ELRModule:
    """Instantiate the ``model`` section of a :func:`merged_config` on the meta device."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(ELRModule, "model", required=True)
    cfg = parser.parse_object({"model": config["model"]})
    with torch.device("meta"):
        return parser.instantiate_classes(cfg).model
