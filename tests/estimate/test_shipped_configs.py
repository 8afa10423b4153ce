"""Every shipped config fits, at every k to K, on the hardware its header names, as shipped.

Each config's header comments name its hardware and show the ``elr estimate`` line that proves the fit;
this test runs the fast estimate with that line's flags and fails on any verdict other than "fits", and
on any k whose step does not fit under the config's own checkpointing and micro-batch.
"""

from __future__ import annotations

import pytest

from _shipped_configs import CONFIGS, LARGE, ROOT, check_fits_as_shipped, header_estimate
from elr_lightning.estimate.command import estimate_parser


def test_every_config_header_names_its_hardware_and_the_estimate_line() -> None:
    for name in CONFIGS:
        args = estimate_parser().parse_args(header_estimate(name))
        assert args.config == [f"config/{name}"], name
        assert args.device_memory is not None, f"config/{name}: the estimate line names no --device_memory"
        assert not (args.activation_checkpointing or args.micro_batch or args.strategy or args.backprop_loops), (
            f"config/{name}: the estimate line overrides the config; it must prove the config as shipped"
        )


@pytest.mark.parametrize("name", [name for name in CONFIGS if name not in LARGE])
def test_the_shipped_config_fits_at_every_k_as_shipped(name: str, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    check_fits_as_shipped(name)
