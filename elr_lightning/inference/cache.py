"""Cache policies for generation: what each layer keeps between decode steps (attention KV, recurrent state).

The storage and the policy seam live in :mod:`elr_lightning.cache_store` (imported here); this
module adds the built-in policies and the memory accounting of an architecture under a policy.
"""

from __future__ import annotations

from typing import Hashable, Union

import torch
from typing_extensions import override

from elr_lightning.cache_store import KVCache, LayerStore
from elr_lightning.config import ModelConfig

__all__ = [
    "CACHE_POLICIES", "LastLoopCache", "PerLoopCache", "PolicyLike", "kv_cache_bytes", "layer_caches",
    "recurrent_state_bytes", "resolve_policy",
]


class PerLoopCache(KVCache):
    """One store per (layer, loop): exact, reproduces the cache-free forward; memory grows with k."""

    @override
    def key(self, layer: int, loop: int) -> Hashable:
        return (layer, loop)


class LastLoopCache(KVCache):
    """One store per layer that every loop overwrites: attention KV memory of k = 1.

    A new token's loop i attends to the past tokens' last-loop keys and values plus its own loop-i
    ones; after its last loop, the stored entry is the last loop's.
    """

    @override
    def key(self, layer: int, loop: int) -> Hashable:
        return layer


#: Cache policies by the name ``elr generate --kv_cache`` accepts.
CACHE_POLICIES: dict[str, type[KVCache]] = {"per_loop": PerLoopCache, "last_loop": LastLoopCache}

#: A cache policy: a name of :data:`CACHE_POLICIES` or a :class:`KVCache` subclass.
PolicyLike = Union[str, type[KVCache]]


def resolve_policy(policy: PolicyLike) -> type[KVCache]:
    """The :class:`KVCache` subclass that ``policy`` names.

    Raises:
        ValueError: ``policy`` is neither a known name nor a :class:`KVCache` subclass.
    """
    if isinstance(policy, str):
        if policy not in CACHE_POLICIES:
            raise ValueError(f"unknown KV-cache policy {policy!r}; choose one of {sorted(CACHE_POLICIES)}")
        return CACHE_POLICIES[policy]
    if isinstance(policy, type) and issubclass(policy, KVCache):
        return policy
    raise ValueError(f"kv_cache={policy!r} must be one of {sorted(CACHE_POLICIES)} or a KVCache subclass")


def _stores(config: ModelConfig, loops: int, policy: PolicyLike) -> dict[Hashable, str]:
    """The distinct stores ``policy`` keeps at ``loops``, each with the token mixer of its first layer call."""
    cache = resolve_policy(policy)(max_len=1)
    stores: dict[Hashable, str] = {}
    for layer, loop, mixer in config.layer_calls(loops):
        stores.setdefault(cache.key(layer, loop), mixer)
    return stores


def _mixer_bytes(config: ModelConfig, names: set[str], dtype: torch.dtype) -> dict[str, tuple[int, int]]:
    """``(per_token, fixed)`` cache bytes of each named token mixer, built on the meta device."""
    with torch.device("meta"):
        built = {name: config.build_mixer(name).cache_bytes(dtype) for name in names}
    return {name: (b.per_token, b.fixed) for name, b in built.items()}


def layer_caches(config: ModelConfig, loops: int, policy: PolicyLike) -> int:
    """Number of layer caches (distinct stores) ``policy`` keeps at loop count ``loops``.

    Counts the distinct :meth:`KVCache.key` values over the layer calls of one forward pass
    (:meth:`~elr_lightning.config.ModelConfig.layer_calls`: input layers at loop 0, recurrent layers
    at loops ``1..k``, output layers at loop 0). ``PerLoopCache`` gives
    ``D_eff(k) = L_in + k L_rec + L_out`` (eq. 1), ``LastLoopCache`` gives ``D_eff(1)``.

    Args:
        config: The architecture.
        loops: The loop count k.
        policy: A policy name or :class:`KVCache` subclass.
    """
    return len(_stores(config, loops, policy))


def kv_cache_bytes(
    config: ModelConfig,
    loops: int,
    policy: PolicyLike,
    tokens: int,
    dtype: torch.dtype = torch.float32,
    batch: int = 1,
) -> int:
    """Attention KV bytes ``policy`` holds for ``tokens`` tokens of ``batch`` sequences.

    Per store, the token mixer's per-token cache bytes (``2 * n_kv_heads * head_dim`` elements of
    ``dtype`` for attention, none for a recurrent mixer), summed over the :func:`layer_caches`
    stores (all ``D_eff(k)`` for per-loop, ``D_eff(1)`` for last-loop on an all-attention model).

    Args:
        config: The architecture.
        loops: The loop count k.
        policy: A policy name or :class:`KVCache` subclass.
        tokens: Cached positions per sequence (prompt, padding included, plus decoded tokens).
        dtype: Dtype of the cached keys and values.
        batch: Sequences in the batch.
    """
    stores = _stores(config, loops, policy)
    per_mixer = _mixer_bytes(config, set(stores.values()), dtype)
    return sum(per_mixer[m][0] for m in stores.values()) * tokens * batch


def recurrent_state_bytes(
    config: ModelConfig, loops: int, policy: PolicyLike, dtype: torch.dtype = torch.float32, batch: int = 1
) -> int:
    """Recurrent-state bytes (linear-attention and convolution state) ``policy`` holds, at any length.

    Per store, the token mixer's fixed cache bytes (zero for attention), summed over the stores.

    Args:
        config: The architecture.
        loops: The loop count k.
        policy: A policy name or :class:`KVCache` subclass.
        dtype: Dtype of the activations (a mixer may keep its recurrent state in float32 regardless).
        batch: Sequences in the batch.
    """
    stores = _stores(config, loops, policy)
    per_mixer = _mixer_bytes(config, set(stores.values()), dtype)
    return sum(per_mixer[m][1] for m in stores.values()) * batch
