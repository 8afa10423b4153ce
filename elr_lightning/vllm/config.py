"""What vLLM serves of an ``elr export`` folder: the cache policy, the loop budget, the default k, refusals.

Chosen at load from the folder's ``config.json``, overridable with vLLM's ``--hf-overrides``:

* ``elr_kv_cache``: ``"per_loop"`` (default; one KV store per loop and recurrent layer, exact under
  vLLM's chunked prefill and preemption) or ``"last_loop"`` (one store per recurrent layer, the KV
  memory of k = 1; prompts are then prefilled whole, see :class:`ELRVerifyConfig`).
* ``elr_max_serve_loops``: the budget B, the largest k a request may ask (default 2K, twice the
  trained ``max_loops``). Under ``per_loop`` vLLM keeps ``n_in + B n_rec + n_out`` KV stores per token,
  what ``elr cost`` counts at k = B; under ``last_loop``, ``n_in + n_rec + n_out`` whatever B.
* ``default_loops``: k of requests that give none (the folder's own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: The cache policies the plugin serves.
POLICIES = ("per_loop", "last_loop")


class ELRServeError(ValueError):
    """An export folder, or a setting, the plugin cannot serve; the message is one line naming the fix."""


@dataclass(frozen=True)
class ServedELR:
    """The served shape of one export.

    Attributes:
        policy: One of :data:`POLICIES`.
        budget: B, the largest k served.
        default_loops: k of requests without ``vllm_xargs.loops``.
        n_in: Input layers.
        n_rec: Recurrent layers.
    """

    policy: str
    budget: int
    default_loops: int
    n_in: int
    n_rec: int

    @property
    def last_loop(self) -> bool:
        """Whether every loop shares one KV store per recurrent layer."""
        return self.policy == "last_loop"

    @property
    def rec_stores(self) -> int:
        """KV stores per recurrent layer: B under ``per_loop``, 1 under ``last_loop``."""
        return 1 if self.last_loop else self.budget

    def rec_slots(self, layer: int) -> list[int]:
        """The cache slots of recurrent layer ``layer``, one per store (loop order)."""
        return [self.n_in + i * self.n_rec + layer for i in range(self.rec_stores)]

    def rec_call(self, loop: int) -> int:
        """Which store of a recurrent layer loop ``loop`` (1-based) writes and reads."""
        return 0 if self.last_loop else loop - 1

    def out_slot(self, layer: int) -> int:
        """The cache slot of output layer ``layer``."""
        return self.n_in + self.rec_stores * self.n_rec + layer


def served_elr(config: Any) -> ServedELR:
    """The :class:`ServedELR` of an ``ELRConfig``; raises :class:`ELRServeError` on what cannot be served."""
    model_type = getattr(config, "model_type", None)
    if model_type != "elr":
        raise ELRServeError(
            f"elr_lightning's vLLM plugin serves `elr export` folders (model_type 'elr'), not model_type "
            f"{model_type!r}; serve this folder without forcing architectures=['ELRForCausalLM']"
        )
    mixers = [config.layer_mixers(i) for i in range(config.n_in + config.n_rec + config.n_out)]
    if any(token["type"] != "attention" for token, _ in mixers):
        raise ELRServeError(
            "this export has Gated DeltaProduct (hybrid) layers, which the vLLM plugin does not serve yet: their "
            "recurrent state per loop needs vLLM's Mamba-style state cache; serve it with `elr serve`"
        )
    if any(channel["type"] != "swiglu" for _, channel in mixers):
        raise ELRServeError(
            "this export has mixture-of-experts layers, which the vLLM plugin does not serve yet: ELR's route replay "
            "(loop 1's routes reused at every loop) has no counterpart in vLLM's fused MoE; serve it with `elr serve`"
        )
    policy = getattr(config, "elr_kv_cache", "per_loop")
    if policy not in POLICIES:
        raise ELRServeError(f"elr_kv_cache={policy!r} must be one of {list(POLICIES)} (--hf-overrides)")
    budget = getattr(config, "elr_max_serve_loops", None)
    budget = max(2 * config.max_loops, config.default_loops) if budget is None else budget
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ELRServeError(f"elr_max_serve_loops={budget!r} must be an integer >= 1 (--hf-overrides)")
    if not 1 <= config.default_loops <= budget:
        raise ELRServeError(
            f"default_loops={config.default_loops} must lie in 1..elr_max_serve_loops={budget} (--hf-overrides)"
        )
    return ServedELR(policy, budget, config.default_loops, config.n_in, config.n_rec)


def kv_bytes_per_token(config: Any, served: ServedELR, dtype_bytes: int) -> int:
    """Bytes of KV cache per token the served model keeps (keys and values of every store), as ``elr cost``."""
    stores = config.n_in + served.rec_stores * config.n_rec + config.n_out
    return stores * 2 * config.n_kv_heads * config.head_dim * dtype_bytes
