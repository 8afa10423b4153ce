"""Bad inputs to the model package are refused by name, and a fast path asked for where it cannot run
falls back: regressions found by the architecture property tests (``test_arch_properties.py``)."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elr_lightning.config import ModelConfig
from elr_lightning.inference.generate import generate
from elr_lightning.model import LoopedLM
from elr_lightning.inference.fold import conditioned_at, fold_conditioning
from test_arch_properties import VOCAB, Arch, ids_for


#: Each integer field of the config with its smallest legal value.
INTEGER_FIELDS = {
    "vocab_size": 1, "d_model": 1, "n_heads": 1, "n_in": 0, "n_rec": 1, "n_out": 0, "max_seq_len": 1,
    "ff_multiple_of": 1, "max_loops": 1, "n_kv_heads": 1, "d_ff": 1,
}


@settings(max_examples=25, deadline=None)
@given(
    field=st.sampled_from(sorted(INTEGER_FIELDS)),
    value=st.one_of(st.booleans(), st.floats(allow_nan=True, allow_subnormal=False), st.text(max_size=2), st.integers(-3, 0)),
)
def test_a_bad_integer_field_is_refused_by_name(field: str, value: object) -> None:
    """Non-integers (bools, floats such as ``2.5`` or ``1.0``, strings) and values below the field's
    minimum never build a config; the error names the field."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= INTEGER_FIELDS[field]:
        value = INTEGER_FIELDS[field] - 1
    with pytest.raises(ValueError, match=rf"arch\.{field}="):
        ModelConfig(**{field: value})


@settings(max_examples=15, deadline=None)
@given(
    field=st.sampled_from(["init_std", "norm_eps", "rope_base"]),
    value=st.sampled_from([float("nan"), float("inf"), -float("inf"), 0.0, -1.0, "1e-6", True]),
)
def test_a_bad_float_field_is_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"arch\.{field}="):
        ModelConfig(**{field: value})


def test_tie_embeddings_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match=r"arch\.tie_embeddings='no' must be true or false"):
        ModelConfig(tie_embeddings="no")


def test_grouped_dispatch_where_it_cannot_run_loops_and_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (found by the causality property): ``dispatch="grouped"`` with expert rows that are
    not 16-byte aligned (d_ff 32 over top_k 3 gives expert_dim 10) raised inside ``torch._grouped_mm``."""
    monkeypatch.setattr("elr_lightning.mixers.moe._GROUPED_WARNED", set())

    def config(dispatch: str) -> ModelConfig:
        moe = {"class_path": "elr_lightning.mixers.MoE", "init_args": {"num_experts": 3, "top_k": 3, "dispatch": dispatch}}
        return ModelConfig(
            vocab_size=VOCAB, d_model=16, n_heads=2, n_in=0, n_rec=1, n_out=1, d_ff=32, max_seq_len=64,
            channel_pattern={"out": ["moe"]}, mixers={"moe": moe},
        )

    torch.manual_seed(0)
    grouped = LoopedLM(config("grouped")).eval()
    looped = LoopedLM(config("loop")).eval()
    looped.load_state_dict(grouped.state_dict())
    ids = ids_for(0, 2, 5)
    with pytest.warns(UserWarning, match=r"dispatch='grouped' but torch\._grouped_mm cannot run .*expert_dim=10"):
        out = grouped(ids, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = grouped(ids, 2)
    assert torch.equal(out, again)
    torch.testing.assert_close(out, looped(ids, 2), atol=1e-6, rtol=0)


@pytest.mark.parametrize("loops", [2.5, 2.0, True, "2", 0])
def test_a_loop_count_that_is_not_a_positive_integer_is_refused(loops: object) -> None:
    """Regression: ``loops=2.0`` or ``2.5`` passed the ``loops < 1`` check and failed inside
    ``range`` with a TypeError (forward, ``fold_conditioning``, ``conditioned_at``, ``generate``);
    ``True`` ran one loop."""
    model = Arch(ModelConfig(vocab_size=VOCAB, d_model=16, n_heads=2, n_in=0, n_out=0), "adaptive", True).build(0)
    ids = ids_for(0, 1, 3)
    message = rf"loops={loops!r} must be an integer >= 1"
    for call in (
        lambda: model(ids, loops),
        lambda: fold_conditioning(model, loops),
        lambda: conditioned_at(model, loops),
        lambda: generate(model, ids, loops=loops, max_new_tokens=1),
    ):
        with pytest.raises(ValueError, match=message.replace(".", r"\.")):
            call()


@pytest.mark.parametrize("value", [True, 1.0, 0])
def test_backprop_loops_must_be_a_positive_integer(value: object) -> None:
    """Regression: ``backprop_loops=True`` passed as one loop (a bool is an int to Python)."""
    model = Arch(ModelConfig(vocab_size=VOCAB, d_model=16, n_heads=2, n_in=0, n_out=0), "adaptive", False).build(0)
    with pytest.raises(ValueError, match=rf"backprop_loops={value!r} must be an integer >= 1"):
        model.set_backprop("none", value)


GDP_SIZES = ("num_householder", "conv_size", "chunk_size", "num_heads", "head_dim")
MOE_SIZES = ("num_experts", "top_k", "expert_dim", "shared_expert_dim")


@pytest.mark.parametrize("mixer,field", [("gdp", name) for name in GDP_SIZES] + [("moe", name) for name in MOE_SIZES])
@pytest.mark.parametrize("value", [True, 2.0])
def test_gdp_and_moe_integer_fields_refuse_true_and_floats(mixer: str, field: str, value: object) -> None:
    """Regression: ``True`` passed every GDP and MoE size check as 1 (a bool is an int to Python), and
    ``shared_expert_dim`` took any number >= 0."""
    from elr_lightning.mixers import GatedDeltaProduct, MoE

    config = ModelConfig(vocab_size=VOCAB, d_model=16, n_heads=2)
    cls = GatedDeltaProduct if mixer == "gdp" else MoE
    with pytest.raises(ValueError, match=rf"{field}={value!r} must be"):
        cls(config, **{field: value})


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"virtual_ranks": True}, r"virtual_ranks=True must be an integer >= 1"),
        ({"virtual_ranks": 2.0}, r"virtual_ranks=2\.0 must be an integer >= 1"),
        ({"val_loops": [1, True]}, r"val_loops=\[1, True\] must be a non-empty list of integer"),
        ({"val_loops": [1.5]}, r"val_loops=\[1\.5\] must be"),
        ({"val_loops": 2}, r"val_loops=2 must be"),
        ({"val_loops": []}, r"val_loops=\[\] must be"),
    ],
)
def test_module_counts_are_type_checked(kwargs: dict, message: str) -> None:
    """Regression: ``virtual_ranks: true`` ran one shard and ``val_loops: [1, 1.5]`` failed mid-validation."""
    from elr_lightning.module import ELRModule

    with pytest.raises(ValueError, match=message):
        ELRModule(arch=ModelConfig(vocab_size=VOCAB, d_model=16, n_heads=2, max_loops=2), **kwargs)
