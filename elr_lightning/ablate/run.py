"""``elr ablate``: the paper's ablation table (§6) as one command.

Every arm is the user's ``elr fit`` config with one change (:data:`ARMS`), written out as its own
YAML file so it can be rerun alone with ``elr fit --config``. All arms share the seed and the data
order. Each ``(arm, seed)`` run keeps its checkpoints and a CSV log under ``OUT/runs/<arm>-s<seed>``
and a TensorBoard run under ``OUT/tensorboard/<arm>-s<seed>``; a finished run writes
``result.json`` there and is skipped on the next call, an interrupted one resumes from its
``last.ckpt``. The report (:mod:`elr_lightning.ablate.report`) goes to ``OUT/ablate.md``,
``OUT/loss_vs_k.png`` and ``OUT/results.json``. With ``--reasoning N`` each run is also scored on the
synthetic reasoning tasks (:func:`reasoning_scores`) and the report gains their table by task,
difficulty and k. With ``--depth N``, a config that trains on a depth task
(:class:`~elr_lightning.depth.DepthDataModule`) has each run scored on N held-out instances per
difficulty (:func:`depth_scores`): the report gains the exact match by arm, difficulty and k, the
targets of a depth task and ``depth_heatmaps.png``.
"""

from __future__ import annotations

import copy
import csv
import functools
import importlib
import json
import os
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import yaml
from lightning.pytorch.callbacks import ModelCheckpoint

from elr_lightning.ablate.report import write_report
from elr_lightning.files import write_file

#: An arm's change to a config dict (edited in place), given the loop budget K.
ArmEdit = Callable[[dict[str, Any], int], None]


def _model_args(config: dict[str, Any]) -> dict[str, Any]:
    model = config.get("model")
    if not isinstance(model, dict) or "class_path" not in model:
        raise ValueError("the config's model section needs a class_path (e.g. elr_lightning.ELRModule)")
    if model.get("init_args") is None:
        model["init_args"] = {}
    return model["init_args"]


def _set(config: dict[str, Any], key: str, value: Any) -> None:
    _model_args(config)[key] = value


def max_loops_of(config: dict[str, Any]) -> int:
    """K of a config: ``model.init_args.arch.max_loops`` (``ModelConfig``'s default when absent)."""
    from elr_lightning.config import ModelConfig

    arch = _model_args(config).get("arch") or {}
    return int(arch.get("max_loops", ModelConfig().max_loops))


def _update(name: str) -> ArmEdit:
    def edit(config: dict[str, Any], k_max: int) -> None:
        _set(config, "update", {"class_path": f"elr_lightning.updates.{name}"})

    return edit


def _baseline(config: dict[str, Any], k_max: int) -> None:
    _set(config, "update", {"class_path": "elr_lightning.updates.NonRecurrent"})
    _set(config, "sampler", {"class_path": "elr_lightning.sampling.FixedLoops", "init_args": {"k": 1}})
    _set(config, "conditioner", None)
    _set(config, "val_loops", [1])
    _drop_callbacks(config, ("DelayedMixedDepth", "ZeroInitConditioning"))


def _no_overrides(config: dict[str, Any], k_max: int) -> None:
    _set(
        config,
        "sampler",
        {"class_path": "elr_lightning.sampling.OneLoopOverride", "init_args": {"max_loops": k_max, "override_fraction": 0.0}},
    )


def _no_conditioning(config: dict[str, Any], k_max: int) -> None:
    _set(config, "conditioner", None)
    _drop_callbacks(config, ("ZeroInitConditioning",))


def _delayed(config: dict[str, Any], k_max: int) -> None:
    _drop_callbacks(config, ("DelayedMixedDepth", "ZeroInitConditioning"))
    added = [{"class_path": "elr_lightning.callbacks.DelayedMixedDepth", "init_args": {"switch_fraction": 0.75}}]
    if _model_args(config).get("conditioner") is not None:
        added.append({"class_path": "elr_lightning.callbacks.ZeroInitConditioning"})
    _callbacks(config).extend(added)


