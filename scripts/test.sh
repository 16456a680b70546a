#!/usr/bin/env bash
# Set up (if needed), lint, and run the whole test suite, real-vLLM tests included.
# With arguments, one pytest run with them (e.g. a test file).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
# The slowest tests are listed, so a suite that grows past its budget says where.
if [ $# -gt 0 ]; then
    exec .venv/bin/python -m pytest -q --durations=20 "$@"
fi
# Tests without vLLM in two processes (they share nothing); the real-vLLM tests in one, so
# each engine starts once for the whole run and at most four run at a time.
.venv/bin/python -m pytest -q --durations=10 -m "not vllm" -n 2
.venv/bin/python -m pytest -q --durations=20 -m vllm
