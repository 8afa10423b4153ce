"""A hostile tokenizer in a checkpoint, a bad ``config.json`` for ``elr import --hf``, ``elr generate`` edge values:
each ends in one line naming the problem."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

pytest.importorskip("tokenizers")

from _elr_ckpt import SERVE_ARCH, write_checkpoint  # noqa: E402
from _forked_cli import run_commands  # noqa: E402
from elr_lightning.hf.export import import_hf  # noqa: E402
from elr_lightning.inference.prompts import check_sampling  # noqa: E402
from elr_lightning.serve.api import CompletionsSpec, RequestError  # noqa: E402
from elr_lightning.tokenizers import HFTokenizer, TokenizerFailure  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def tokenizer_json(pattern: str) -> str:
    """A word-level tokenizer.json that splits with ``pattern`` (Oniguruma, as the tokenizers library runs it)."""
    return json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
        "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "a": 1, "b": 2, "ab": 3}, "unk_token": "[UNK]"},
    })  # fmt: skip


CATASTROPHIC = r"(a+)+$"  # backtracks exponentially on "aaa...a!": the regex engine's retry limit panics in Rust
SLY = r"(ab|ab)*$"  # passes the trial texts (runs of one character), panics on "abab...ab!"


def test_a_catastrophic_pattern_is_refused_at_load_in_one_line() -> None:
    with pytest.raises(ValueError, match="fails on a trial text") as info:
        HFTokenizer.from_json(tokenizer_json(CATASTROPHIC))
    assert "\n" not in str(info.value) and "data.tokenizer" in str(info.value)


def test_a_panic_on_one_text_is_a_one_line_value_error_and_a_400() -> None:
    tok = HFTokenizer.from_json(tokenizer_json(SLY))
    assert tok.encode("ab ab") != []
    with pytest.raises(TokenizerFailure) as info:
        tok.encode("ab" * 40 + "!")
    assert isinstance(info.value, ValueError) and "\n" not in str(info.value)
    spec = CompletionsSpec(SERVE_ARCH, tok, "tiny", loops_default=1, loops_max=3)
    with pytest.raises(RequestError) as refused:
        spec.parse(json.dumps({"prompt": "ab" * 40 + "!"}).encode())
    assert refused.value.status == 400 and refused.value.param == "prompt"


def _cli(jobs: list[tuple[list[str], Path]]) -> list[subprocess.CompletedProcess]:
    """Each ``(args, folder)``: the ``elr`` command in its own process (forked from one that imported the CLI once)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RUST_BACKTRACE": "1"}
    env.pop("ELR_DEBUG", None)
    return run_commands([{"args": args, "cwd": cwd, "env": {}} for args, cwd in jobs], env)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hostile_tokenizer")
    good = root / "good.ckpt"
    write_checkpoint(good, tokenizer=HFTokenizer.from_json(tokenizer_json(r"\s+")))
    raw = torch.load(good, weights_only=True)
    text = tokenizer_json(CATASTROPHIC)
    raw["elr"]["tokenizer"].update(tokenizer_json=text, fingerprint=hashlib.sha256(text.encode()).hexdigest())
    torch.save(raw, root / "hostile.ckpt")
    return {"good": good, "hostile": root / "hostile.ckpt"}


HOSTILE_COMMANDS = [
    ["generate", "--prompt", "ab"],
    ["serve", "--port", "8917", "--accelerator", "cpu"],
    ["export", "--out", "exported"],
    ["eval", "--output_dir", "evaluated"],
]


@pytest.fixture(scope="module")
def hostile_runs(
    checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> list[subprocess.CompletedProcess]:
    """Each of :data:`HOSTILE_COMMANDS` on the hostile checkpoint, in its own process and folder."""
    hostile = str(checkpoints["hostile"])
    return _cli([([c[0], "--ckpt_path", hostile, *c[1:]], tmp_path_factory.mktemp(c[0])) for c in HOSTILE_COMMANDS])


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(HOSTILE_COMMANDS)), ids=[c[0] for c in HOSTILE_COMMANDS])
def test_every_command_refuses_a_hostile_checkpoint_tokenizer_in_one_line(
    hostile_runs: list[subprocess.CompletedProcess], index: int
) -> None:
    command, proc = HOSTILE_COMMANDS[index], hostile_runs[index]
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "Warning" not in line]
    assert proc.returncode == 1, proc.stderr[-2000:]
    errors = [line for line in lines if line.startswith(f"elr {command[0]}: error:")]
    assert len(errors) == 1 and "fails on a trial text" in errors[0], proc.stderr[-2000:]
    assert "panicked" not in proc.stderr and "Traceback" not in proc.stderr and "looks like a bug" not in proc.stderr


