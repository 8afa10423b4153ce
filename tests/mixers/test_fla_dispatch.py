"""When GatedDeltaProduct hands its recurrence to fla's kernels, and that it hands over what fla asserts.

fla's ``chunk_gated_delta_product`` runs only on CUDA, so on CPU the wiring is tested against a fake
kernel that enforces fla's own asserts (``q`` not float32; ``k``, ``v``, ``beta``, ``g`` and the state
shaped as its docstring says) and otherwise returns the PyTorch path's numbers; the device check of
:func:`fla_unsupported` is tested on fake CUDA tensors (shapes, dtypes and devices only, no data).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode

from conftest import tiny_config
from elr_lightning.inference.generate import generate
from elr_lightning.mixers import delta_rule
from elr_lightning.mixers.delta_rule import chunked_delta_product, delta_product, fla_unsupported
from elr_lightning.model import LoopedLM

pytestmark = pytest.mark.usefixtures("one_thread")


def fake_fla(calls: list[dict]) -> Callable[..., tuple[Tensor, Tensor]]:
    """A stand-in for fla's ``chunk_gated_delta_product`` (fla 0.6) that asserts its input contract."""

    def kernel(q, k, v, g, beta, num_householder, scale=None, initial_state=None, output_final_state=False):
        assert q.dtype != torch.float32, "ChunkGatedDeltaProductFunction does not support float32."
        assert q.dtype == k.dtype == v.dtype == beta.dtype, "one dtype for q, k, v and beta (as fla's layer passes)"
        b, t, h, dk, dv = *q.shape, v.shape[-1]
        n = num_householder
        assert k.shape == (b, t * n, h, dk) and v.shape == (b, t * n, h, dv) and beta.shape == (b, t * n, h)
        assert g.shape == (b, t, h) and g.dtype == torch.float32
        assert dk <= 256
        assert initial_state is None or (initial_state.shape == (b, h, dk, dv) and initial_state.dtype == torch.float32)
        assert scale == 1.0 and output_final_state
        calls.append({"dtype": q.dtype, "state": initial_state is not None, "tokens": t})
        o, state = chunked_delta_product(q, k, v, g, beta.float(), n, initial_state)
        return o.to(q.dtype), state

    return kernel


@pytest.fixture
def fla_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Route fla's dispatch to :func:`fake_fla` and let it run on CPU; returns the calls it records."""
    calls: list[dict] = []
    monkeypatch.setattr(delta_rule, "_fla_kernel", lambda: fake_fla(calls))
    monkeypatch.setattr(delta_rule, "FLA_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(delta_rule, "_FLA_WARNED", set())
    return calls


def inputs(dtype: torch.dtype, n: int = 2, b: int = 2, t: int = 7, h: int = 2, dk: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, t, h, dk, generator=gen) * dk**-0.5).to(dtype)
    k = F.normalize(torch.randn(b, t * n, h, dk, generator=gen), dim=-1).to(dtype)
    v = torch.randn(b, t * n, h, dk, generator=gen).to(dtype)
    g = -F.softplus(torch.randn(b, t, h, generator=gen))
    beta = 2 * torch.rand(b, t * n, h, generator=gen)
    state = torch.randn(b, h, dk, dk, generator=gen)
    return q, k, v, g, beta, state


def on_cuda(tensors) -> list[Tensor]:
    """Data-free CUDA tensors of the same shapes and dtypes (call under ``FakeTensorMode``)."""
    return [torch.empty(x.shape, dtype=x.dtype, device="cuda") for x in tensors]


