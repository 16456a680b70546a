#!/usr/bin/env bash
# Set up (if needed), lint, and run the whole test suite, real-vLLM tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
# The slowest tests are listed, so a suite that grows past its budget says where.
.venv/bin/python -m pytest -q --durations=20 "$@"
