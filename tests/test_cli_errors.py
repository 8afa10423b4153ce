"""Every user mistake gives one readable line naming the field or file, and exit status 1.

The cases of :data:`SUBPROCESS` run as a user runs them, ``python -m elr_lightning.cli ...`` in a
subprocess (both at once, from one module fixture): an error from a class's ``__init__`` inside
LightningCLI, and one from our own command. The other cases
call :func:`elr_lightning.cli.main` in this process, which runs the same code but the interpreter's
start-up (about 5 s each). Each test asserts on the exit status, the number of lines printed and the
field or file the message names.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from elr_lightning.callbacks.exclusive_save_config import CLAIM_FILE
from elr_lightning.cli import main, run
from elr_lightning.lightning_cli import last_checkpoint_patterns

ROOT = Path(__file__).resolve().parents[1]

TINY_CONFIG = """\
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 2
  val_check_interval: 2
  check_val_every_n_epoch: null
  limit_val_batches: 1
  num_sanity_val_steps: 0
  enable_progress_bar: false
  enable_model_summary: false
  logger: false
  default_root_dir: run
model:
  class_path: elr_lightning.ELRModule
  init_args:
    arch: {vocab_size: 256, d_model: 16, n_heads: 2, n_in: 1, n_rec: 1, n_out: 0, max_seq_len: 32, max_loops: 2}
    sampler:
      class_path: elr_lightning.sampling.OneLoopOverride
      init_args: {max_loops: 2, override_fraction: 0.5}
    warmup_steps: 1
data:
  class_path: elr_lightning.data.TextDataModule
  init_args:
    sources: [corpus.txt]
    seq_len: 16
    batch_size: 2
    cache_dir: cache
