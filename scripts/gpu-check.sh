#!/usr/bin/env bash
# GPU readiness check, for a machine with NVIDIA GPUs (run from the repository root):
#   1. installs eldr with the GPU extra into .venv (the newest `vllm`: 0.33.0 today, whose
#      wheel passed eldr's static check but no real run, so eldr warns at start; these
#      steps are that run: once they pass, add its minor to RUN_MINORS in stages/vllm_compat.py)
#      and checks the installed sources for every vLLM touchpoint eldr relies on;
#   2. the recorder's per-step path on the GPU under torch.cuda.set_sync_debug_mode("error"):
#      no host sync, and the same counts as on CPU;
#   3. the real-vLLM capture and architecture tests in vLLM's default mode, which on a GPU is
#      torch.compile plus CUDA-graph replay: recorded expert ids must agree with the Hugging
#      Face router (>= 0.98, near-ties aside), prefix-cache hits must equal cold runs, and
#      (with two GPUs) a TP=2 engine must record what TP=1 records;
#   4. vLLM keeps async scheduling on with eldr's connector; with two GPUs, pipeline parallel
#      (PP=2) records every MoE layer, merged in layer order, and expert parallel over two TP
#      ranks records logical ids, each equal to one GPU's engine; data parallel and dual-batch
#      overlap are refused at start, by name;
#   5. measures engine throughput with and without eldr's recording, side by side.
# Prints everything; exits non-zero if a check fails. Meant to take under 10 minutes on one
# H200 (not yet run: no GPU was lent); with one GPU, step 3's TP case and step 4's PP, DP and
# DBO cases are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v nvidia-smi >/dev/null || { echo "gpu-check: no nvidia-smi on this machine" >&2; exit 2; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
bash scripts/setup.sh
PY=.venv/bin/python
GPUS=$($PY -c "import torch; print(torch.cuda.device_count())")
# vLLM 0.33's torch 2.14 wheels are built for CUDA 13: an older driver shows no device.
[ "$GPUS" -ge 1 ] || {
  echo "gpu-check: torch sees no GPU (its CUDA 13 wheels need an NVIDIA driver >= 580)" >&2
  exit 2
}
$PY -c "import torch, vllm; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'vllm', vllm.__version__, 'devices', torch.cuda.device_count(), torch.cuda.get_device_name(0))"
echo "== 1. every vLLM touchpoint eldr relies on, in the installed sources"
$PY -m stages.vllm_static_check --installed

echo "== 2. recorder per-step path: no host sync, counts equal CPU's"
$PY -m pytest -q -x tests/test_recorder_device_path.py

echo "== 3. capture in the default mode (CUDA graphs), against transformers"
if [ "$GPUS" -ge 2 ]; then
  $PY -m pytest -q -x tests/test_capture_real.py tests/test_architectures_real.py
else
  $PY -m pytest -q -x tests/test_capture_real.py tests/test_architectures_real.py \
    -k "not tp2 and not tensor_parallel"
fi

echo "== 4. async scheduling stays on with eldr's connector; with two GPUs, pipeline parallel"
echo "   records every layer, data parallel and DBO are refused by name (else skipped)"
$PY -m pytest -q -x -rs tests/test_parallel_layouts_real.py

echo "== 5. throughput with and without eldr, side by side"
$PY examples/bench_capture_overhead.py --model tiny --rounds 4 --batch 64 --max-tokens 128
