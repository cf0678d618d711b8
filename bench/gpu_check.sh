#!/usr/bin/env bash
# The GPU check of issue 12, from a fresh GPU machine in under 8 minutes; every result goes to one file.
#
#   bash bench/gpu_check.sh                 results in $OUT/gpu_check.txt (OUT defaults to ./gpu-check-out)
#   SKIP_INSTALL=1 PYTHON=.venv/bin/python bash bench/gpu_check.sh     use an environment that is already set up
#
# Steps: install with the gpu extra into .venv-gpu (onnxruntime-gpu replaces onnxruntime: both own the same module),
# then every kernel against its twin on CUDA in fp32/fp16/bf16 with timings (bench/gpu_kernels.py), the NVML
# backend sampled for real (bench/gpu_nvml.py), the TensorRT engine built, cached and reused
# (bench/gpu_tensorrt.py), greedy tokens through kernels and CUDA graphs vs the torch path and HF, decode tokens/s
# and decode attention bandwidth (bench/gpu_decode.py). Each step has a time limit; the exit status is 1 if any
# line says FAIL. On a machine without a GPU each Python step prints SKIP.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-check-out}"
mkdir -p "$OUT"
RESULT="$OUT/gpu_check.txt"
BUDGET_S="${BUDGET_S:-480}"
START=$(date +%s)
unset TRITON_INTERPRET  # compiled kernels, not the interpreter
: >"$RESULT"

log() { echo "$*" | tee -a "$RESULT"; }
elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( BUDGET_S - $(elapsed) )); }
step() {  # step LIMIT_S COMMAND...: run with a time limit (capped by what is left), log its output and status
    local limit=$1; shift
    local cap; cap=$(left)
    if (( cap < 15 )); then log "SKIP $*: the ${BUDGET_S} s budget is spent"; return 0; fi
    (( limit > cap )) && limit=$cap
    log "\$ $* (limit ${limit} s, at $(elapsed) s)"
    timeout "$limit" "$@" 2>&1 | tee -a "$RESULT"
    local rc=${PIPESTATUS[0]}
    (( rc == 124 )) && log "FAIL $*: timed out after ${limit} s"
    log "exit $rc at $(elapsed) s"
}

log "gpu_check at $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu --format=csv 2>&1 | tee -a "$RESULT"
else
    log "nvidia-smi: not found"
fi

if [[ "${SKIP_INSTALL:-0}" != 1 ]]; then
    BASE_PY="${PYTHON:-python3.11}"
    command -v "$BASE_PY" >/dev/null || BASE_PY=python3
    step 60 "$BASE_PY" -m venv .venv-gpu
    step 300 .venv-gpu/bin/pip install -q -e '.[test,gpu]'
    step 30 .venv-gpu/bin/pip uninstall -q -y onnxruntime
    step 120 .venv-gpu/bin/pip install -q --force-reinstall --no-deps onnxruntime-gpu==1.31.1
    PY=.venv-gpu/bin/python
    if ! "$PY" -c "import torch, triton" >/dev/null 2>&1; then  # offline box: no index to install from
        PY="${PYTHON:-python3}"
        log "the gpu install did not complete (no package index?); going on with $PY as it is"
    fi
else
    PY="${PYTHON:-python3}"
fi
step 60 "$PY" -c "import torch, triton, onnxruntime as ort; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'devices', torch.cuda.device_count()); print('triton', triton.__version__); print('onnxruntime', ort.__version__, \
ort.get_available_providers())"

step 120 "$PY" bench/gpu_kernels.py
step 30 "$PY" bench/gpu_nvml.py
step 150 "$PY" bench/gpu_tensorrt.py --cache-dir "$OUT/trt-cache"
if (( $(left) > 200 )); then
    step 240 "$PY" bench/gpu_decode.py
else
    step 200 "$PY" bench/gpu_decode.py --quick
fi

passes=$(grep -c '^PASS' "$RESULT")
fails=$(grep -c '^FAIL' "$RESULT")
log "summary: ${passes} PASS, ${fails} FAIL, $(elapsed) s; results in $RESULT"
(( fails == 0 ))
