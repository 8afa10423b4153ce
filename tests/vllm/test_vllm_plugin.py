"""Tests of the vLLM plugin's pure parts (no vLLM needed): k per request, the served layout, refusals, KV size."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("transformers")
from elr_lightning.inference.cache import kv_cache_bytes  # noqa: E402
from elr_lightning.config import ModelConfig  # noqa: E402
from elr_lightning.hf.configuration_elr import ELRConfig  # noqa: E402
from elr_lightning.vllm.config import ELRServeError, kv_bytes_per_token, served_elr  # noqa: E402
from elr_lightning.vllm.loops import LOOPS_FIELD, request_loops, token_loops  # noqa: E402

ARCH = dict(vocab_size=256, d_model=128, n_heads=2, n_kv_heads=1, n_in=1, n_rec=2, n_out=1, max_loops=3)


def hf_config(**overrides) -> ELRConfig:
    return ELRConfig(**{**dict(ARCH, d_ff=256, max_seq_len=128), **overrides})


@given(st.integers(1, 6))
def test_an_integer_k_in_the_budget_is_served(k: int) -> None:
    assert request_loops({"loops": k}, 1, 6) == k


def test_a_request_without_loops_gets_the_default() -> None:
    assert request_loops(None, 2, 6) == 2
    assert request_loops({"other": 1}, 3, 6) == 3


@pytest.mark.parametrize("bad", [0, -1, 7, 2.5, 2.0, "3", True, None, [2], "auto"])
def test_a_bad_k_is_refused_naming_the_field(bad) -> None:
    with pytest.raises(ValueError, match=LOOPS_FIELD.replace(".", r"\.")) as err:
        request_loops({"loops": bad}, 1, 6)
    assert "\n" not in str(err.value)
    if bad == "auto":
        assert "adaptive" in str(err.value)


def test_the_default_budget_is_twice_the_trained_one_and_overridable() -> None:
    assert served_elr(hf_config()).budget == 6
    assert served_elr(hf_config(elr_max_serve_loops=4)).budget == 4
    with pytest.raises(ELRServeError, match="elr_max_serve_loops"):
        served_elr(hf_config(elr_max_serve_loops=0))
    with pytest.raises(ELRServeError, match="default_loops"):
        served_elr(hf_config(elr_max_serve_loops=2, default_loops=3))
    with pytest.raises(ELRServeError, match="elr_kv_cache"):
        served_elr(hf_config(elr_kv_cache="both"))


def test_cache_slots_are_one_per_call_per_loop_or_one_per_layer() -> None:
    per_loop, last_loop = served_elr(hf_config()), served_elr(hf_config(elr_kv_cache="last_loop"))
    slots = [*per_loop.rec_slots(0), *per_loop.rec_slots(1), per_loop.out_slot(0)]
    assert sorted(slots) == list(range(1, 1 + 6 * 2 + 1))  # input slot 0, 12 recurrent stores, then output
    assert [per_loop.rec_call(i) for i in (1, 2, 6)] == [0, 1, 5]
    assert last_loop.rec_slots(1) == [2] and last_loop.out_slot(0) == 3 and last_loop.rec_call(5) == 0


@pytest.mark.parametrize("policy", ["per_loop", "last_loop"])
def test_kv_bytes_per_token_are_what_elr_cost_counts_at_the_budget(policy: str) -> None:
    config = hf_config(elr_kv_cache=policy)
    served = served_elr(config)
    arch = ModelConfig(**ARCH)
    assert kv_bytes_per_token(config, served, 4) == kv_cache_bytes(arch, served.budget, policy, 1, torch.float32)


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (dict(token_mixers=[{"type": "attention"}, {"type": "gdp", "n_heads": 2}, {"type": "attention"},
                            {"type": "attention"}]), "Gated DeltaProduct"),
        (dict(channel_mixers=[{"type": "swiglu"}, {"type": "moe", "n_experts": 4}, {"type": "swiglu"},
                              {"type": "swiglu"}]), "mixture-of-experts"),
    ],
)  # fmt: skip
def test_hybrid_and_moe_exports_are_refused_in_one_line(overrides: dict, reason: str) -> None:
    with pytest.raises(ELRServeError, match=reason) as err:
        served_elr(hf_config(**overrides))
    assert "\n" not in str(err.value) and "elr serve" in str(err.value)


def test_a_folder_of_another_model_type_is_refused_in_one_line() -> None:
    from transformers import LlamaConfig

    with pytest.raises(ELRServeError, match="model_type 'llama'") as err:
        served_elr(LlamaConfig())
    assert "\n" not in str(err.value)


def test_token_loops_follow_the_batch_order_and_each_request_s_tokens() -> None:
    """The runner hook's tensor: request r's k repeated over its scheduled tokens, in ``input_batch`` order."""
    def request(k):
        return SimpleNamespace(sampling_params=SimpleNamespace(extra_args=None if k is None else {"loops": k}))

    runner = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=hf_config(default_loops=2)),
        input_batch=SimpleNamespace(req_ids=["b", "a", "c"]),
        requests={"a": request(3), "b": request(None), "c": request(6)},
        query_start_loc=SimpleNamespace(np=np.array([0, 4, 5, 7, 7])),
        device=torch.device("cpu"),
    )
    assert token_loops(runner, 3).tolist() == [2, 2, 2, 2, 3, 6, 6]
    assert token_loops(runner, 0) is None


def test_the_v2_runner_state_passes_each_token_s_k_from_its_request_slot(monkeypatch) -> None:
    """Model Runner V2 (CUDA builds): k kept per request slot by ``add_request``, expanded per token in batch order."""
    if not os.environ.get("CI"):
        pytest.importorskip("vllm.v1.worker.gpu.model_states.default")
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    from elr_lightning.vllm.loops import elr_model_state

    def base_init(self, vllm_config, model, encoder_cache, device):
        self.model_config, self.max_num_reqs, self.device = vllm_config.model_config, 4, device

    monkeypatch.setattr(DefaultModelState, "__init__", base_init)
    monkeypatch.setattr(DefaultModelState, "add_request", lambda self, index, data: None)
    monkeypatch.setattr(DefaultModelState, "prepare_inputs", lambda self, batch, states: {})
    config = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf_config(default_loops=2)))
    state = elr_model_state()(config, None, None, torch.device("cpu"))
    for slot, extra in ((0, {"loops": 6}), (3, None), (1, {"loops": 1})):
        state.add_request(slot, SimpleNamespace(sampling_params=SimpleNamespace(extra_args=extra)))
    with pytest.raises(ValueError, match="vllm_xargs.loops"):
        state.add_request(2, SimpleNamespace(sampling_params=SimpleNamespace(extra_args={"loops": 9})))
    batch = SimpleNamespace(num_reqs=3, idx_mapping_np=np.array([3, 0, 1, 0]), num_scheduled_tokens=np.array([2, 1, 3, 0]))
    assert state.prepare_inputs(batch, None)["loops"].tolist() == [2, 2, 6, 1, 1, 1]
