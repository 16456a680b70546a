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
# The real-vLLM tests run in one process, so each engine starts once for the whole run and at
# most four run at a time. Most of their time one core waits (an engine compiles on one core),
# so the tests without vLLM run beside them, in a process of their own; their report follows.
fast_log=$(mktemp)
.venv/bin/python -m pytest -q --durations=10 -m "not vllm" -p no:cacheprovider \
    >"$fast_log" 2>&1 &
fast=$!
trap 'kill "$fast" 2>/dev/null || true' EXIT
vllm_rc=0
.venv/bin/python -m pytest -q --durations=20 -m vllm || vllm_rc=$?
fast_rc=0
wait "$fast" || fast_rc=$?
echo "--- tests without vLLM (run beside the above) ---"
cat "$fast_log"
rm -f "$fast_log"
[ "$vllm_rc" -eq 0 ] && [ "$fast_rc" -eq 0 ]