"""


class Case(NamedTuple):
    args: list[str]
    names: str  # a string the message must contain: the field, flag or file
    lines: int = 1  # lines on stderr that start with "elr <command>:"


FIT = ["fit", "--config", "tiny.yaml"]
CASES: dict[str, Case] = {
    "n_heads": Case([*FIT, "--model.init_args.arch.n_heads", "5"], "arch.n_heads"),
    "n_rec": Case([*FIT, "--model.init_args.arch.n_rec", "0"], "arch.n_rec"),
    "override_fraction": Case(
        [*FIT, "--model.init_args.sampler.init_args.override_fraction", "1.5"], "override_fraction"
    ),
    "lr_negative": Case([*FIT, "--model.init_args.lr", "-0.01"], "model.init_args.lr"),
    "lr_not_a_number": Case([*FIT, "--model.init_args.lr", "abc"], "model.init_args.lr"),
    "val_loops": Case([*FIT, "--model.init_args.val_loops", "[0]"], "model.init_args.val_loops"),
    "batch_size": Case([*FIT, "--data.init_args.batch_size", "0"], "data.batch_size"),
    "unknown_option": Case([*FIT, "--model.init_args.nonsense", "3"], "nonsense"),
    "missing_source": Case([*FIT, "--data.init_args.sources", "[nope.txt]"], "nope.txt"),
    "cost_missing_config": Case(["cost", "--config", "nope.yaml"], "nope.yaml"),
    "generate_missing_ckpt": Case(["generate", "--ckpt_path", "nope.ckpt", "--prompt", "x"], "nope.ckpt"),
    "generate_ckpt_is_a_directory": Case(["generate", "--ckpt_path", "cache", "--prompt", "x"], "--ckpt_path"),
    "cache_dir_not_writable": Case([*FIT, "--data.init_args.cache_dir", "a_file/cache"], "data.cache_dir"),
    "fit_ckpt_is_a_folder": Case([*FIT, "--ckpt_path", "cache"], "--ckpt_path 'cache' is a folder"),
    "fit_truncated_ckpt": Case([*FIT, "--ckpt_path", "truncated.ckpt"], "'truncated.ckpt'"),
    "validate_bit_flipped_ckpt": Case(
        ["validate", "--config", "tiny.yaml", "--ckpt_path", "flipped.ckpt"], "'flipped.ckpt'"
    ),
    "generate_bit_flipped_ckpt": Case(["generate", "--ckpt_path", "flipped.ckpt", "--prompt", "x"], "CRC check"),
    "resume_with_another_d_model": Case(
        [*FIT, "--model.init_args.arch.d_model", "32", "--ckpt_path", "run.ckpt"], "model.init_args.arch.d_model is 32"
    ),
    "resume_with_another_lr": Case([*FIT, "--model.init_args.lr", "0.01", "--ckpt_path", "run.ckpt"], "init_args.lr"),
    "one_mixer_argument_by_flag": Case(
        [*FIT, "--model.init_args.arch.token_pattern", "[gdp]", "--model.init_args.arch.mixers.gdp.init_args.num_heads", "2"],
        "give the entry whole: --model.init_args.arch.mixers.gdp '{class_path",
    ),
    "strategy_class_path_as_a_name": Case(
        [*FIT, "--trainer.strategy", "elr_lightning.strategies.OneLoopOverrideDDPStrategy"],
        "--trainer.strategy.class_path elr_lightning.strategies.OneLoopOverrideDDPStrategy",
    ),
    "validate_ckpt_last_without_one": Case(
        ["validate", "--config", "tiny.yaml", "--ckpt_path", "last"], "--ckpt_path last: no last.ckpt in"
    ),
    "generate_prompt_not_utf8": Case(
        ["generate", "--ckpt_path", "nope.ckpt", "--prompt_file", "binary.bin"], "--prompt_file"
    ),
}


#: Cases run in a subprocess, one per path an error takes to the user.
SUBPROCESS = ("n_heads", "generate_prompt_not_utf8")


def _run(workdir: Path, args: list[str], debug: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("ELR_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "elr_lightning.cli", *args, *(["--debug"] if debug else [])],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli")
    (path / "tiny.yaml").write_text(TINY_CONFIG)
    (path / "corpus.txt").write_text("".join(f"line {i}: {i * 7919 % 1000}\n" for i in range(300)))
    (path / "binary.bin").write_bytes(b"\xff\xfe\x00\x01 not text \xd0")
    (path / "cache").mkdir()
    (path / "a_file").write_text("a file where a folder should be")
    torch.save({"state_dict": {"w": torch.arange(4096.0)}}, path / "good.ckpt")
    data = (path / "good.ckpt").read_bytes()
    (path / "truncated.ckpt").write_bytes(data[: len(data) // 2])
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x01  # inside the tensor's record: torch.load alone would not notice
    (path / "flipped.ckpt").write_bytes(bytes(flipped))
    cwd = os.getcwd()
    os.chdir(path)
    try:
        run(["fit", "--config", "tiny.yaml"])
    finally:
        os.chdir(cwd)
    shutil.copy(next((path / "run" / "checkpoints").glob("*.ckpt")), path / "run.ckpt")
    return path


@pytest.fixture(scope="module")
def results(workdir: Path) -> dict[str, subprocess.CompletedProcess]:
    jobs = {name: (CASES[name].args, False) for name in SUBPROCESS}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_run, workdir, args, debug) for name, (args, debug) in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


def _check(case: Case, returncode: int, stdout: str, stderr: str) -> None:
    said = [line for line in stderr.splitlines() if line.startswith(f"elr {case.args[0]}: ")]
    assert returncode == 1, stderr[-3000:]
    assert "Traceback" not in stderr + stdout
    assert len(said) == case.lines, stderr[-3000:]
    assert case.names in said[0]
    # Nothing else but Lightning's own one-line notices ("Seed set to 0") may surround it.
    assert len(stderr.strip().splitlines()) <= case.lines + 2, stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("name", SUBPROCESS)
def test_a_mistake_is_one_line_naming_the_field(name: str, results: dict[str, subprocess.CompletedProcess]) -> None:
    proc = results[name]
    _check(CASES[name], proc.returncode, proc.stdout, proc.stderr)


@pytest.mark.parametrize("name", sorted(set(CASES) - set(SUBPROCESS)))
def test_a_mistake_in_process_is_one_line_naming_the_field(
    name: str, workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(workdir)
    monkeypatch.delenv("ELR_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(CASES[name].args)
    out, err = capsys.readouterr()
    _check(CASES[name], exit_info.value.code, out, err)


def test_debug_lets_the_exception_through(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(workdir)
    monkeypatch.setenv("ELR_DEBUG", "0")  # registered, so the "1" that --debug exports is undone afterwards
    with pytest.raises(ValueError, match=r"arch\.n_heads=5") as info:
        main([*CASES["n_heads"].args, "--debug"])
    assert os.environ.get("ELR_DEBUG") == "1"  # exported, so the other ranks a launcher starts see it too
    # The error itself, not the parser's wrapper of it: the traceback ends where the package raised it
    assert "Does not validate" not in str(info.value) and "Given value" not in str(info.value)
    last = info.tb
    while last.tb_next is not None:
        last = last.tb_next
    assert f"{os.sep}elr_lightning{os.sep}" in last.tb_frame.f_code.co_filename


def planned_for_four_steps(checkpoint: Path, out: Path) -> Path:
    """``checkpoint`` (step 2 of a 2-step run) as the checkpoint of a 4-step run stopped at step 2: a longer
    resume of the run itself is refused (its cosine would rise again past its end)."""
    state = torch.load(checkpoint, weights_only=True)
    state["elr"]["schedule"]["total_steps"] = 4
    torch.save(state, out)
    return out


def test_resuming_or_validating_with_the_checkpoints_own_values_still_works(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(workdir)
    planned_for_four_steps(workdir / "run.ckpt", workdir / "run4.ckpt")
    run([*FIT, "--ckpt_path", "run4.ckpt", "--trainer.max_steps", "4", "--trainer.default_root_dir", "resumed"])
    assert torch.load(next((workdir / "resumed" / "checkpoints").glob("*.ckpt")), weights_only=True)["global_step"] == 4
    # validate may differ in what it measures (val_loops), not in the architecture
    run(["validate", "--config", "tiny.yaml", "--ckpt_path", "run.ckpt", "--model.init_args.val_loops", "[1, 2, 3]"])


def test_ckpt_path_last_resumes_the_newest_last_checkpoint_of_earlier_runs(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Each run logs to a new folder, where Lightning's own ``last`` looked and found nothing."""
    monkeypatch.chdir(workdir)
    folder = workdir / "again" / "checkpoints"
    folder.mkdir(parents=True)
    shutil.copy(workdir / "run.ckpt", folder / "last-v1.ckpt")
    os.utime(folder / "last-v1.ckpt", (1, 1))
    planned_for_four_steps(workdir / "run.ckpt", folder / "last.ckpt")
    run([*FIT, "--ckpt_path", "last", "--trainer.max_steps", "4", "--trainer.default_root_dir", "again"])
    assert f"elr: --ckpt_path last: {os.path.join('again', 'checkpoints', 'last.ckpt')}" in capsys.readouterr().err
    steps = [torch.load(p, weights_only=True)["global_step"] for p in folder.glob("epoch*.ckpt")]
    assert steps == [4]


