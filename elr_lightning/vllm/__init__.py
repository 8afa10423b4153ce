"""Serve ``elr export`` folders on vLLM: ``pip install "elr-lightning[vllm]"``, then ``vllm serve EXPORT_DIR``.

The ``vllm.general_plugins`` entry point ``elr = elr_lightning.vllm:register`` runs :func:`register`
in every vLLM process: it registers the export's config class with ``transformers`` (model type
``elr``), the architecture ``ELRForCausalLM`` with vLLM's model registry (a lazy ``module:Class``
string, so nothing is imported before vLLM asks), the load-time checks of
:class:`ELRVerifyConfig`, and the k-per-request hooks of :mod:`elr_lightning.vllm.loops`. No
``--trust-remote-code``: the folder's own Python files are never read.
"""

from __future__ import annotations

import logging
from typing import Any

#: The architecture name ``elr export`` writes in ``config.json``.
ARCHITECTURE = "ELRForCausalLM"

#: Under vLLM's logger, so its handlers print it.
log = logging.getLogger("vllm.elr_lightning")


class ELRVerifyConfig:
    """vLLM's per-architecture config hook (``MODELS_CONFIG_MAP``): refuse what cannot be served, fit the rest.

    * A folder the plugin cannot serve (another model type, hybrid or MoE layers, bad overrides) is
      refused here, at ``vllm serve`` / ``LLM(...)`` start, in one line.
    * Prefix caching is turned off: a cached block holds the keys and values of the k that wrote it,
      and a request at another k must not reuse them.
    * Eager mode (no CUDA graphs, no ``torch.compile``): each step chooses how many loops to run from
      its requests' k, which a captured graph would freeze at the capture's k.
    * Under ``last_loop``, chunked prefill is turned off (and ``max_num_batched_tokens`` raised to the
      context length): a prompt's tokens must meet at every loop in one pass, as ``elr generate``
      prefills them; a chunk would see the earlier chunks' last-loop keys only.
    """

    @staticmethod
    def verify_and_update_config(vllm_config: Any) -> None:
        """Check the export and adjust vLLM's cache and scheduler settings (see the class docstring)."""
        from elr_lightning.vllm.config import kv_bytes_per_token, served_elr

        model_config = vllm_config.model_config
        served = served_elr(model_config.hf_config)
        cache, scheduler = vllm_config.cache_config, vllm_config.scheduler_config
        if cache.enable_prefix_caching:
            log.info("elr_lightning: prefix caching off (a cached block belongs to the k that computed it)")
            cache.enable_prefix_caching = False
        if not model_config.enforce_eager:
            log.info("elr_lightning: eager mode (each step picks its loops in Python; a captured graph would fix them)")
            model_config.enforce_eager = True
        if served.last_loop and scheduler.enable_chunked_prefill:
            log.info("elr_lightning: last_loop cache: chunked prefill off, prompts prefill in one pass")
            scheduler.enable_chunked_prefill = False
            scheduler.max_num_batched_tokens = max(scheduler.max_num_batched_tokens, model_config.max_model_len)
        per_token = kv_bytes_per_token(model_config.hf_config, served, model_config.dtype.itemsize)
        log.info(
            "elr_lightning: %s cache, k in 1..%d (default %d): %d KV bytes per token",
            served.policy, served.budget, served.default_loops, per_token,
        )  # fmt: skip

    @staticmethod
    def verify_and_update_model_config(model_config: Any) -> None:
        """Nothing to change in the model config itself."""


def register() -> None:
    """The ``vllm.general_plugins`` entry point (see the module docstring)."""
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from elr_lightning.hf.configuration_elr import ELRConfig
    from elr_lightning.vllm.loops import install

    try:
        AutoConfig.register("elr", ELRConfig)
    except ValueError:  # registered already (a second call in one process)
        pass
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "elr_lightning.vllm.model:ELRForCausalLM")
    MODELS_CONFIG_MAP[ARCHITECTURE] = ELRVerifyConfig
    install()
