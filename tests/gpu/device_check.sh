#!/usr/bin/env bash
# The prepared device check: one command on one GPU machine (Python 3.12, torch+CUDA, nvcc,
# ninja, nanobind, scikit-build-core, msgpack, xxhash, numpy, pytest; no network). Carry the
# payload that `make gpu-wheels` packs (.gpu-payload/, 24 MiB; with the tree 27 of the 64 MiB a
# call carries):
#     run(command="bash tests/gpu/device_check.sh", carry=[".gpu-payload"], timeout_s=560)
#
# Steps, in this order; none stops another (no `set -e`): a failed step is reported and the
# next one runs. Each step's limit is cut to what is left of the whole check's deadline.
#   install  unpack the payload; pip install --no-index --no-deps --target $SITE; import
#            flashinfer, tvm_ffi and zmq from there (one JSON line: versions and paths)
#   build    the C++ extension (pip install -e .)
#   jit      FlashInfer's JIT modules, all at once, one process each, FA2 (tests/gpu/jit_warmup.py)
#   bench    the decode-layer benchmark at 1k and 2k context, 1, 2 and 4 holders, batch 1, 8
#            and 64 (tests/gpu/decode_layer_bench.py: 18 JSON lines)
#   tests    the GPU tests (pytest -m gpu)
# Output: $OUT/steps.jsonl gets every JSON line a step prints, as it prints it, then one line
# per step ({"step", "rc", "seconds", "limit_s", "timed_out", "last_line"}), so a run killed
# at any point still returns what it measured; $OUT/check.log has everything. Without $OUT
# (not on the device) they go to results/device-check/.
#
# Estimate on an H100 (16 cores), not run on a GPU: install ~25 s (24 MiB xz -> 430 MiB of
# wheels, pip --target), build ~60 s (cmake + nanobind, 16 jobs), jit ~60 s (6 modules at
# once: FA2 prefill ~17 CPU-s a file, CUDA-core decode ~8, the merge module ~5), bench ~30 s
# (CUDA start; 18 cases, each 50 timed iterations a side and one profiled call), tests ~150 s
# (the modules they need are built; the data-plane tests start processes) = ~5.5 min; the
# deadline (DEADLINE_S, 480 s) caps the worst case at 8 min, inside one 10-minute call.
#
# Variables: PYTHON (python3), OUT, SITE (/tmp/tokenlake-gpu-site), PAYLOAD, STEPS (the steps
# to run, default all), DEADLINE_S, BENCH_ARGS (the benchmark's sizes; the CPU rehearsal uses
# small ones). --dry-run prints the steps and runs nothing.
set -uo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python3}"
OUT="${OUT:-results/device-check}"
SITE="${SITE:-/tmp/tokenlake-gpu-site}"
PAYLOAD="${PAYLOAD:-.gpu-payload/gpu-payload.tar.xz}"
STEPS="${STEPS:-install build jit bench tests}"
DEADLINE_S="${DEADLINE_S:-480}"
BENCH_ARGS="${BENCH_ARGS:---context 1024 2048 --batch 1 8 64 --holders 1 2 4}"
GPU_TESTS="tests/engines/test_gpu_path.py tests/engines/test_flashinfer_calls.py tests/engines/test_doorbells.py tests/engines/kernels/test_empty_states.py tests/gpu"
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
mkdir -p "$OUT"
JSONL="$OUT/steps.jsonl"
LOG="$OUT/check.log"
START=$SECONDS
if [[ -d "$SITE" ]]; then export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"; fi
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-16}"

step() {  # step NAME LIMIT_S COMMAND: run it (bounded), keep its JSON lines, add its own line
    local name=$1 limit=$2 cmd=$3
    [[ " $STEPS " == *" $name "* ]] || return 0
    if [[ $DRY -eq 1 ]]; then echo "+ $name: $cmd"; return 0; fi
    local left=$((DEADLINE_S - (SECONDS - START)))
    ((limit > left)) && limit=$left
    if ((limit < 5)); then
        printf '{"step": "%s", "rc": null, "note": "skipped: the deadline has passed"}\n' \
            "$name" | tee -a "$JSONL"
        return 0
    fi
    echo "=== $name (limit ${limit}s): $cmd" | tee -a "$LOG"
    local t0=$SECONDS
    # the step's JSON lines go to steps.jsonl as they are printed, tagged with the step
    timeout --kill-after=10 "$limit" bash -c "$cmd" 2>&1 | tee -a "$LOG" |
        sed -u -n "s/^{\(.\)/{\"step\": \"$name\", \1/p" | tee -a "$JSONL"
    local rc=${PIPESTATUS[0]}
    local last
    last=$(grep -v '^===' "$LOG" | tail -n 1 | cut -c1-300 | sed 's/\\/\\\\/g; s/"/\\"/g')
    local timed_out=false
    ((rc == 124 || rc == 137)) && timed_out=true
    printf '{"step": "%s", "rc": %d, "seconds": %d, "limit_s": %d, "timed_out": %s, "last_line": "%s"}\n' \
        "$name" "$rc" $((SECONDS - t0)) "$limit" "$timed_out" "$last" | tee -a "$JSONL"
    if [[ $name == install && -d "$SITE" ]]; then  # the later steps see the installed wheels
        [[ ":${PYTHONPATH:-}:" == *":$SITE:"* ]] || export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    fi
}

step install 120 "rm -rf '$SITE' '$SITE.wheels' && $PYTHON tests/gpu/gpu_payload.py unpack '$PAYLOAD' '$SITE.wheels' >/dev/null && $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target '$SITE' '$SITE.wheels'/*.whl && PYTHONPATH='$SITE' $PYTHON tests/gpu/gpu_payload.py imports '$SITE' flashinfer tvm_ffi zmq"
step build 180 "$PYTHON -m pip install -q --no-build-isolation --no-deps -e ."
step jit 150 "$PYTHON tests/gpu/jit_warmup.py"
step bench 120 "$PYTHON tests/gpu/decode_layer_bench.py $BENCH_ARGS"
step tests 300 "$PYTHON -m pytest -q -p no:cacheprovider -m gpu $GPU_TESTS"
exit 0
