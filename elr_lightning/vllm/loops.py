"""k per request in vLLM 0.32: from ``vllm_xargs`` to the model's forward, and the 400s of bad values.

A request asks k as ``vllm_xargs: {"loops": k}`` (the ``openai`` client:
``extra_body={"vllm_xargs": {"loops": 3}}``; ``vllm.LLM``: ``SamplingParams(extra_args={"loops": 3})``),
which vLLM puts in ``SamplingParams.extra_args``. vLLM's model forward sees token ids and positions
only; the plugin adds two small hooks to vLLM's classes (installed by :func:`install`, in every
vLLM process, by the ``vllm.general_plugins`` entry point):

* **admission** (:func:`check_request_loops` around ``InputProcessor._validate_params``): an ELR
  model's request whose k is not an integer in 1..B is refused before it is queued, as vLLM refuses
  its own bad sampling parameters: an HTTP 400 whose message names ``vllm_xargs.loops``;
* **the runner** (around the V1 runner's ``GPUModelRunner._init_model_kwargs``, which
  ``CPUModelRunner`` inherits): for a model that declares ``elr_loops_per_token``, the extra model
  keyword ``loops``, each scheduled token's request's k, in the batch's order
  (``query_start_loc``). This is the method through which vLLM already passes per-request model
  inputs (``token_type_ids``, ``lookback_token_ids``); other models are untouched.

Where vLLM runs its Model Runner V2 (the default of CUDA builds with Triton), the model's
``get_model_state_cls`` returns :func:`elr_model_state`'s class instead, which passes the same ``loops``.

docs/lab-vllm.md records the channels tried.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import numpy as np
import torch

from elr_lightning.vllm.config import served_elr

#: The key of ``vllm_xargs`` / ``SamplingParams.extra_args`` that carries k.
LOOPS_KEY = "loops"
#: The field a refused k is reported under.
LOOPS_FIELD = "vllm_xargs.loops"


def request_loops(extra_args: Optional[dict], default: int, budget: int) -> int:
    """The k a request asks (``default`` when it asks none).

    Raises:
        ValueError: k is not an integer in 1..``budget``; the message names ``vllm_xargs.loops``.
    """
    loops = (extra_args or {}).get(LOOPS_KEY, default)
    if loops == "auto":
        raise ValueError(
            f"{LOOPS_FIELD}='auto' (adaptive depth) is not served through vLLM; ask an integer k in 1..{budget}, "
            "or use `elr serve` for loops='auto'"
        )
    if isinstance(loops, bool) or not isinstance(loops, int):
        raise ValueError(f"{LOOPS_FIELD}={loops!r} must be an integer k in 1..{budget}")
    if not 1 <= loops <= budget:
        raise ValueError(
            f"{LOOPS_FIELD}={loops} is out of range; this server serves k in 1..{budget} "
            "(raise the budget with --hf-overrides '{\"elr_max_serve_loops\": N}')"
        )
    return loops


def check_request_loops(model_config: Any, params: Any) -> None:
    """Refuse an ELR request's bad k with vLLM's validation error (an HTTP 400 naming the field)."""
    hf_config = getattr(model_config, "hf_config", None)
    if getattr(hf_config, "model_type", None) != "elr" or not hasattr(params, "extra_args"):
        return
    from vllm.exceptions import VLLMValidationError

    served = served_elr(hf_config)
    try:
        request_loops(params.extra_args, served.default_loops, served.budget)
    except ValueError as err:
        raise VLLMValidationError(str(err), parameter=LOOPS_FIELD, value=(params.extra_args or {}).get(LOOPS_KEY)) from err


def token_loops(runner: Any, num_reqs: int) -> Optional[torch.Tensor]:
    """Each scheduled token's k ``[num_tokens]``, in the batch's order, or ``None`` for an empty batch."""
    if num_reqs <= 0:
        return None
    served = served_elr(runner.model_config.hf_config)
    ks = np.empty(num_reqs, dtype=np.int64)
    for row, req_id in enumerate(runner.input_batch.req_ids[:num_reqs]):
        params = runner.requests[req_id].sampling_params
        extra = None if params is None else params.extra_args
        ks[row] = request_loops(extra, served.default_loops, served.budget)
    return torch.from_numpy(np.repeat(ks, np.diff(runner.query_start_loc.np[: num_reqs + 1]))).to(runner.device)


def elr_model_state() -> type:
    """Model Runner V2's ``ModelState`` for ELR models: the same ``loops`` keyword, from per-slot k.

    vLLM 0.32 runs V2 by default where Triton runs (CUDA builds), and asks the model for its state class
    (``get_model_state_cls``); V2 never calls the V1 runner's ``_init_model_kwargs``. The class keeps each
    request slot's k (set by ``add_request`` from the request's ``extra_args``) and adds each scheduled
    token's k to the model inputs in ``prepare_inputs``, as ``diffusion_gemma.py`` keeps its per-slot
    step caps. Imported only when V2 asks: V2's modules need Triton.
    """
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    class ELRModelState(DefaultModelState):
        """``DefaultModelState`` plus each request slot's loop count k."""

        def __init__(self, vllm_config: Any, model: Any, encoder_cache: Any, device: torch.device) -> None:
            super().__init__(vllm_config, model, encoder_cache, device)
            self.served = served_elr(self.model_config.hf_config)
            self.slot_loops = np.full(self.max_num_reqs, self.served.default_loops, dtype=np.int64)

        def add_request(self, req_index: int, new_req_data: Any) -> None:
            """Record the new request's k in its slot."""
            super().add_request(req_index, new_req_data)
            params = new_req_data.sampling_params
            extra = None if params is None else params.extra_args
            self.slot_loops[req_index] = request_loops(extra, self.served.default_loops, self.served.budget)

        def prepare_inputs(self, input_batch: Any, req_states: Any) -> dict[str, Any]:
            """The default inputs plus ``loops``: each scheduled token's request's k, in batch order."""
            inputs = super().prepare_inputs(input_batch, req_states)
            ks = self.slot_loops[input_batch.idx_mapping_np[: input_batch.num_reqs]]
            counts = input_batch.num_scheduled_tokens[: input_batch.num_reqs]
            inputs["loops"] = torch.from_numpy(np.repeat(ks, counts)).to(self.device)
            return inputs

    return ELRModelState


def _with_loops(original):
    @functools.wraps(original)
    def init_model_kwargs(self, num_reqs: Optional[int] = None) -> dict[str, Any]:
        kwargs = original(self, num_reqs)
        if getattr(self.get_model(), "elr_loops_per_token", False):  # get_model: the model, unwrapped
            loops = token_loops(self, self.input_batch.num_reqs if num_reqs is None else num_reqs)
            if loops is not None:
                kwargs["loops"] = loops
        return kwargs

    init_model_kwargs.elr_hook = True
    return init_model_kwargs


def _with_loop_check(original):
    @functools.wraps(original)
    def validate_params(self, params: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, params, *args, **kwargs)
        check_request_loops(self.model_config, params)
        return result

    validate_params.elr_hook = True
    return validate_params


def install() -> None:
    """Wrap the V1 runner's ``_init_model_kwargs`` and the input processor's ``_validate_params`` (once)."""
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if not getattr(GPUModelRunner._init_model_kwargs, "elr_hook", False):
        GPUModelRunner._init_model_kwargs = _with_loops(GPUModelRunner._init_model_kwargs)
    if not getattr(InputProcessor._validate_params, "elr_hook", False):
        InputProcessor._validate_params = _with_loop_check(InputProcessor._validate_params)
