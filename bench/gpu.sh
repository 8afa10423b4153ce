#!/usr/bin/env bash
# GPU readiness in one command, under 8 minutes on one CUDA device (see bench/gpu.py for what it prints):
#   bash bench/gpu.sh            # writes bench/results/gpu.json
# Refuses, with one line, where torch sees no CUDA device.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "bench/gpu.sh: no CUDA device visible to torch; run it on a machine with one GPU" >&2
    exit 2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 470 "$PYTHON" bench/gpu.py "$@"
