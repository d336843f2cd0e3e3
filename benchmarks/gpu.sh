#!/usr/bin/env bash
# For the lent GPU machine: the CUDA tests, then tmap / tsum on threads with CUDA tensors against
# the CUDA loop (trees and neural ODEs). Writes cuda-tests.txt and gpu-bench.txt into $OUT (or
# the folder given as the argument). Usage: bash benchmarks/gpu.sh [OUTPUT_DIR]
set -uo pipefail
out="${1:-${OUT:-.}}"
mkdir -p "$out"
python="${PYTHON:-python3}"
{
  date -u +%FT%TZ; uname -srm; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  "$python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
} 2>&1 | tee "$out/gpu-env.txt"
timeout 300 "$python" -m pytest -q -rs tests/test_cuda.py 2>&1 | tee "$out/cuda-tests.txt"
timeout 240 "$python" benchmarks/gpu_bench.py --reps "${REPS:-3}" --workers "${SWEEP:-1,2,4,8}" \
  2>&1 | tee "$out/gpu-bench.txt"
