"""Run greedy jobs through ``vllm.LLM`` on an export folder and write their tokens and logprobs as JSON.

``python _vllm_run.py SPEC.json OUT.json`` where SPEC holds ``model``, ``policy``, ``tp`` and ``jobs``
(``[prompt, k or null, max_tokens]``). A separate process per engine: vLLM's engine holds the
process's distributed state, and its workers are spawned, so it starts under ``__main__``.
"""

from __future__ import annotations

import json
import os
import sys


def main(spec_path: str, out_path: str) -> None:
    """Generate every job of the spec in one ``LLM.generate`` call (one batch of mixed k)."""
    from vllm import LLM, SamplingParams
    from vllm.exceptions import VLLMValidationError

    spec = json.loads(open(spec_path).read())
    extra = {} if spec["tp"] == 1 else {"tensor_parallel_size": spec["tp"]}
    if spec["tp"] == 1:
        extra["distributed_executor_backend"] = "uni"  # the worker in this process: one start, not two
    llm = LLM(
        model=spec["model"], dtype="float32", enforce_eager=True, max_model_len=128, seed=0,
        hf_overrides={"elr_kv_cache": spec["policy"]}, **extra,
    )  # fmt: skip
    params = [
        SamplingParams(
            temperature=0, max_tokens=n, logprobs=0, extra_args=None if k is None else {"loops": k}
        )
        for _, k, n in spec["jobs"]
    ]
    outs = llm.generate([p for p, _, _ in spec["jobs"]], params, use_tqdm=False)
    results = []
    for out in outs:
        c = out.outputs[0]
        results.append({"tokens": list(c.token_ids), "logprobs": [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]})
    refused = []
    for bad in spec.get("bad", []):
        try:
            llm.generate(["x"], SamplingParams(max_tokens=1, extra_args={"loops": bad}), use_tqdm=False)
            refused.append(None)
        except (ValueError, VLLMValidationError) as err:
            refused.append(str(err))
    with open(out_path, "w") as f:
        json.dump({"results": results, "refused": refused}, f)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    main(*sys.argv[1:])
