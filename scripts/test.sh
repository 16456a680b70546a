#!/usr/bin/env bash
# Set up (if needed), lint, and run the whole test suite, real-vLLM tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest -q "$@"
