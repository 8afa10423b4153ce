"""Gated DeltaProduct: the chunked recurrence against a plain token-by-token one, the layer, padding."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from conftest import tiny_config
from elr_lightning.mixers import delta_rule
from elr_lightning.mixers.delta_rule import chunked_delta_product, delta_product
from elr_lightning.model import LoopedLM

pytestmark = pytest.mark.usefixtures("one_thread")

#: fp32 tolerance of the chunked path against the token-by-token recurrence (forward and gradients).
ATOL, RTOL = 2e-5, 1e-4


def token_by_token(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, n: int, state: Tensor
) -> tuple[Tensor, Tensor]:
    """The recurrence as written: decay, then n steps S <- S - b k (k^T S) + b k v^T, then o = S^T q."""
    outs = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        for j in range(n):
            kk, vv, bb = k[:, t * n + j], v[:, t * n + j], beta[:, t * n + j][..., None, None]
            state = state - bb * kk[..., :, None] * (kk[..., None, :] @ state)
            state = state + bb * kk[..., :, None] * vv[..., None, :]
        outs.append((q[:, t, ..., None] * state).sum(-2))
    return torch.stack(outs, 1), state


def inputs(b: int, t: int, h: int, dk: int, dv: int, n: int, seed: int = 0) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, dk, generator=gen) * dk**-0.5
    k = F.normalize(torch.randn(b, t * n, h, dk, generator=gen), dim=-1)
    v = torch.randn(b, t * n, h, dv, generator=gen)
    g = -F.softplus(torch.randn(b, t, h, generator=gen))
    beta = 2 * torch.rand(b, t * n, h, generator=gen)
    state = torch.randn(b, h, dk, dv, generator=gen)
    return [x.requires_grad_() for x in (q, k, v, g, beta, state)]


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("length, chunk", [(13, 4), (13, 8), (10, 64), (21, 16), (1, 4)])
def test_chunked_equals_token_by_token_forward_and_gradients(n: int, length: int, chunk: int) -> None:
    args = inputs(2, length, 2, 8, 6, n, seed=length * 10 + n)
    ref_o, ref_s = token_by_token(*args[:5], n, args[5])
    o, s = chunked_delta_product(*args[:5], num_householder=n, initial_state=args[5], chunk_size=chunk)
    torch.testing.assert_close(o, ref_o, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(s, ref_s, atol=ATOL, rtol=RTOL)
    weights = torch.randn_like(o), torch.randn_like(s)
    grads = torch.autograd.grad((o * weights[0]).sum() + (s * weights[1]).sum(), args)
    ref_grads = torch.autograd.grad((ref_o * weights[0]).sum() + (ref_s * weights[1]).sum(), args)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("n", [1, 3])
def test_chunked_equals_fla_reference(n: int) -> None:
    """fla's own token-by-token reference (fla imports on CPU with the ``fla`` extra installed)."""
    naive = pytest.importorskip("fla.ops.gated_delta_product.naive", reason="needs the fla extra")
    naive_recurrent_gated_delta_product = naive.naive_recurrent_gated_delta_product

    q, k, v, g, beta, state = (x.detach() for x in inputs(2, 11, 2, 8, 8, n, seed=n))
    want_o, want_s = naive_recurrent_gated_delta_product(
        q, k, v, g, beta, scale=1.0, initial_state=state.clone(), output_final_state=True, num_householder=n
    )
    o, s = chunked_delta_product(q, k, v, g, beta, num_householder=n, initial_state=state, chunk_size=4)
    torch.testing.assert_close(o, want_o, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(s, want_s, atol=ATOL, rtol=RTOL)


def test_fla_request_on_cpu_falls_back_and_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(delta_rule, "_FLA_WARNED", set())
    q, k, v, g, beta, _ = (x.detach() for x in inputs(1, 5, 1, 4, 4, 1))
    with pytest.warns(UserWarning, match="PyTorch chunked path"):
        o, _ = delta_product(q, k, v, g, beta, kernels="fla")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again, _ = delta_product(q, k, v, g, beta, kernels="fla")
    torch.testing.assert_close(o, chunked_delta_product(q, k, v, g, beta)[0])
    assert torch.equal(o, again)


def hybrid_config(**overrides):
    args = dict(
        n_in=2, n_rec=2, n_out=2, token_pattern=["gdp", "attention"],
        mixers={"gdp": {"class_path": "elr_lightning.mixers.GatedDeltaProduct", "init_args": {"chunk_size": 4}}},
    )  # fmt: skip
    return tiny_config(**{**args, **overrides})


def perturbed(model: LoopedLM) -> LoopedLM:
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def test_left_padding_does_not_leak_into_the_state() -> None:
    """A left-padded prompt's logits equal those of the prompt alone, whatever the padding holds."""
    model = perturbed(LoopedLM(hybrid_config(token_pattern=["gdp"], n_in=1, n_rec=1, n_out=1)))
    prompt = torch.randint(0, 64, (1, 6))
    padded = torch.cat((torch.randint(0, 64, (1, 3)), prompt), dim=1)
    mask = torch.cat((torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 6, dtype=torch.long)), dim=1)
    with torch.no_grad():
        alone = model(prompt, 2)
        with_pad = model(padded, 2, attention_mask=mask)
    torch.testing.assert_close(with_pad[:, 3:], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name, value", [("num_householder", 0), ("conv_size", 0), ("kernels", "cuda")])
def test_bad_gdp_arguments_name_the_field(name: str, value: object) -> None:
    spec = {"class_path": "elr_lightning.mixers.GatedDeltaProduct", "init_args": {name: value}}
    cfg = hybrid_config(mixers={"gdp": spec})
    with pytest.raises(ValueError, match=rf"arch.mixers.gdp.init_args.*{name}") as err:
        LoopedLM(cfg)
    assert "\n" not in str(err.value)


def test_hybrid_model_trains_and_every_parameter_gets_gradient() -> None:
    model = LoopedLM(hybrid_config())
    x = torch.randint(0, 64, (2, 10))
    loss = F.cross_entropy(model(x[:, :-1], 2).flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    gdp = model.core.layers[0].attn
    a = gdp.A_log.exp()
    assert type(gdp).__name__ == "GatedDeltaProduct" and bool(((a >= 1) & (a <= 16)).all())
