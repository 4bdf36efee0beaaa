#!/usr/bin/env bash
# One short GPU job (for the `device` tool, or any machine with CUDA): the real engine on the GPU against the
# CPU reference (greedy tokens, Triton kernels), then the Triton decode kernel's memory bandwidth against the
# catalogue peak. Figures go to $OUT (or ./gpu-check). Needs torch with CUDA, triton, transformers,
# safetensors, pyyaml and pandas in `python3`; takes about 3-5 minutes on an H200.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-check}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
rc=0
timeout 240 python3 benchmarks/gpu_check.py --device cuda --csv "$out/engine.csv" 2>&1 | tee "$out/engine.log" || rc=1
timeout 240 python3 benchmarks/triton_attention.py --csv "$out/triton_bandwidth.csv" 2>&1 | tee "$out/triton.log" || rc=1
exit $rc
