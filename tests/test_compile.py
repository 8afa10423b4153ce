"""``torch.compile`` of the whole looped forward: one graph per k, no graph break inside the k-loop.

Dynamo traces on the CPU (``torch._dynamo.explain``, and ``fullgraph=True`` with the
``aot_eager_decomp_partition`` backend: AOTAutograd's forward and backward graphs with inductor's
decompositions, run without code generation), so these tests cost seconds, not minutes.
"""

from __future__ import annotations

from collections import UserDict

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from conftest import tiny_config
from elr_lightning.conditioning import LoopConditioner
from elr_lightning.model import LoopedLM
from elr_lightning.module import ELRModule
from test_gdp import hybrid_config
from test_moe import moe_config

#: GDP in 2 chunks of 8 tokens (2 Householder steps each) over 16 tokens: the state crosses a chunk once.
GDP_TWO_CHUNKS = {"gdp": {"class_path": "elr_lightning.mixers.GatedDeltaProduct", "init_args": {"chunk_size": 16}}}

ARCHS = {
    "attention": lambda: tiny_config(max_seq_len=16, max_loops=3),
    "hybrid": lambda: hybrid_config(max_seq_len=16, max_loops=3, mixers=GDP_TWO_CHUNKS),
    "moe": lambda: moe_config(tiny_config(max_seq_len=16, max_loops=3)),
}


def model(arch: str, checkpointing: str = "none") -> LoopedLM:
    torch.manual_seed(0)
    m = LoopedLM(ARCHS[arch](), conditioner=LoopConditioner(d_cond=8, rank=2))
    with torch.no_grad():  # heads off zero, so eq. 4 changes the function
        for p in m.conditioner.parameters():
            p.normal_(std=0.1)
        for name, p in m.named_parameters():
            if "_mod." in name:
                p.normal_(std=0.1)
    m.set_backprop(checkpointing)
    return m


def ids() -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("checkpointing", ["none", "loop", pytest.param("layer", marks=pytest.mark.slow)])
def test_attention_model_is_one_graph_per_k_without_breaks(checkpointing: str) -> None:
    explained = torch._dynamo.explain(model("attention", checkpointing))(ids(), 3, aux_losses=UserDict())
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.parametrize("arch", [pytest.param("hybrid", marks=pytest.mark.slow), "moe"])
def test_hybrid_and_moe_models_are_one_graph_per_k_without_breaks(arch: str) -> None:
    """GDP's chunked recurrence and the MoE's routing and dispatch trace into the one graph of each k."""
    m = model(arch)
    for k in (1, 3):
        torch._dynamo.reset()
        explained = torch._dynamo.explain(m)(ids(), k, aux_losses=UserDict())
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), (k, explained.break_reasons)


def loss_and_grads(m: LoopedLM, forward, x: torch.Tensor, k: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The training loss at ``k`` (cross-entropy plus the mixers' auxiliary losses) and every gradient."""
    m.zero_grad()
    aux: UserDict = UserDict()
    loss = F.cross_entropy(forward(x, k, aux_losses=aux).flatten(0, 1), x.flatten()) + sum(aux.values())
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    ("arch", "checkpointing"),
    [
        pytest.param("attention", "none", marks=pytest.mark.slow),
        pytest.param("attention", "loop", marks=pytest.mark.slow),
        pytest.param("hybrid", "none", marks=pytest.mark.slow),
        pytest.param("moe", "none", marks=pytest.mark.slow),
    ],
)
def test_fullgraph_training_recompiles_per_k_and_matches_eager(arch: str, checkpointing: str) -> None:
    """Forward and backward through ``fullgraph=True``: one graph per k, kept when k comes again.

    The loss (with the MoE's balance loss), every gradient and the MoE's counted expert load equal
    eager's, so the balancing bias moves alike compiled and eager.
    """
    m = model(arch, checkpointing)
    counter = CompileCounterWithBackend("aot_eager_decomp_partition")
    compiled = torch.compile(m, backend=counter, fullgraph=True)
    x = ids()
    moes = [mod for mod in m.modules() if getattr(mod, "routed", False)]
    for k in (1, 2, 1, 2):
        loss, grads = loss_and_grads(m, compiled, x, k)
        loads = [mod._load for mod in moes]
        for mod in moes:
            mod.discard_step()
        eager_loss, eager_grads = loss_and_grads(m, m, x, k)
        torch.testing.assert_close(loss, eager_loss)
        assert grads.keys() == eager_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, eager_grads[name], msg=lambda text: f"{name} at k={k}: {text}")
        for mod, load in zip(moes, loads):
            assert load is not None and torch.equal(load, mod._load)
            mod.discard_step()
    assert counter.frame_count == 2  # one graph per k, reused when k comes again


def test_module_compiles_the_whole_model_and_refuses_both_compile_switches() -> None:
    module = ELRModule(tiny_config(), compile_model=True)
    module.configure_model()
    assert module.model._compiled_call_impl is not None
    assert all(layer._compiled_call_impl is None for layer in module.all_layers())
    with pytest.raises(ValueError, match="compile_layers and compile_model"):
        ELRModule(tiny_config(), compile_layers=True, compile_model=True)
