#!/usr/bin/env bash
# All GPU checks in one go, for a lent GPU machine (torch, wrapt, packaging installed;
# no vLLM, no network). Writes results under $OUT (or ./gpu-results).
#   bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-results}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
} > "$OUT/device.txt" 2>&1
python -m pip install -q pytest 2>/dev/null || true
timeout 300 python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py \
  --junitxml="$OUT/gpu-junit.xml" > "$OUT/gpu-tests.txt" 2>&1
echo "gpu tests exit: $?" >> "$OUT/gpu-tests.txt"
timeout 240 python benchmarks/bench_scatter.py --device cuda --no-vllm --full --reps 50 \
  > "$OUT/bench-scatter-cuda.txt" 2>&1
echo "bench exit: $?" >> "$OUT/bench-scatter-cuda.txt"
tail -3 "$OUT/gpu-tests.txt" "$OUT/bench-scatter-cuda.txt"