def test_a_prompt_too_long_for_the_model_is_refused_before_it_is_echoed(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(workdir)
    monkeypatch.delenv("ELR_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--ckpt_path", "run.ckpt", "--prompt", "x" * 30, "--max_new_tokens", "5"])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 1 and out == ""
    assert "needs 34 positions, more than arch.max_seq_len=32; shorten the prompt or lower --max_new_tokens" in err


def test_last_checkpoint_patterns_cover_logger_versions_root_and_callback_dirpath() -> None:
    trainer = {
        "default_root_dir": "root",
        "logger": [{"class_path": "TensorBoardLogger", "init_args": {"save_dir": "runs", "name": "exp"}}],
        "callbacks": [{"class_path": "ModelCheckpoint", "init_args": {"dirpath": "ckpts"}}],
    }
    assert last_checkpoint_patterns(trainer) == [
        os.path.join("runs", "exp", "version_*", "checkpoints", "last*.ckpt"),
        os.path.join("root", "checkpoints", "last*.ckpt"),
        os.path.join("ckpts", "last*.ckpt"),
    ]
    default = last_checkpoint_patterns({"default_root_dir": "root", "logger": True})
    assert default[0] == os.path.join("root", "lightning_logs", "version_*", "checkpoints", "last*.ckpt")


def test_a_second_run_in_a_claimed_log_folder_is_refused(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs started at once pick the same folder; the one that claims it second is refused."""
    monkeypatch.chdir(workdir)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (workdir / "busy").mkdir()
        (workdir / "busy" / CLAIM_FILE).write_text(f"{socket.gethostname()} {other.pid}")
        with pytest.raises(FileExistsError, match=r"the log folder 'busy' is in use by another run"):
            run([*FIT, "--trainer.default_root_dir", "busy"])
        assert not (workdir / "busy" / "config.yaml").exists()
    finally:
        other.kill()
        other.wait()
    # the holder is gone (a killed run): its claim is taken over, and released at the end
    run([*FIT, "--trainer.default_root_dir", "busy"])
    assert (workdir / "busy" / "config.yaml").exists() and not (workdir / "busy" / CLAIM_FILE).exists()


def test_subcommands_do_not_warn_about_passing_args_beside_argv(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import warnings

    config = str(Path(__file__).resolve().parents[1] / "config" / "quickstart.yaml")
    monkeypatch.setattr(sys, "argv", ["elr", "cost", "--config", config])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(["cost", "--config", config])
    assert "parameters:" in capsys.readouterr().out
    assert not [w for w in caught if "args parameter" in str(w.message)]