def test_fla_unsupported_names_each_unmet_condition(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(delta_rule, "_fla_kernel", lambda: fake_fla([]))
    with FakeTensorMode():
        cuda = on_cuda(inputs(torch.bfloat16))
        fp32 = on_cuda(inputs(torch.float32))
        half = on_cuda(inputs(torch.float16))
        wide = on_cuda(inputs(torch.bfloat16, dk=320))
        mixed = [*cuda[:2], torch.empty(cuda[2].shape, device="cuda"), *cuda[3:]]
        state_on_cpu = [*cuda[:5], torch.empty(cuda[5].shape)]
    cpu = inputs(torch.bfloat16)
    assert fla_unsupported(*cuda) is None
    assert fla_unsupported(*half) is None
    assert fla_unsupported(*cuda[:5]) is None
    assert "bf16 or fp16" in fla_unsupported(*fp32) and "float32" in fla_unsupported(*fp32)
    assert "precision bf16-mixed" in fla_unsupported(*fp32)
    assert "bf16 or fp16" in fla_unsupported(*mixed)
    assert "head_dim <= 256, not 320" in fla_unsupported(*wide)
    assert fla_unsupported(*cpu) == "the tensors are not on CUDA"
    assert fla_unsupported(*state_on_cpu) == "the tensors are not on CUDA"
    monkeypatch.setattr(delta_rule, "_fla_kernel", lambda: None)
    assert "does not import" in fla_unsupported(*cuda)


@pytest.mark.parametrize("with_state", [False, True])
def test_half_precision_inputs_reach_fla_as_it_asserts(fla_calls: list[dict], with_state: bool) -> None:
    q, k, v, g, beta, state = inputs(torch.bfloat16)
    state = state if with_state else None
    o, s = delta_product(q, k, v, g, beta, num_householder=2, initial_state=state)
    assert fla_calls == [{"dtype": torch.bfloat16, "state": with_state, "tokens": 7}]
    want_o, want_s = chunked_delta_product(q, k, v, g, beta.to(k.dtype).float(), 2, state)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    torch.testing.assert_close(o, want_o)
    torch.testing.assert_close(s, want_s)


def test_float32_falls_back_silently_on_auto_and_warns_once_naming_the_dtype_on_fla(fla_calls: list[dict]) -> None:
    q, k, v, g, beta, state = inputs(torch.float32)
    want = chunked_delta_product(q, k, v, g, beta, 2, state)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        auto, _ = delta_product(q, k, v, g, beta, num_householder=2, initial_state=state)
    with pytest.warns(UserWarning, match=r"kernels='fla' but fla's kernels need bf16 or fp16 inputs, not float32"):
        asked, _ = delta_product(q, k, v, g, beta, num_householder=2, initial_state=state, kernels="fla")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        delta_product(q, k, v, g, beta, num_householder=2, initial_state=state, kernels="fla")
    assert fla_calls == []
    torch.testing.assert_close(auto, want, atol=0, rtol=0)
    torch.testing.assert_close(asked, want, atol=0, rtol=0)


def hybrid(**init_args) -> LoopedLM:
    spec = {"class_path": "elr_lightning.mixers.GatedDeltaProduct", "init_args": {"chunk_size": 4, **init_args}}
    torch.manual_seed(0)
    return LoopedLM(tiny_config(n_in=1, n_rec=1, n_out=1, token_pattern=["gdp"], mixers={"gdp": spec}))


def test_hybrid_model_trains_in_fp32_and_bf16_where_fla_is_present(fla_calls: list[dict]) -> None:
    """fp32 (``precision: 32``) never reaches fla's kernels; bf16 autocast trains through them."""
    model = hybrid()
    x = torch.randint(0, 64, (2, 10))
    loss = F.cross_entropy(model(x[:, :-1], 2).flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    assert fla_calls == [] and torch.isfinite(loss)
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x[:, :-1], 2)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
    loss.backward()
    assert len(fla_calls) == 4  # 1 input layer + 2 loops x 1 recurrent layer + 1 output layer
    assert {c["dtype"] for c in fla_calls} == {torch.bfloat16} and torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_cached_bf16_decode_hands_fla_the_float32_state(fla_calls: list[dict]) -> None:
    model = hybrid().eval()
    prompt = torch.randint(0, 64, (1, 5))
    fp32 = generate(model, prompt, loops=2, max_new_tokens=3, greedy=True)
    assert fla_calls == [] and fp32.new_tokens.shape == (1, 3)
    bf16 = generate(model, prompt, loops=2, max_new_tokens=3, greedy=True, autocast_dtype=torch.bfloat16)
    prefill, decode = [c for c in fla_calls if c["tokens"] == 5], [c for c in fla_calls if c["tokens"] == 1]
    assert prefill and decode and len(prefill) + len(decode) == len(fla_calls)
    assert all(c["state"] for c in decode) and bf16.new_tokens.shape == (1, 3)


def test_the_pytorch_path_computes_in_float32_under_autocast() -> None:
    """bf16 autocast (``bf16-mixed``, where fla cannot run) must not turn the chunk products to bf16."""
    q, k, v, g, beta, state = inputs(torch.float32, t=40)
    want_o, want_s = chunked_delta_product(q, k, v, g, beta, 2, state, chunk_size=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, s = delta_product(q, k, v, g, beta, num_householder=2, initial_state=state, chunk_size=16)
    assert o.dtype == s.dtype == torch.float32
    torch.testing.assert_close(o, want_o, atol=0, rtol=0)
    torch.testing.assert_close(s, want_s, atol=0, rtol=0)
