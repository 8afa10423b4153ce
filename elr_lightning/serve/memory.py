"""What ``elr serve`` holds in memory, said at startup and checked against the machine before any worker starts.

The inference worker allocates one KV cache of ``--max_batch_size`` slots of ``--max_context``
positions (every attention store the ``--kv_cache`` policy keeps up to ``--max_loops``, counted by
:func:`~elr_lightning.inference.cache.kv_cache_bytes`, as ``elr cost`` does), the recurrent state of any
linear-attention layers, and the fp32 weights. :func:`serving_memory` counts them,
:func:`available_bytes` asks the device what is free, and :func:`check_fits` refuses a server that
cannot hold them, in one line naming the flags that shrink it.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch

from elr_lightning.inference.cache import kv_cache_bytes, recurrent_state_bytes
from elr_lightning.config import ModelConfig

#: Default ``--max_context``: the checkpoint's ``arch.max_seq_len``, capped here.
DEFAULT_MAX_CONTEXT = 4096

#: Bytes in a GB, as the startup line counts them.
GB = 1e9


@dataclass(frozen=True)
class ServingMemory:
    """Bytes the inference worker holds whatever the traffic.

    Attributes:
        kv_cache: Attention keys and values of every slot at ``max_context`` positions.
        state: Recurrent state (linear-attention and convolution) of every slot.
        weights: The model's parameters, in fp32.
    """

    kv_cache: int
    state: int
    weights: int

    @property
    def total(self) -> int:
        """All three together."""
        return self.kv_cache + self.state + self.weights


def default_max_context(config: ModelConfig) -> int:
    """``min(arch.max_seq_len, DEFAULT_MAX_CONTEXT)``: ``--max_context`` when the flag is not given."""
    return min(config.max_seq_len, DEFAULT_MAX_CONTEXT)


def checkpoint_parameters(raw: Mapping[str, Any], config: ModelConfig) -> int:
    """Parameters of a loaded checkpoint: its ``state_dict``'s elements (a tied tensor once), or (a sharded
    checkpoint read without its weights) those of ``config``'s :class:`~elr_lightning.model.LoopedLM` built on
    the meta device."""
    state = raw.get("state_dict")
    if isinstance(state, Mapping):
        tensors = {t.data_ptr(): t for t in state.values() if isinstance(t, torch.Tensor)}
        return sum(t.numel() for t in tensors.values())
    from elr_lightning.model import LoopedLM

    with torch.device("meta"):
        return sum(p.numel() for p in LoopedLM(config).parameters())


def serving_memory(
    config: ModelConfig, policy: str, loops_max: int, max_batch_size: int, max_context: int, dtype: str, params: int
) -> ServingMemory:
    """What a server of these settings holds (see the module docstring).

    Args:
        config: The checkpoint's architecture.
        policy: ``--kv_cache``.
        loops_max: Largest k served: the per-loop policy keeps a store per loop up to it.
        max_batch_size: Slots of the cache.
        max_context: Positions per slot.
        dtype: ``--dtype``: ``"bfloat16"`` caches keys and values in bf16 (autocast), else fp32.
        params: The model's parameters (:func:`checkpoint_parameters`), held in fp32.
    """
    cache_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    return ServingMemory(
        kv_cache=kv_cache_bytes(config, loops_max, policy, max_context, cache_dtype, max_batch_size),
        state=recurrent_state_bytes(config, loops_max, policy, cache_dtype, max_batch_size),
        weights=params * 4,
    )


def resolve_accelerator(accelerator: str) -> str:
    """``--accelerator`` as LitServe resolves it: ``auto`` is ``cuda`` when ``nvidia-smi`` lists a GPU."""
    if accelerator != "auto":
        return "cuda" if accelerator == "gpu" else accelerator
    from litserve.connector import check_cuda_with_nvidia_smi

    return "cuda" if check_cuda_with_nvidia_smi() > 0 else "cpu"


def available_bytes(accelerator: str) -> Optional[int]:
    """Free memory where the worker will run: available RAM on the CPU, the first visible GPU's free memory
    on CUDA (asked of ``nvidia-smi``, so this process opens no CUDA context); ``None`` when unknown."""
    if accelerator == "cpu":
        try:
            import psutil
        except ImportError:
            return None
        return int(psutil.virtual_memory().available)
    if accelerator != "cuda":
        return None
    device = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
    try:
        out = subprocess.check_output(
            ["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits", "-i", device],
            text=True, timeout=30,
        )
        return int(float(out.strip().splitlines()[0])) << 20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def describe(memory: ServingMemory, policy: str, loops_max: int, max_batch_size: int, max_context: int) -> str:
    """The startup line: the cache's bytes for these settings, and the total with the weights."""
    state = f" + recurrent state {memory.state:,} bytes" if memory.state else ""
    return (
        f"elr serve: KV cache {memory.kv_cache:,} bytes ({memory.kv_cache / GB:.2f} GB: {max_batch_size} slots x "
        f"{max_context} positions, {policy} up to k={loops_max}){state}; with the weights {memory.total / GB:.2f} GB"
    )


def check_fits(memory: ServingMemory, free: Optional[int], accelerator: str) -> None:
    """Refuse a server whose cache, state and weights exceed the ``free`` bytes of ``accelerator``.

    Raises:
        ValueError: In one line, with the sizes and the flags that shrink them.
    """
    if free is None or memory.total <= free:
        return
    raise ValueError(
        f"elr serve: the KV cache ({(memory.kv_cache + memory.state) / GB:.2f} GB) and weights ({memory.weights / GB:.2f} GB) need "
        f"{memory.total / GB:.2f} GB, more than the {free / GB:.2f} GB free on {accelerator}; lower --max_context or "
        "--max_batch_size, or use --kv_cache last_loop"
    )