@pytest.mark.slow
def test_generate_takes_a_tiny_temperature_as_greedy_and_prints_depth_statistics_under_auto(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    common = ["generate", "--ckpt_path", str(checkpoints["good"]), "--prompt", "ab", "--max_new_tokens", "6",
              "--no_echo_prompt"]  # fmt: skip
    tiny, greedy, auto = _cli([
        ([*common, "--temperature", "1e-300"], tmp_path),
        ([*common, "--temperature", "0"], tmp_path),
        ([*common, "--loops", "auto", "--stats"], tmp_path),
    ])
    assert tiny.returncode == 0 and tiny.stdout == greedy.stdout, tiny.stderr[-2000:]
    assert auto.returncode == 0, auto.stderr[-2000:]
    assert "loops auto (budget 3, kl threshold 0.001)" in auto.stderr and "loops k=" not in auto.stderr
    assert "loops per decoded token: mean" in auto.stderr


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -1.0])
def test_the_library_refuses_a_temperature_that_is_not_a_finite_number_at_least_0(temperature: float) -> None:
    with pytest.raises(ValueError, match="must be a finite number >= 0"):
        check_sampling(temperature, None, None, 4)


def _export_folder(root: Path, **fields: object) -> Path:
    root.mkdir()
    (root / "model.safetensors").write_bytes(b"")
    config = {"model_type": "elr", "elr_arch": dataclasses.asdict(SERVE_ARCH), "state_update": "adaptive_delta"}
    (root / "config.json").write_text(json.dumps({**config, **fields} if fields else config))
    return root


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"state_update": ["x"]}, "state_update is ['x']; it must be one of"),
        ({"state_update": None}, "state_update is None"),
        ({"state_update": "fixed_delta", "fixed_delta_beta": "nan"}, "fixed_delta_beta is 'nan'; it must be a number"),
        ({"state_update": "fixed_delta", "fixed_delta_beta": float("nan")}, "fixed_delta_beta is nan"),
        ({"state_update": "fixed_delta"}, "fixed_delta_beta is missing; it must be a number in (0, 1]"),
        ({"injection": "max"}, "injection is 'max'; it must be 'sum' or 'mean'"),
    ],
)
def test_import_hf_names_a_bad_update_field_and_the_fix(tmp_path: Path, fields: dict, words: str) -> None:
    with pytest.raises(ValueError) as info:
        import_hf(_export_folder(tmp_path / "export", **fields))
    assert words in str(info.value) and "elr export" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("text", ["[]", "{", "[" * 100_000, '{"model_type": ' + "9" * 5000 + "}"])
def test_import_hf_refuses_a_config_json_that_is_no_object_in_one_line(tmp_path: Path, text: str) -> None:
    folder = _export_folder(tmp_path / "export")
    (folder / "config.json").write_text(text)
    with pytest.raises(ValueError, match="config.json") as info:
        import_hf(folder)
    assert "\n" not in str(info.value)


def test_import_hf_names_a_missing_state_update(tmp_path: Path) -> None:
    folder = _export_folder(tmp_path / "export")
    config = json.loads((folder / "config.json").read_text())
    del config["state_update"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="state_update is missing; it must be one of"):
        import_hf(folder)


def test_import_hf_refuses_damaged_or_mismatched_weights_in_one_line(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    folder = _export_folder(tmp_path / "export")
    (folder / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="is not a readable safetensors file") as info:
        import_hf(folder)
    save_file({"model.embed.weight": torch.zeros(3, 3)}, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="does not fit config.json's elr_arch") as mismatch:
        import_hf(folder)
    assert "\n" not in str(info.value) + str(mismatch.value)
