"""The shipped GPU configs fit, at every k to K, on the hardware their headers name, as shipped (minutes of tracing)."""

from __future__ import annotations

import pytest

from _shipped_configs import LARGE, ROOT, check_fits_as_shipped


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LARGE))
def test_the_shipped_gpu_config_fits_at_every_k_as_shipped(name: str, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    check_fits_as_shipped(name)
