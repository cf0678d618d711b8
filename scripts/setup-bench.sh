#!/usr/bin/env bash
# Adds the benchmark-only baselines to .venv: llama-cpp-python (compiles llama.cpp with this CPU's native flags;
# several minutes on 2 cores). Never part of the test set-up or CI: llama.cpp is a baseline, not the serving path.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" .venv/bin/python -m pip install -q --no-binary llama-cpp-python \
  llama-cpp-python==0.3.36
