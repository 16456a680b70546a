#!/usr/bin/env bash
# GPU readiness check, for a machine with an NVIDIA GPU (run from the repository root):
#   1. installs eldr with the GPU extra (vllm==0.32.0) into .venv;
#   2. runs the real-vLLM capture and architecture tests in vLLM's default mode there, which
#      on a GPU is torch.compile plus CUDA graphs: recorded expert ids must agree with the
#      Hugging Face router (>= 0.98, near-ties aside), prefix-cache hits must equal cold runs;
#   3. measures engine throughput with and without eldr's recording, side by side.
# Prints everything; exits non-zero if a check fails. About 10 minutes on one GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v nvidia-smi >/dev/null || { echo "gpu-check: no nvidia-smi on this machine" >&2; exit 2; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
bash scripts/setup.sh
.venv/bin/python -c "import torch, vllm; print('torch', torch.__version__, 'cuda',
torch.version.cuda, 'vllm', vllm.__version__, 'device', torch.cuda.get_device_name(0))"
.venv/bin/python -m pytest -q -x tests/test_capture_real.py tests/test_architectures_real.py
.venv/bin/python examples/bench_capture_overhead.py --model tiny --rounds 4 --batch 64 \
  --max-tokens 128
