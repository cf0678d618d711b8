#!/usr/bin/env bash
# Adds the benchmark-only baseline llama.cpp (llama-cpp-python 0.3.36, compiled here: ~20 minutes on 2 cores) for
# one instruction set, into bench/.llama-cpp/ISA (not committed; bench/generate.py --isa ISA imports it from there):
#   native      -DGGML_NATIVE=ON: everything this CPU has (AVX-512, AMX where present)
#   avx2        an AVX2-only build (no AVX-512, no AVX-VNNI): what an AVX2 plant PC runs
#   avxvnni     AVX2 + AVX-VNNI (Intel Core 12th generation and later)
# The wheel is kept in build/llama-wheels/ISA (or $LLAMA_WHEEL_DIR) and reused; pip's own wheel cache is bypassed
# (it keys a wheel built from the sdist by version, not by CMAKE_ARGS: a second ISA silently got the first one's
# build). Never part of the test set-up or CI: llama.cpp is a baseline, not the serving path.
#   bash scripts/setup-bench.sh [--isa native|avx2|avxvnni]
set -euo pipefail
cd "$(dirname "$0")/.."
ISA=native
while [ $# -gt 0 ]; do
  case "$1" in
    --isa) ISA="$2"; shift 2 ;;
    --isa=*) ISA="${1#--isa=}"; shift ;;
    *) echo "usage: $0 [--isa native|avx2|avxvnni]" >&2; exit 2 ;;
  esac
done
NOT_NATIVE="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF"
case "$ISA" in
  native) ARGS="-DGGML_NATIVE=ON" ;;
  avx2) ARGS="$NOT_NATIVE -DGGML_AVX_VNNI=OFF" ;;
  avxvnni) ARGS="$NOT_NATIVE -DGGML_AVX_VNNI=ON" ;;
  *) echo "$0: --isa must be native, avx2 or avxvnni, not $ISA" >&2; exit 2 ;;
esac
PY="${PYTHON:-.venv/bin/python}"  # PYTHON: another interpreter (a worktree using a shared venv)
[ -x "$PY" ] || [ -n "${PYTHON:-}" ] || bash scripts/setup.sh
WHEELS="${LLAMA_WHEEL_DIR:-build/llama-wheels/$ISA}"
mkdir -p "$WHEELS"
if ! ls "$WHEELS"/llama_cpp_python-0.3.36-*.whl >/dev/null 2>&1; then
  CMAKE_ARGS="$ARGS" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" nice -n 19 "$PY" -m pip wheel -q --no-cache-dir \
    --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36 -w "$WHEELS"
fi
DEST=bench/.llama-cpp/$ISA
rm -rf "$DEST"
# beside it, the one import of llama_cpp's package the venv lacks (numpy, jinja2 and typing-extensions are there)
"$PY" -m pip install -q --no-deps --target "$DEST" "$WHEELS"/llama_cpp_python-0.3.36-*.whl diskcache==5.6.3
echo "llama.cpp for $ISA in $DEST"
