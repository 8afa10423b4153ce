"""Units and hardware of ``elr estimate``: memory sizes as the user writes them, and the memory of this machine's devices."""

from __future__ import annotations

import os
import re
from typing import Any, Optional, Union

import torch

#: ``--device_memory`` of a GPU config estimated on a machine without a GPU: an "80 GB" accelerator.
DEFAULT_DEVICE_MEMORY = 80 * 10**9

_GIB = 2**30
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(text: Union[str, int], flag: str = "--device_memory") -> int:
    """Bytes of a size such as ``80GB`` (10^9 bytes), ``79.6GiB`` (2^30), ``512MiB`` or ``1e9B``.

    Raises:
        ValueError: Naming ``flag``, the value and the accepted form.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]?i?b)\s*", str(text), flags=re.IGNORECASE)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"{flag} {text!r} is not a memory size; give a number and a unit, e.g. 80GB or 79.6GiB")
    return int(float(match.group(1)) * _UNITS[unit])


def detected_device_memory(accelerator: Any) -> tuple[int, str]:
    """Memory of one device of a run on ``trainer.accelerator``, and where the figure comes from.

    The CPU (``cpu``, or ``auto`` on a machine without a GPU) has this machine's RAM; a GPU run has
    the memory of this machine's first GPU, or :data:`DEFAULT_DEVICE_MEMORY` when it has none.
    """
    name = str(accelerator or "auto").lower()
    gpu = torch.cuda.is_available()
    if name == "cpu" or (name == "auto" and not gpu):
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), f"this machine's RAM (trainer.accelerator {name})"
        except (AttributeError, ValueError, OSError):  # no sysconf (Windows)
            return DEFAULT_DEVICE_MEMORY, "assumed: this machine's RAM is unknown; pass --device_memory"
    if gpu:
        return torch.cuda.get_device_properties(0).total_memory, f"GPU 0 of this machine ({torch.cuda.get_device_name(0)})"
    return DEFAULT_DEVICE_MEMORY, f"assumed: trainer.accelerator {name} and no GPU here; pass --device_memory"


def detected_host_memory(device_type: str) -> tuple[Optional[int], str]:
    """RAM of one node of a run on ``device_type`` devices, for its offloaded state, and where the figure comes from.

    A GPU run estimated on a machine with a GPU is taken to run here: this machine's RAM. Elsewhere
    the node is not known and the host memory is not checked (``None``). A CPU run's host is its
    device.
    """
    if device_type == "cpu":
        return None, "the device: a CPU run's offloaded state is in the same RAM"
    if torch.cuda.is_available():
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's RAM"
        except (AttributeError, ValueError, OSError):
            pass
    return None, "not checked: pass --host_memory (RAM per node)"


def positive_count(value: Any, flag: str) -> int:
    """``value`` if it is an integer >= 1, else a ``ValueError`` naming ``flag``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{flag} {value!r} must be an integer >= 1")
    return value


def device_count(devices: Any) -> int:
    """Devices per node of a ``trainer.devices`` value: a count, ``"auto"``/``-1`` (this machine's GPUs, else 1),
    ``"0,1"`` or a list of ids."""
    if isinstance(devices, (list, tuple)):
        return max(1, len(devices))
    text = str(devices).strip()
    if text in ("auto", "-1", "None"):
        return max(1, torch.cuda.device_count())
    if "," in text:
        return len([part for part in text.split(",") if part.strip()])
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise ValueError(f"trainer.devices={devices!r}: give --devices N (devices per node)")



__all__ = [
    "DEFAULT_DEVICE_MEMORY",
    "detected_device_memory",
    "detected_host_memory",
    "device_count",
    "parse_memory",
    "positive_count",
]