def _specialist(config: dict[str, Any], k_max: int) -> None:
    _set(config, "sampler", {"class_path": "elr_lightning.sampling.FixedLoops", "init_args": {"k": k_max}})
    _drop_callbacks(config, ("DelayedMixedDepth", "ZeroInitConditioning"))


def _unchanged(config: dict[str, Any], k_max: int) -> None:
    """ELR: the config as given."""


@dataclass(frozen=True)
class Arm:
    """One column of the ablation: a name, what it is, and its edit of the config."""

    name: str
    description: str
    edit: ArmEdit


#: The arms, in the order they run and are reported.
ARMS: dict[str, Arm] = {
    arm.name: arm
    for arm in (
        Arm("baseline", "non-recurrent model of the same layers (k = 1 only)", _baseline),
        Arm("elr", "the config as given", _unchanged),
        Arm("replace", "replace update rule s_i = r_i", _update("Replace")),
        Arm("residual", "residual update rule", _update("Residual")),
        Arm("f0", "no one-loop overrides: shared k uniform over 1..K (f = 0)", _no_overrides),
        Arm("no_cond", "no loop conditioning (eq. 4 off)", _no_conditioning),
        Arm("delayed", "k = 1 for the first 75% of steps, then the config's sampler", _delayed),
        Arm("specialist", "fixed depth: every step at k = K", _specialist),
    )
}


def _trainer(config: dict[str, Any]) -> dict[str, Any]:
    trainer = config.get("trainer")
    if trainer is None:
        trainer = config["trainer"] = {}
    return trainer


def _callbacks(config: dict[str, Any]) -> list[Any]:
    trainer = _trainer(config)
    callbacks = trainer.get("callbacks") or []
    trainer["callbacks"] = callbacks if isinstance(callbacks, list) else [callbacks]
    return trainer["callbacks"]


def _drop_callbacks(config: dict[str, Any], names: tuple[str, ...]) -> None:
    keep = [c for c in _callbacks(config) if str((c or {}).get("class_path", "")).rsplit(".", 1)[-1] not in names]
    _trainer(config)["callbacks"] = keep


def _drop_checkpointing(config: dict[str, Any]) -> None:
    """Remove every ``ModelCheckpoint`` (subclasses included) from the config's callbacks."""

    def checkpoints(entry: Any) -> bool:
        path = str((entry or {}).get("class_path", "")) if isinstance(entry, dict) else ""
        module, _, name = path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name) if module else None
        except (ImportError, AttributeError):
            return False
        return isinstance(cls, type) and issubclass(cls, ModelCheckpoint)

    _trainer(config)["callbacks"] = [c for c in _callbacks(config) if not checkpoints(c)]


def largest_divisor_at_most(n: int, limit: int) -> int:
    """The largest divisor of ``n`` not above ``limit`` (validation and checkpoints land on step ``n``)."""
    return max(d for d in range(1, max(1, min(n, limit)) + 1) if n % d == 0)


def run_name(arm: str, seed: int) -> str:
    """Folder and TensorBoard name of one run."""
    return f"{arm}-s{seed}"


