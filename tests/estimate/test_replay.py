"""Replayed layers (:mod:`elr_lightning.estimate.replay`) against the full trace: every k and mode, dense, hybrid and
MoE, DDP and FSDP2.

The fast path traces one call of each kind of layer call and replays its memory at every other call. On these
configs (width 64, where a layer's few kilobytes of parameters and eq. 4 terms are a large part of the step) the
replayed peak was at most 2.1% from the full trace (FSDP2, ``loop`` and ``layer`` checkpointing at k >= 2, about
120 KB); on the shipped 4B at k = 4 it equals the full trace to the MiB (``docs/memory.md``).
"""

from __future__ import annotations

import pytest

from test_fast import MODES, _small

from elr_lightning.estimate.memory import Setting, Target, fake_training, step_peak
from elr_lightning.lightning_cli import build_module

#: The largest relative difference measured on these small configs, with some room (see the module docstring).
TOLERANCE = 0.03


def _traced(config: dict, target: Target, replay: bool) -> tuple[dict, object]:
    with fake_training(lambda: build_module(config), target, phases=True, prior_grads=True, replay=replay) as trace:
        peaks = {(k, c, b): step_peak(trace(Setting(k, c, b, 2, 16))) for c, b in MODES for k in range(1, 4)}
        return peaks, trace.layer_replay


@pytest.mark.slow
@pytest.mark.parametrize("name", ["quickstart.yaml", "quickstart_hybrid.yaml"])
@pytest.mark.parametrize(
    "target",
    [
        Target("ddp", 2, "32-true", gradient_clip_val=1.0),
        Target("fsdp", 2, "bf16-mixed", gradient_clip_val=1.0, accumulate_grad_batches=2),
    ],
    ids=["ddp", "fsdp"],
)
def test_replayed_layers_give_the_traced_peak_at_every_k_and_mode(name: str, target: Target) -> None:
    """Every k to 3 and mode: the replayed step's peak is within 3% of the full trace, and layers were replayed."""
    exact, _ = _traced(_small(name, 3), target, replay=False)
    fast, layers = _traced(_small(name, 3), target, replay=True)
    assert layers is not None and layers.replayed > 0 and layers.traced == 0
    assert all(profile is not None for profile in layers.profiles.values())
    for key, full in exact.items():
        assert abs(fast[key].peak - full.peak) <= TOLERANCE * full.peak, (name, target.strategy, key, fast[key], full)
        assert fast[key].peak == fast[key].params + fast[key].grads + fast[key].optimizer + fast[key].activations


@pytest.mark.slow
def test_a_layer_that_writes_to_its_forward_passs_stores_is_traced_not_replayed() -> None:
    """A mixture of experts keeps loop 1's routes and adds a balance loss: its layers run for real, the rest replay."""
    config = _small("quickstart_moe.yaml", 3)
    target = Target("fsdp", 2, "bf16-mixed", gradient_clip_val=1.0)
    exact, _ = _traced(config, target, replay=False)
    fast, layers = _traced(config, target, replay=True)
    assert layers.traced > 0
    assert any(profile is None for profile in layers.profiles.values())
    for key, full in exact.items():
        assert abs(fast[key].peak - full.peak) <= TOLERANCE * full.peak, (key, fast[key], full)


def test_without_replay_the_step_has_no_layer_replay() -> None:
    """``--exact`` traces every call: no replay is installed."""
    config = _small("quickstart.yaml", max_loops=1)
    with fake_training(lambda: build_module(config), Target(), phases=True) as trace:
        assert trace.layer_replay is None
        assert step_peak(trace(Setting(1, "none", None, 1, 8))).peak > 0
