"""Eq. (4) in training costs activations, not a copy of the folded weights per loop (issue 33).

What a forward pass leaves alive for the backward pass is counted with ``bench/memory.py``'s
:func:`kept_for_backward` (every storage an op made that outlives the forward), for the same model
with and without conditioning.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import load_bench, tiny_config
from elr_lightning.conditioning import LoopConditioner
from elr_lightning.model import LoopedLM
from elr_lightning.recompute import RecomputedTensors
from test_gdp import hybrid_config

pytestmark = pytest.mark.usefixtures("one_thread")

MEMORY_BENCH = load_bench("memory")
#: d = 64 and 512 tokens: every sublayer folds eq. 4 into its weights (their widths are below the tokens).
SIZE = dict(d_model=64, n_heads=4, max_seq_len=256, vocab_size=256)
ARCHS = {"attention": lambda: tiny_config(**SIZE, n_rec=2), "hybrid": lambda: hybrid_config(**SIZE)}


def kept(arch: str, conditioned: bool, loops: int, precision: str, seq_len: int = 256) -> dict[str, int]:
    """What one training forward at ``loops`` over 2 x ``seq_len`` tokens keeps for the backward pass; the step then completes."""
    torch.manual_seed(0)
    # rank 3: no eq. 4 term ([d, r], [out, r]) has the shape of a mixer weight, so none is counted as a copy
    model = LoopedLM(ARCHS[arch](), conditioner=LoopConditioner(d_cond=16, rank=3) if conditioned else None)
    ids = torch.randint(0, 256, (2, seq_len + 1), generator=torch.Generator().manual_seed(1))

    def forward() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = model(ids[:, :-1], loops)
        return F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())

    loss, counted = MEMORY_BENCH.kept_for_backward(model, forward)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    return counted


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_conditioned_training_keeps_no_weight_copy_per_loop(arch: str, precision: str) -> None:
    """Before: d = 64, 512 tokens, attention, fp32 kept 159,744 / 479,232 weight-shaped elements at k = 1 / 4
    and 1.089x the unconditioned model's bytes at k = 4."""
    plain = {k: kept(arch, False, k, precision) for k in (1, 4)}
    cond = {k: kept(arch, True, k, precision) for k in (1, 4)}
    for k in (1, 4):
        # bf16: the unconditioned model keeps autocast's bf16 copy of each weight, once per forward
        assert cond[k]["weight_copy_elements"] <= plain[k]["weight_copy_elements"], k
        assert cond[k]["bytes"] <= 1.05 * plain[k]["bytes"], (k, cond[k]["bytes"] / plain[k]["bytes"])
    assert cond[4]["weight_copy_elements"] == cond[1]["weight_copy_elements"]  # nothing weight-sized per loop


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_activation_form_keeps_one_input_for_its_linears_under_autocast(arch: str) -> None:
    """2 x 32 tokens, fewer than every mixer's input projections have rows: eq. 4 adapts the input (``P x``).

    Under bf16 autocast the input is cast once to bf16 and ``P x`` computed from that cast, which the mixer's
    Linears share (rebuilt in the backward pass). Before, the fp32 input was kept for the adapter and each Linear
    kept its own bf16 cast of the fp32 ``P x``: 1.157x (attention) and 1.065x (hybrid) the unconditioned model's
    bytes at k = 4; after, 1.039x and 0.992x.
    """
    plain, cond = kept(arch, False, 4, "bf16", seq_len=32), kept(arch, True, 4, "bf16", seq_len=32)
    assert cond["bytes"] <= 1.05 * plain["bytes"], cond["bytes"] / plain["bytes"]


def test_checkpointed_loops_keep_their_own_savings() -> None:
    """Inside activation checkpointing the mixers install no hooks of their own: a checkpointed loop keeps
    nothing of its activations, however the fold runs."""
    torch.manual_seed(0)
    model = LoopedLM(tiny_config(**SIZE, n_rec=2), conditioner=LoopConditioner(d_cond=16, rank=3))
    ids = torch.randint(0, 256, (2, 257), generator=torch.Generator().manual_seed(1))
    counted = {}
    for setting in ("none", "loop"):
        model.set_backprop(setting)
        for k in (1, 4):
            logits, counted[(setting, k)] = MEMORY_BENCH.kept_for_backward(model, lambda: model(ids[:, :-1], k))
            F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
    grown = {s: counted[(s, 4)]["bytes"] - counted[(s, 1)]["bytes"] for s in ("none", "loop")}
    assert grown["loop"] < 0.05 * grown["none"], grown


def test_a_parameter_changed_before_backward_is_refused() -> None:
    """As autograd refuses a saved tensor modified in place, the rebuild refuses a changed input."""
    model = LoopedLM(tiny_config(**SIZE, n_rec=2), conditioner=LoopConditioner(d_cond=16, rank=3))
    ids = torch.randint(0, 256, (2, 257))
    loss = F.cross_entropy(model(ids[:, :-1], 2).flatten(0, 1), ids[:, 1:].flatten())
    with torch.no_grad():
        model.core.layers[0].attn.q.weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified in place between the forward and the backward pass"):
        loss.backward()


def test_rebuilt_tensors_support_double_backward() -> None:
    """With ``create_graph=True`` the rebuild is differentiable: second derivatives equal keeping the tensor."""
    gen = torch.Generator().manual_seed(0)
    w, up, x = (torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True) for shape in ((5, 4), (4, 2), (3, 4)))

    def grad_norm(rebuild: bool) -> tuple[torch.Tensor, ...]:
        with RecomputedTensors(rebuild) as keep:
            y = x @ keep.add(lambda a, b: a + a @ b @ b.T, w, up).T
        (g,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
        return torch.autograd.grad(g.square().sum(), (w, up, x))

    for got, want in zip(grad_norm(True), grad_norm(False)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_rebuilt_tensors_keep_their_views_and_nothing_else() -> None:
    """A saved view of a registered tensor (a ``Linear`` saves ``W.t()``) is rebuilt with its own strides;
    the registered tensor itself dies with the forward."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(6, 4, generator=gen, requires_grad=True)
    x = torch.randn(8, 4, generator=gen, requires_grad=True)
    calls = []

    def scaled(a: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return 2 * a

    with RecomputedTensors(True) as keep:
        folded = keep.add(scaled, w)
        y = F.linear(x, folded)
    ref = torch.utils.weak.WeakIdRef(folded)
    del folded
    assert ref() is None  # autograd keeps the recipe, not the tensor
    y.sum().backward()
    assert len(calls) == 2  # the forward, and one rebuild for the backward
    torch.testing.assert_close(x.grad, 2 * w.detach().sum(0).expand(8, 4))
    torch.testing.assert_close(w.grad, 2 * x.detach().sum(0).expand(6, 4))
