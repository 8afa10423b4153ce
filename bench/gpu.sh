#!/usr/bin/env bash
# GPU readiness in one command, under 8 minutes on one CUDA device (see bench/gpu.py for what it prints):
#   bash bench/gpu.sh            # writes bench/results/gpu.json
#   bash bench/gpu.sh --sharding # bench/recurrent_sharding.py on up to 2 CUDA devices (one process each),
#                                # under 5 minutes; writes bench/results/recurrent_sharding_cuda.json
#   bash bench/gpu.sh --vllm     # bench/vllm.py on the GPU: vLLM (the `vllm` extra) against elr serve at 1, 8
#                                # and 32 clients, under 8 minutes; writes bench/results/vllm_cuda.json
# Refuses, with one line, where torch sees no CUDA device.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "bench/gpu.sh: no CUDA device visible to torch; run it on a machine with one GPU" >&2
    exit 2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ "${1:-}" == "--sharding" ]]; then
    shift
    # NCCL puts one process on each device: with one GPU the options run on one rank (no rank waits, no
    # collective crosses a link), which measures the per-layer units' own overhead only
    WORLD="$("$PYTHON" -c "import torch; print(min(2, torch.cuda.device_count()))")"
    exec timeout 290 "$PYTHON" bench/recurrent_sharding.py --accelerator cuda --world "$WORLD" \
        --d_model 1024 --batch 4 --seq_len 512 --out bench/results/recurrent_sharding_cuda.json "$@"
fi
if [[ "${1:-}" == "--vllm" ]]; then
    shift
    if ! "$PYTHON" -c "import vllm" 2>/dev/null; then
        echo "bench/gpu.sh --vllm: vLLM is not installed; pip install -e \".[serve,vllm]\" first" >&2
        exit 2
    fi
    exec timeout 470 "$PYTHON" bench/vllm.py --device cuda --d_model 1024 --requests 96 --max_tokens 64 \
        --out bench/results/vllm_cuda.json "$@"
fi
exec timeout 470 "$PYTHON" bench/gpu.py "$@"
