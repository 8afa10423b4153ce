"""No host syncs in the training step and the forward pass, outside logging (a GPU would stall on each).

On the CPU nothing stalls, so the test makes every tensor-to-host read raise while a training step
and its backward pass run: ``.item()``, ``.tolist()``, ``.numpy()``, ``bool(t)`` (so ``if t:``),
``float(t)``, ``int(t)`` and ``t.__index__``. With a CUDA device it also runs the step under
``torch.cuda.set_sync_debug_mode("error")``. ``self.log`` is replaced by a recorder: logging may sync.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from conftest import GQA_CONFIG
from elr_lightning import conditioning, layers, model, updates
from elr_lightning.conditioning import LoopConditioner
from elr_lightning.mixers import attention, base, delta_rule, gdp, swiglu
from elr_lightning.module import ELRModule
from elr_lightning.sampling import FixedLoops

pytestmark = pytest.mark.usefixtures("one_thread")

READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__")
HYBRID = replace(
    GQA_CONFIG,
    token_pattern={"in": ["gdp"], "rec": ["gdp", "attention"], "out": ["attention"]},
    mixers={"gdp": {"class_path": "elr_lightning.mixers.GatedDeltaProduct", "init_args": {"chunk_size": 8}}},
)


@contextmanager
def host_reads_raise() -> Iterator[list[str]]:
    """Make every tensor-to-host read raise; yields the list of the reads attempted."""
    attempted: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def refuse(name: str):
        def read(self, *args, **kwargs):
            attempted.append(name)
            raise AssertionError(f"host sync: Tensor.{name} in the training step")

        return read

    try:
        for name in READS:
            setattr(torch.Tensor, name, refuse(name))
        yield attempted
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)


def devices() -> list[str]:
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize(
    "arch,backprop",
    [
        (GQA_CONFIG, {}),
        (HYBRID, {"activation_checkpointing": "loop", "backprop_loops": 2}),
        (GQA_CONFIG, {"activation_checkpointing": "layer"}),
    ],
    ids=["attention", "hybrid-loop-bp2", "attention-layer"],
)
def test_training_step_reads_nothing_back(arch, backprop, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    module = ELRModule(
        arch=arch, sampler=FixedLoops(3), conditioner=LoopConditioner(d_cond=8, rank=2), virtual_ranks=2, **backprop
    ).to(device)
    module._trainer = SimpleNamespace(
        global_rank=0, world_size=1, global_step=1, log_every_n_steps=50, fast_dev_run=False, strategy=SimpleNamespace()
    )
    logged: dict[str, object] = {}
    monkeypatch.setattr(module, "log", lambda name, value, **kwargs: logged.__setitem__(name, value))
    batch = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(0)).to(device)
    module.training_step(batch, 0)  # warm-up: lazy initialisation may read back once
    module.zero_grad(set_to_none=True)
    sync_mode = torch.cuda.get_sync_debug_mode() if device == "cuda" else None
    with host_reads_raise() as attempted:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        try:
            loss = module.training_step(batch, 0)
            loss.backward()
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode(sync_mode)
    assert attempted == []
    assert "train/loss" in logged and torch.isfinite(loss)
    assert all(p.grad is not None for p in module.model.parameters())


@pytest.mark.parametrize("device", devices())
def test_a_labelled_training_step_reads_nothing_back(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Labelled batches (an ignore index, a labelled-token count that is a tensor) add no host read either."""
    module = ELRModule(arch=GQA_CONFIG, sampler=FixedLoops(2), virtual_ranks=2).to(device)
    module._trainer = SimpleNamespace(
        global_rank=0, world_size=1, global_step=1, log_every_n_steps=50, fast_dev_run=False, strategy=SimpleNamespace()
    )
    monkeypatch.setattr(module, "log", lambda name, value, **kwargs: None)
    ids = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(0))
    labels = torch.where(torch.arange(32) < 10, -100, ids.roll(-1, dims=1))
    batch = {"input_ids": ids.to(device), "labels": labels.to(device)}
    module.training_step(batch, 0)
    module.zero_grad(set_to_none=True)
    with host_reads_raise() as attempted:
        loss = module.training_step(batch, 0)
        loss.backward()
    assert attempted == [] and torch.isfinite(loss)


def test_a_host_read_in_the_forward_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: a forward that branches on a tensor value raises under it."""
    module = ELRModule(arch=GQA_CONFIG, sampler=FixedLoops(1))
    original = module.model.core.update.forward

    def branching(s_prev, r, s_tilde):
        if (r > 0).any():
            return original(s_prev, r, s_tilde)
        return r

    monkeypatch.setattr(module.model.core.update, "forward", branching)
    with host_reads_raise() as attempted, pytest.raises(AssertionError, match="host sync: Tensor.__bool__"):
        module.model(torch.zeros(1, 4, dtype=torch.long))
    assert attempted == ["__bool__"]


#: Functions on the hot path: every layer, mixer, modulator and update forward, and the model's own loop.
HOT_MODULES = (model, layers, conditioning, updates, attention, base, gdp, delta_rule, swiglu)
HOT_FUNCTIONS = {"forward", "run", "loop", "run_layer", "_sublayer", "modulated", "modulation", "pre", "post",
                 "context", "inject", "init", "delta_product", "l2_normalize", "_conv", "apply_rope"}


def test_hot_path_source_has_no_host_reads() -> None:
    """A static check: no ``.item()`` / ``.tolist()`` / ``.numpy()`` / ``.cpu()`` in any hot-path function."""
    found = []
    checked = 0
    for module in HOT_MODULES:
        tree = ast.parse(inspect.getsource(module))
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef) and fn.name in HOT_FUNCTIONS:
                checked += 1
                for node in ast.walk(fn):
                    if isinstance(node, ast.Attribute) and node.attr in ("item", "tolist", "numpy", "cpu"):
                        found.append(f"{module.__name__}.{fn.name}: .{node.attr}")
    assert checked >= 15 and found == []
