"""``elr retrofit`` reads what the folder's index names, tensor by tensor, in the files' dtype unless asked."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT

pytest.importorskip("transformers")
import transformers  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from elr_lightning.cli import run  # noqa: E402
from elr_lightning.inference.generate import load_model  # noqa: E402
from elr_lightning.hf.source_weights import SafetensorsWeights  # noqa: E402
from test_retrofit import ATOL, logits_pair, save_tiny  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def resave(source: Path, folder: Path, dtype: torch.dtype, shard: str) -> Path:
    """``source`` saved again in ``dtype`` with shards of at most ``shard`` (and the index), tokenizer copied."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(source), dtype=dtype)
    model.save_pretrained(str(folder), max_shard_size=shard)
    shutil.copy(source / "tokenizer.json", folder / "tokenizer.json")
    return folder


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama 3 saved as bf16 shards with their index, beside a stale model.safetensors and a consolidated file."""
    root = tmp_path_factory.mktemp("sharded")
    folder = resave(save_tiny(root, "llama3"), root / "download", torch.bfloat16, "100KB")
    assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("model-*"))) > 2
    shutil.copytree(folder, root / "clean")
    stale = transformers.AutoModelForCausalLM.from_pretrained(str(save_tiny(root / "old", "llama3", seed=1)))
    save_file({k: v.contiguous() for k, v in stale.state_dict().items() if k != "lm_head.weight"},
              str(folder / "model.safetensors"))
    save_file({"layers.0.attention.wq.weight": torch.ones(4, 4)}, str(folder / "consolidated.safetensors"))
    return folder


def test_the_index_is_followed_and_other_safetensors_files_are_not_read(sharded: Path, tmp_path: Path) -> None:
    run(["retrofit", "--hf", str(sharded), "--out", str(tmp_path), "--no_verify"])
    # transformers itself would read the stale model.safetensors first: compare with the shards alone
    theirs, ours = logits_pair(sharded.parent / "clean", tmp_path / "retrofit.ckpt")
    assert (theirs - ours).abs().max() < ATOL


def test_the_source_dtype_is_kept_unless_asked(sharded: Path, tmp_path: Path) -> None:
    run(["retrofit", "--hf", str(sharded), "--out", str(tmp_path / "kept"), "--no_verify",
         "--shared_init", "average", "--input", "0:1", "--shared", "1:5", "--output", "5:6", "--n_rec", "2"])
    state = torch.load(tmp_path / "kept" / "retrofit.ckpt", weights_only=True)["state_dict"]
    assert state["model.core.layers.0.attn.kv.weight"].dtype == torch.bfloat16
    assert state["model.embed.weight"].dtype == torch.bfloat16
    assert state["model.core.update.gate.weight"].dtype == torch.float32  # new parameters: fp32, at their init
    assert not state["model.core.update.gate.weight"].any()
    weights = SafetensorsWeights(sharded)
    mean = (weights["model.layers.1.mlp.down_proj.weight"].float() + weights["model.layers.3.mlp.down_proj.weight"].float()) / 2
    assert torch.equal(state["model.core.layers.0.mlp.down.weight"], mean.to(torch.bfloat16))  # averaged in fp32
    model, _ = load_model(str(tmp_path / "kept" / "retrofit.ckpt"))  # bf16 weights load into the fp32 model
    assert model.embed.weight.dtype == torch.float32

    run(["retrofit", "--hf", str(sharded), "--out", str(tmp_path / "fp32"), "--no_verify", "--dtype", "float32"])
    state = torch.load(tmp_path / "fp32" / "retrofit.ckpt", weights_only=True)["state_dict"]
    assert {v.dtype for v in state.values() if v.is_floating_point()} == {torch.float32}
    bf16 = torch.load(tmp_path / "kept" / "retrofit.ckpt", weights_only=True)["state_dict"]["model.embed.weight"]
    assert torch.equal(state["model.embed.weight"], bf16.float())  # bf16 values, exactly, in fp32


def test_a_folder_of_several_files_without_an_index_is_refused(sharded: Path, tmp_path: Path) -> None:
    folder = tmp_path / "mixed"
    shutil.copytree(sharded, folder)
    (folder / "model.safetensors.index.json").unlink()
    with pytest.raises(ValueError, match=r"holds \d+ \*.safetensors files \(consolidated.safetensors, .*and no "
                                         r"model.safetensors.index.json"):
        run(["retrofit", "--hf", str(folder), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[-1]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / gone).unlink()
    with pytest.raises(FileNotFoundError, match=rf"names \['{gone}'\], missing from"):
        run(["retrofit", "--hf", str(folder), "--out", str(tmp_path / "out")])


@settings(max_examples=10, deadline=None)
@given(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), st.sampled_from([None, torch.float32, torch.bfloat16]))
def test_weights_come_in_the_file_dtype_or_the_one_asked(tmp_path_factory, stored: torch.dtype, asked) -> None:
    folder = tmp_path_factory.mktemp("one")
    tensors = {"a": torch.randn(3, 5).to(stored), "b": torch.randn(7).to(stored)}
    save_file(tensors, str(folder / "model.safetensors"))
    weights = SafetensorsWeights(folder, asked)
    for name, tensor in tensors.items():
        assert torch.equal(weights[name], tensor.to(asked or stored)) and weights[name].dtype == (asked or stored)
    with pytest.raises(ValueError, match="weights: c is missing"):
        weights["c"]


# ---- a model folder and an output folder are data: nothing read from outside, nothing written through a link ----

VICTIM = "a file of the user's\n"


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("source"), "llama3")


@pytest.mark.parametrize("name", ["tokenizer.json", "retrofit.yaml", "retrofit.ckpt"])
def test_retrofit_never_writes_through_a_link_in_out(source: Path, tmp_path: Path, name: str) -> None:
    """``--out DIR`` where ``DIR/<name>`` is a symbolic link: refused, and with --overwrite the link is replaced."""
    victim = tmp_path / "victim.txt"
    victim.write_text(VICTIM)
    out = tmp_path / "out"
    out.mkdir()
    (out / name).symlink_to(victim)
    with pytest.raises(FileExistsError, match=rf"already holds {name}; choose a new folder, or add --overwrite"):
        run(["retrofit", "--hf", str(source), "--out", str(out), "--verify", "false"])
    assert sorted(p.name for p in out.iterdir()) == [name] and victim.read_text() == VICTIM
    run(["retrofit", "--hf", str(source), "--out", str(out), "--verify", "false", "--overwrite"])
    assert victim.read_text() == VICTIM and not (out / name).is_symlink()
    assert sorted(p.name for p in out.iterdir()) == ["retrofit.ckpt", "retrofit.yaml", "tokenizer.json"]
    load_model(str(out / "retrofit.ckpt"))


@pytest.mark.parametrize("where", ["../outside/w.safetensors", "ABSOLUTE", "sub/../../w.safetensors"])
def test_an_index_naming_a_file_outside_the_folder_is_refused(source: Path, tmp_path: Path, where: str) -> None:
    folder = tmp_path / "model"
    shutil.copytree(source, folder)
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(folder / "model.safetensors", outside / "w.safetensors")
    named = str(outside / "w.safetensors") if where == "ABSOLUTE" else where
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": named}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"model.safetensors.index.json names '{named}', outside the folder"):
        run(["retrofit", "--hf", str(folder), "--out", str(tmp_path / "out"), "--verify", "false"])
    assert not (tmp_path / "out").exists()


def test_a_model_that_asks_to_run_its_own_code_is_refused_without_a_prompt(source: Path, tmp_path: Path) -> None:
    """``auto_map`` in config.json made transformers ask "run the custom code? [y/N]"; nothing is asked or run."""
    import os
    import subprocess
    import sys

    folder = tmp_path / "custom"
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.Evil"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_evil.py").write_text(f"open({str(tmp_path / 'MARKER')!r}, 'w').write('ran')\n")
    root = REPO_ROOT
    proc = subprocess.run(
        [sys.executable, "-m", "elr_lightning.cli", "retrofit", "--hf", str(folder), "--out", str(tmp_path / "out")],
        env={**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1"}, stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    said = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(said) == 1, proc.stderr[-2000:]
    assert "config.json has auto_map, which asks to run the model's own Python code" in said[0]
    assert "[y/N]" not in proc.stdout + proc.stderr and not (tmp_path / "MARKER").exists()
    assert not (tmp_path / "out").exists()
