#!/usr/bin/env bash
# The prepared device check: one command on one GPU machine (Python 3.12, torch+CUDA,
# nanobind, scikit-build-core, msgpack, xxhash, numpy, scipy, pytest; no network).
#   1. install the wheels that travel with the tree (.gpu-wheels/, made by `make gpu-wheels`);
#   2. build the C++ extension;
#   3. run the GPU tests (pytest -m gpu);
#   4. run the decode-layer microbenchmark (JSON lines: TokenLake's layer vs FlashInfer's
#      paged decode, their ratio, kernels per layer). Without FlashInfer it runs the torch
#      backend and says so in its JSON.
# --dry-run prints the steps (what a CPU test checks) and runs nothing.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python3}"
WHEELS=".gpu-wheels"
GPU_WHEELS="pyzmq flashinfer-python"
GPU_TESTS="tests/engines/test_gpu_path.py tests/engines/test_flashinfer_calls.py tests/gpu"
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1

step() {  # print a step; run it unless dry
    echo "+ $*"
    if [[ $DRY -eq 0 ]]; then eval "$@"; fi
}

if [[ -d "$WHEELS" || $DRY -eq 1 ]]; then
    step "$PYTHON -m pip install -q --no-index --find-links $WHEELS $GPU_WHEELS || echo 'wheels: not all installed; the torch backend stands in for FlashInfer'"
fi
step "$PYTHON -m pip install -q --no-build-isolation --no-deps -e ."
step "timeout 300 $PYTHON -m pytest -q -m gpu $GPU_TESTS"
step "timeout 240 $PYTHON tests/gpu/decode_layer_bench.py --batch 1 8 64"
