"""``torch.compile`` of the whole looped forward: one graph per k, no graph break inside the k-loop.

Dynamo traces on the CPU (``torch._dynamo.explain`` and ``fullgraph=True`` with the ``eager``
backend, which runs the captured graph without code generation), so these tests cost seconds.
"""

from __future__ import annotations

from collections import UserDict

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounter

from conftest import tiny_config
from elr_lightning.conditioning import LoopConditioner
from elr_lightning.model import LoopedLM
from elr_lightning.module import ELRModule
from test_gdp import hybrid_config
from test_moe import moe_config

ARCHS = {
    "attention": lambda: tiny_config(max_seq_len=16, max_loops=3),
    "hybrid": lambda: hybrid_config(max_seq_len=16, max_loops=3),
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


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("checkpointing", ["none", "loop", pytest.param("layer", marks=pytest.mark.slow)])
def test_attention_model_is_one_graph_per_k_without_breaks(checkpointing: str) -> None:
    explained = torch._dynamo.explain(model("attention", checkpointing))(ids(), 3, aux_losses=UserDict())
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.parametrize("checkpointing", ["none", pytest.param("loop", marks=pytest.mark.slow)])
def test_fullgraph_compile_recompiles_per_k_and_matches_eager(checkpointing: str) -> None:
    m = model("attention", checkpointing)
    counter = CompileCounter()
    compiled = torch.compile(m, backend=counter, fullgraph=True)
    x = ids()
    for k in (1, 2, 1, 2):
        logits = compiled(x, k)
        torch.testing.assert_close(logits, m(x, k), rtol=0, atol=0)
    assert counter.frame_count == 2  # one graph per k, reused when k comes again
    F.cross_entropy(compiled(x, 2).flatten(0, 1), x.flatten()).backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    F.cross_entropy(m(x, 2).flatten(0, 1), x.flatten()).backward()
    for name, p in m.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["hybrid", "moe"])
def test_hybrid_and_moe_break_only_inside_their_mixer_kernels(arch: str) -> None:
    """The k-loop, the layers and eq. 4 trace; the breaks are the mixers' own kernel calls.

    GDP's chunked recurrence is left out of graphs on purpose (``delta_product`` is
    ``torch.compiler.disable``: unrolled per length it compiles for minutes); the MoE's routing
    plan has data-dependent shapes and host reads (its loop path's slice sizes).
    """
    m = model(arch)
    x = ids()
    explained = torch._dynamo.explain(m)(x, 2, aux_losses=UserDict())
    kernels = {"hybrid": ("gdp.py", "delta_rule.py"), "moe": ("moe.py", "dispatch.py")}[arch]
    assert explained.graph_break_count > 0
    for reason in explained.break_reasons:
        assert any(frame.filename.endswith(kernels) for frame in reason.user_stack), reason
    torch._dynamo.reset()
    compiled = torch.compile(m, backend="eager")
    torch.testing.assert_close(compiled(x, 2), m(x, 2), rtol=0, atol=0)


def test_module_compiles_the_whole_model_and_refuses_both_compile_switches() -> None:
    module = ELRModule(tiny_config(), compile_model=True)
    module.configure_model()
    assert module.model._compiled_call_impl is not None
    assert all(layer._compiled_call_impl is None for layer in module.all_layers())
    with pytest.raises(ValueError, match="compile_layers and compile_model"):
        ELRModule(tiny_config(), compile_layers=True, compile_model=True)