def arm_config(base: dict[str, Any], arm: str, seed: int, out: str, steps: Optional[int] = None) -> dict[str, Any]:
    """The ``elr fit`` config of ``arm`` at ``seed``: ``base`` with the arm's edit and the run's paths.

    Sets ``seed_everything`` and ``data.init_args.seed`` to ``seed`` (same init, loop schedule and
    data order in every arm), ``trainer.max_steps`` to ``steps`` when given, validation and
    checkpoints every ``largest_divisor_at_most(max_steps, val_check_interval)`` steps (so both run
    at the last step), and the loggers to one TensorBoard run and one CSV log per run.

    Raises:
        ValueError: Unknown arm, or a config without ``trainer.max_steps`` and no ``steps``.
    """
    if arm not in ARMS:
        raise ValueError(f"--arms: unknown arm {arm!r}; choose from {', '.join(ARMS)}")
    config = copy.deepcopy(base)
    k_max = max_loops_of(config)
    ARMS[arm].edit(config, k_max)
    trainer = _trainer(config)
    if steps is not None:
        trainer["max_steps"] = steps
    max_steps = trainer.get("max_steps")
    if not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError("the config needs trainer.max_steps >= 1, or pass --steps N")
    interval = trainer.get("val_check_interval")
    every = largest_divisor_at_most(max_steps, interval if isinstance(interval, int) else max_steps)
    trainer.update(val_check_interval=every, check_val_every_n_epoch=None, max_epochs=None)
    name = run_name(arm, seed)
    root = os.path.join(os.path.abspath(out), "runs", name)
    trainer["default_root_dir"] = root
    trainer["logger"] = [
        {
            "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
            "init_args": {"save_dir": os.path.join(os.path.abspath(out), "tensorboard"), "name": name, "version": ""},
        },
        {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": root, "name": "", "version": ""}},
    ]
    _drop_checkpointing(config)
    _callbacks(config).append(
        {
            "class_path": "elr_lightning.callbacks.AtomicModelCheckpoint",
            "init_args": {"dirpath": os.path.join(root, "checkpoints"), "save_last": True, "every_n_train_steps": every},
        }
    )
    config["seed_everything"] = seed
    data = config.setdefault("data", {"class_path": "elr_lightning.data.TextDataModule"})
    data.setdefault("init_args", {})
    data["init_args"] = dict(data["init_args"] or {}, seed=seed)
    return config


def final_metrics(metrics_csv: str) -> tuple[int, dict[int, float], dict[int, float]]:
    """``(step, loss per k, bpb per k)`` of the last validation in a CSVLogger ``metrics.csv``."""
    last: Optional[dict[str, str]] = None
    with open(metrics_csv, newline="") as f:
        for row in csv.DictReader(f):
            if any(key.startswith("val/loss_k") and value for key, value in row.items()):
                last = row
    if last is None:
        raise ValueError(f"{metrics_csv} has no validation row: did the run validate (trainer.val_check_interval)?")
    loss = {int(key[len("val/loss_k") :]): float(v) for key, v in last.items() if key.startswith("val/loss_k") and v}
    bpb = {int(key[len("val/bpb_k") :]): float(v) for key, v in last.items() if key.startswith("val/bpb_k") and v}
    return int(last["step"]), dict(sorted(loss.items())), dict(sorted(bpb.items()))


def reasoning_scores(config: dict[str, Any], n: int) -> dict[str, dict[str, dict[str, float]]]:
    """Exact-match accuracy of a finished run's ``last.ckpt`` on ``n`` held-out reasoning instances per level.

    Scores every task and level the run's data trains on (``data.init_args.reasoning_tasks``; all
    of them when the data module names none) at every k the run validates at.

    Returns:
        ``{task: {level: {k: accuracy}}}`` with string keys, as stored in ``result.json``.
    """
    from elr_lightning.inference.generate import load_model
    from elr_lightning.reasoning import GENERATORS, score_levels
    from elr_lightning.checkpoints.tokenizer import choose_tokenizer
    from elr_lightning.checkpoints.trust import named_packages, trust_modules

    # The checkpoint's plug-ins and layers come from the user's own config, which trained it.
    trust_modules(*named_packages(config.get("model")))
    model, module = load_model(os.path.join(config["trainer"]["default_root_dir"], "checkpoints", "last.ckpt"))
    data_args = (config.get("data") or {}).get("init_args") or {}
    tasks = data_args.get("reasoning_tasks") or dict.fromkeys(GENERATORS)
    tokenizer = choose_tokenizer(module.tokenizer, None, model.config.vocab_size)
    table = score_levels(model, tokenizer, tasks, module.val_loops, n)
    return {task: {str(lv): {str(k): v for k, v in s.items()} for lv, s in levels.items()} for task, levels in table.items()}


def depth_scores(config: dict[str, Any], n: int) -> dict[str, Any]:
    """Exact match of a finished run's ``last.ckpt`` on up to ``n`` distinct held-out instances per difficulty of its depth task.

    The difficulties are the data module's ``eval_difficulties`` (by default a ladder up to twice the
    training difficulty); the loop counts 1..2K, except for the non-recurrent baseline, which runs once.

    Returns:
        ``{"task", "trained_difficulty", "exact": {difficulty: {k: accuracy}}, "deep": {...}, "instances":
        {difficulty: distinct held-out instances}}``, string keys (the same instances for every arm and seed).

    Raises:
        ValueError: The run's data module is not a depth task.
    """
    from elr_lightning.depth import DepthDataModule
    from elr_lightning.depth.score import default_loops, score
    from elr_lightning.inference.generate import load_model

    data = DepthDataModule(**((config.get("data") or {}).get("init_args") or {}))
    model, _ = load_model(os.path.join(config["trainer"]["default_root_dir"], "checkpoints", "last.ckpt"))
    table = score(model, data.task, data.eval_difficulties, default_loops(model), n)
    return {"task": data.task.name, "trained_difficulty": data.difficulty} | {
        metric: {str(d): {str(k): cell[metric] for k, cell in row.items()} for d, row in table.items()}
        for metric in ("exact", "deep")
    } | {"instances": {str(d): int(next(iter(row.values()))["instances"]) for d, row in table.items()}}


def _write_result(path: str, result: dict[str, Any]) -> None:
    write_file(path, json.dumps(result, indent=1))


def _fit_in_process(config_path: str, ckpt_path: Optional[str], callbacks: list[Any]) -> None:
    from elr_lightning.lightning_cli import ELRCLI, make_cli

    args = ["fit", "--config", config_path] + (["--ckpt_path", ckpt_path] if ckpt_path else [])
    with warnings.catch_warnings():
        # A resumed run appends to its own logs on purpose.
        warnings.filterwarnings("ignore", message=r"(Experiment logs|Checkpoint) directory .* exists and is not empty")
        make_cli(ELRCLI, args, trainer_defaults={"callbacks": list(callbacks)} if callbacks else None)


def _fit_subprocess(config_path: str, ckpt_path: Optional[str]) -> None:
    args = [sys.executable, "-m", "elr_lightning.cli", "fit", "--config", config_path]
    subprocess.run(args + (["--ckpt_path", ckpt_path] if ckpt_path else []), check=True)


def _run_arm(
    arm: str,
    seed: int,
    config: dict[str, Any],
    out: str,
    prefix: str,
    subprocesses: bool,
    callbacks: list[Any],
    log: Callable[[str], None],
    reasoning: Optional[int],
    depth: Optional[int],
) -> dict[str, Any]:
    """Write one arm's config, train it (or resume it, or skip it when it finished earlier), score it; its result.

    Raises:
        ValueError: The run ended before its last step.
    """
    name = run_name(arm, seed)
    path = os.path.join(out, "configs", f"{name}.yaml")
    write_file(path, yaml.safe_dump(config, sort_keys=False))
    root = config["trainer"]["default_root_dir"]
    result_path = os.path.join(root, "result.json")
    if os.path.exists(result_path):
        with open(result_path) as f:
            earlier = json.load(f)
        if reasoning and "reasoning" not in earlier:
            earlier["reasoning"] = reasoning_scores(config, reasoning)
            _write_result(result_path, earlier)
        if depth and "depth" not in earlier:
            earlier["depth"] = depth_scores(config, depth)
            _write_result(result_path, earlier)
        log(f"{prefix}: finished earlier, skipped")
        return earlier
    last = os.path.join(root, "checkpoints", "last.ckpt")
    resume = last if os.path.exists(last) else None
    log(f"{prefix}: {ARMS[arm].description}; " + (f"resuming from {resume}" if resume else "training"))
    start = time.perf_counter()
    if subprocesses:
        _fit_subprocess(path, resume)
    else:
        _fit_in_process(path, resume, callbacks)
    max_steps = config["trainer"]["max_steps"]
    step, loss, bpb = final_metrics(os.path.join(root, "metrics.csv"))
    if step + 1 < max_steps:
        raise ValueError(f"{name} stopped at step {step + 1} of {max_steps}; rerun `elr ablate` to resume it from {last}")
    result = {
        "arm": arm,
        "seed": seed,
        "steps": max_steps,
        "loss": loss,
        "bpb": bpb,
        "seconds": round(time.perf_counter() - start, 1),
        "config": path,
    }
    if reasoning:
        result["reasoning"] = reasoning_scores(config, reasoning)
    if depth:
        result["depth"] = depth_scores(config, depth)
    _write_result(result_path, result)
    log(f"{prefix}: done in {result['seconds']} s; val loss " + ", ".join(f"k={k} {v:.4f}" for k, v in loss.items()))
    return json.loads(json.dumps(result))


def run_ablation(
    config_path: Union[str, list[str]],
    out: str,
    arms: Optional[list[str]] = None,
    steps: Optional[int] = None,
    seeds: Optional[list[int]] = None,
    subprocesses: bool = False,
    callbacks: Optional[list[Any]] = None,
    log: Callable[[str], None] = functools.partial(print, flush=True),
    reasoning: Optional[int] = None,
    depth: Optional[int] = None,
    loops: Optional[list[int]] = None,
) -> list[dict[str, Any]]:
    """Train every ``(arm, seed)`` not finished yet, then write the report; return every run's result.

    Args:
        config_path: The ``elr fit`` config the arms derive from, or several merged as ``elr fit`` merges
            them (:func:`~elr_lightning.lightning_cli.merged_config`).
        out: Output folder (configs, runs, TensorBoard, report).
        arms: Arm names (default: all of :data:`ARMS`).
        steps: ``trainer.max_steps`` of every arm (default: the config's).
        seeds: Seeds (default ``[0]``).
        subprocesses: Run each arm as ``python -m elr_lightning.cli fit`` instead of in this process.
        callbacks: Extra Lightning callbacks for in-process runs (not written to the arm configs).
        log: Where progress lines go.
        reasoning: Score each run on this many held-out reasoning instances per task and level
            (:func:`reasoning_scores`; also runs that finished earlier without scores); ``None`` skips it.
        depth: Score each run on this many held-out depth-task instances per difficulty
            (:func:`depth_scores`; also runs that finished earlier without scores); ``None`` skips it.
        loops: The loop counts every arm validates at (``model.init_args.val_loops``; the baseline
            runs k = 1 only); default: the config's.

    Raises:
        ValueError: An unknown arm, an empty arm or seed list, or a run that ended before its last step.
    """
    arms = list(ARMS) if arms is None else arms
    seeds = [0] if seeds is None else seeds
    if not arms or not seeds:
        raise ValueError("--arms and --seeds must not be empty")
    if subprocesses and callbacks:
        raise ValueError("extra callbacks only apply to in-process runs (subprocesses=False)")
    if isinstance(config_path, str):
        with open(config_path) as f:
            base = yaml.safe_load(f) or {}
    else:
        from elr_lightning.lightning_cli import merged_config

        base = merged_config(config_path)
    if loops is not None:
        _set(base, "val_loops", loops)
    configs = {(arm, seed): arm_config(base, arm, seed, out, steps) for arm in arms for seed in seeds}
    os.makedirs(os.path.join(out, "configs"), exist_ok=True)
    results = []
    for index, ((arm, seed), config) in enumerate(configs.items(), start=1):
        prefix = f"[ablate {index}/{len(configs)}] {run_name(arm, seed)}"
        results.append(_run_arm(arm, seed, config, out, prefix, subprocesses, callbacks or [], log, reasoning, depth))
    report = write_report(results, out, max_loops_of(base), {name: arm.description for name, arm in ARMS.items()})
    log(f"[ablate] report: {report}")
    return results
