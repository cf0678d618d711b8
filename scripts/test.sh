#!/usr/bin/env bash
# Sets everything up and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
bash scripts/setup-system.sh
# two processes, each taking whole test files (a file's module fixtures, a served appliance, stay in one process);
# TEST_PROCESSES=0 runs the suite in this process alone
exec .venv/bin/python -m pytest -n "${TEST_PROCESSES:-2}" --dist loadfile "$@"
