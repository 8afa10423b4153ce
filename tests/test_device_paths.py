"""Code paths whose behaviour depends on the device or on autocast, checked on CPU.

What only a CUDA device would exercise is reached here through CPU autocast (bf16, which autocast
treats the same way on both devices for the ops involved) or fake CUDA tensors (devices, dtypes and
shapes without data) where only the decision is under test.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from conftest import tiny_config
from elr_lightning.context import LoopContext
from elr_lightning.inference.generate import generate
from elr_lightning.mixers import MoE
from elr_lightning.mixers.delta_rule import delta_product
from elr_lightning.mixers.dispatch import compute_dtype, expert_swiglu, grouped_mm_supported, plan_dispatch
from elr_lightning.model import LoopedLM

pytestmark = pytest.mark.usefixtures("one_thread")


def moe_layer(dispatch: str) -> MoE:
    torch.manual_seed(0)
    moe = MoE(tiny_config(), num_experts=4, top_k=2, expert_dim=16, dispatch=dispatch)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe


def test_grouped_dispatch_computes_in_the_autocast_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """Autocast leaves ``torch._grouped_mm`` alone; the grouped path casts as autocast casts a matmul.

    On CUDA, fp32 weights and activations under ``bf16-mixed`` reached ``_grouped_mm`` as fp32,
    which it refuses there (bf16 only), so ``dispatch="grouped"`` failed and ``auto`` never used it.
    """
    seen: list[tuple[torch.dtype, torch.dtype]] = []
    real = torch._grouped_mm

    def spy(a, b, offs):
        seen.append((a.dtype, b.dtype))
        return real(a, b, offs=offs)

    monkeypatch.setattr(torch, "_grouped_mm", spy)
    x = torch.randn(2, 7, 32)
    outs = {}
    for dispatch in ("auto", "loop"):
        moe = moe_layer(dispatch)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs[dispatch] = moe(x, LoopContext(None, 1, 4, loop=0), 0)
            moe(x, LoopContext(None, 1, 4, loop=0), 0).float().sum().backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in moe.parameters())
    assert seen == [(torch.bfloat16, torch.bfloat16)] * 4  # up and down projections, two forwards
    assert outs["auto"].dtype == outs["loop"].dtype == torch.bfloat16
    torch.testing.assert_close(outs["auto"], outs["loop"], atol=2e-2, rtol=2e-2)


def test_grouped_support_on_cuda_follows_the_compute_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    with FakeTensorMode():
        x, w = torch.empty(5, 32, device="cuda"), torch.empty(4, 32, 64, device="cuda")
        x16 = torch.empty(5, 32, device="cuda", dtype=torch.bfloat16)
    assert not grouped_mm_supported(x, w)  # fp32 without autocast: CUDA's grouped mm takes bf16 only
    assert grouped_mm_supported(x, w, torch.bfloat16)  # under bf16 autocast both are cast
    assert not grouped_mm_supported(x, w, torch.float16)
    assert not grouped_mm_supported(x16, w)  # bf16 tokens, fp32 weights, no autocast to reconcile them
    capability[0] = (8, 0)
    assert not grouped_mm_supported(x, w, torch.bfloat16)  # before Hopper: the loop path


def test_grouped_dispatch_reads_nothing_back_to_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The slice sizes (a host sync) are read by the loop path only, once per plan."""
    g = torch.Generator().manual_seed(0)
    x, w_up = torch.randn(9, 16, generator=g), torch.randn(3, 16, 16, generator=g)
    w_down = torch.randn(3, 8, 16, generator=g)
    plan = plan_dispatch(torch.randint(0, 3, (9, 2), generator=g), 3)
    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or real(self))
    grouped = expert_swiglu(x, w_up, w_down, plan, grouped=True)
    assert reads == []
    loop = expert_swiglu(x, w_up, w_down, plan, grouped=False)
    expert_swiglu(x, w_up, w_down, plan, grouped=False)
    assert reads == [1]
    torch.testing.assert_close(grouped, loop, atol=1e-4, rtol=1e-4)


def test_a_generator_on_another_device_than_the_model_is_refused_before_the_prefill() -> None:
    """A CPU generator with a CUDA model would fail inside ``torch.multinomial`` after the prefill."""
    model = LoopedLM(tiny_config()).eval()
    elsewhere = SimpleNamespace(device=torch.device("cuda", 0))  # what a CUDA generator reports
    refused = r"generator is on cuda:0 but the model on cpu; pass torch.Generator\(device='cpu'\)"
    with pytest.raises(ValueError, match=refused):
        generate(model, torch.tensor([[1, 2, 3]]), max_new_tokens=2, generator=elsewhere)
    same = generate(model, torch.tensor([[1, 2, 3]]), max_new_tokens=2, generator=torch.Generator().manual_seed(0))
    again = generate(model, torch.tensor([[1, 2, 3]]), max_new_tokens=2, seed=0)
    assert torch.equal(same.new_tokens, again.new_tokens)


def test_device_dependent_choices_hold_on_the_meta_device() -> None:
    """Strategies probe the model on the meta device, where autocast cannot even be asked about."""
    q = torch.empty(1, 5, 2, 8, device="meta")
    k, v = torch.empty(1, 10, 2, 8, device="meta"), torch.empty(1, 10, 2, 8, device="meta")
    g, beta = torch.empty(1, 5, 2, device="meta"), torch.empty(1, 10, 2, device="meta")
    o, s = delta_product(q, k, v, g, beta, num_householder=2)
    assert o.shape == (1, 5, 2, 8) and s.shape == (1, 2, 8, 8) and o.device.type == "meta"
    assert compute_dtype(q) == torch.float32 and not grouped_mm_supported(q[0, 0], torch.empty(3, 8, 8, device="meta"))
