#!/bin/bash
# The GPU measurements of the engine-speed work in one call: GPU tests, step profiles, throughput.
#
#   bash benchmarks/speed_gpu.sh qwen  BEFORE_DIR   (tests, step profiles after / before, 0.5B throughput)
#   bash benchmarks/speed_gpu.sh llama              (Llama-3.1-8B shapes throughput)
#
# Run from this checkout's root; BEFORE_DIR is an earlier commit's tree (`git archive <commit>`),
# copied to /tmp/before with its kernels/ as minikv/kernels (what an install does), so that it
# imports as `minikv` with its own kernels. Results go to $OUT.
set -u
NEW=$(pwd)
OUT=${OUT:-/tmp/speed_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$NEW
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/card.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
  | tee -a "$OUT/card.txt"

if [ "$1" = qwen ]; then
  mkdir -p /tmp/before && cp -r "$2/minikv" /tmp/before/ && cp -r "$2/kernels" /tmp/before/minikv/kernels
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graph.py tests/test_triton_backend.py \
    tests/test_kernels.py -k "decode or cuda_graph or triton" 2>&1 | tail -4 | tee "$OUT/tests_gpu.log"
  python3 benchmarks/step_profile.py --out "$OUT" --label after 2>&1 | grep -v Warning | tail -3
  python3 benchmarks/step_profile.py --out "$OUT" --label after_split_from_bound --split-from-bound --modes greedy \
    2>&1 | tail -2
  (cd /tmp && PYTHONPATH=/tmp/before python3 "$NEW/benchmarks/step_profile.py" --out "$OUT" --label before \
    2>&1 | tail -3)
  python3 -m minikv.bench.throughput --hf-cap 60 --cap 120 --out "$OUT/throughput_qwen.json" 2>&1 | grep "^\[bench\]" \
    | cut -c1-330
  (cd /tmp && PYTHONPATH=/tmp/before python3 "$NEW/benchmarks/sampling_throughput.py" --out "$OUT" --label before \
    --num-requests 256 --cap 30 2>&1 | tail -3)
else
  python3 -m minikv.bench.throughput --shape llama-3.1-8b --hf-cap 60 --cap 120 --out "$OUT/throughput_llama8b.json" \
    2>&1 | grep "^\[bench\]" | cut -c1-330
fi
ls -la "$OUT"
