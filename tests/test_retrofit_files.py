"""``elr retrofit`` reads what the folder's index names, tensor by tensor, in the files' dtype unless asked."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
import transformers  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from elr_lightning.cli import run  # noqa: E402
from elr_lightning.generation import load_model  # noqa: E402
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
