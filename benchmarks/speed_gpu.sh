#!/bin/bash
# The GPU measurements of the engine-speed and tiered-store work, one call per part (each well inside
# a 10-minute command). Run from this checkout's root on the GPU machine; results go to $OUT.
#
#   bash benchmarks/speed_gpu.sh step     GPU tests of the overlapped step and graphs; async scheduling
#                                         on vs off; fused kernels on vs off; step profiles (fused off / on)
#   bash benchmarks/speed_gpu.sh qwen     nano-vllm workload, Qwen2.5-0.5B shapes: greedy and sampled (3 turns),
#                                         defaults and tuned, beside transformers
#   bash benchmarks/speed_gpu.sh llama    the same workload on Llama-3.1-8B shapes
#   bash benchmarks/speed_gpu.sh sampler  the sampling kernel: tokens against the CPU path; time against
#                                         greedy and against the sampler of commit 8fdf6df (the machine
#                                         has no git: first `git show 8fdf6df:minikv/engine/sampler.py >
#                                         benchmarks/baseline_sampler.py` here, untracked, so it travels)
#   bash benchmarks/speed_gpu.sh seats    greedy against sampled, overlap off and on, one engine at 256 and
#                                         at 512 seats (the defaults' count): where sampled runs under the
#                                         defaults lose to greedy
#   bash benchmarks/speed_gpu.sh checks   the engine's tokens against transformers (torch and Triton
#                                         attention, float32 and bf16) and CUDA graphs against eager
#   bash benchmarks/speed_gpu.sh tiers    tier copy bandwidth (batched vs per block vs a raw copy) and
#                                         time to first token of returning turns
#
# Every script checks correctness before it times, and times its baseline in the same process.
set -u
NEW=$(pwd)
OUT=${OUT:-/tmp/speed_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index . >/dev/null 2>&1 || echo "pip install failed"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/card_$1.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
  | tee -a "$OUT/card_$1.txt"
cd /tmp  # the installed minikv, not the checkout
case "$1" in
  step)
    (cd "$NEW" && timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graph.py \
       tests/test_async_scheduling.py -x 2>&1 | tail -5)
    timeout 240 python3 "$NEW/benchmarks/async_scheduling_gpu.py" --out "$OUT/async_scheduling_gpu.json" 2>&1 \
      | grep -v Warning | tail -25
    timeout 60 python3 "$NEW/benchmarks/fused_ops_gpu.py" --out "$OUT/fused_ops_gpu.json" 2>&1 | tail -12
    timeout 120 python3 "$NEW/benchmarks/step_profile.py" --out "$OUT" --label fused_off --options '{"fused_ops": false}' \
      2>&1 | tail -2
    timeout 120 python3 "$NEW/benchmarks/step_profile.py" --out "$OUT" --label fused_on 2>&1 | tail -2
    ;;
  sampler)
    cp "$NEW/benchmarks/baseline_sampler.py" /tmp/baseline_sampler.py
    timeout 300 python3 "$NEW/benchmarks/sampler_gpu.py" --baseline /tmp/baseline_sampler.py \
      --out "$OUT/sampler_gpu.json" 2>&1 | grep -v Warning | tail -45
    # a decode step's profile, greedy and sampled; then sampled again with the earlier sampler put back
    # (given today's vectorized draw_keys, which the engine now imports from it)
    timeout 150 python3 "$NEW/benchmarks/step_profile.py" --out "$OUT" --label sampler_new 2>&1 | tail -2
    INSTALLED=$(python3 -c "import minikv.engine.sampler as s; print(s.__file__)")
    cp "$INSTALLED" /tmp/new_sampler.py
    python3 - "$INSTALLED" <<'PY'
import re, sys
new = open("/tmp/new_sampler.py").read()
keys = new[new.index("def _splitmix64_lanes"):new.index("_seed_hash = ")]
open(sys.argv[1], "w").write(open("/tmp/baseline_sampler.py").read() + "\nimport numpy as np\n\n\n" + keys)
PY
    timeout 120 python3 "$NEW/benchmarks/step_profile.py" --out "$OUT" --label sampler_before --modes sampled 2>&1 | tail -1
    cp /tmp/new_sampler.py "$INSTALLED"
    ;;
  seats)
    for seats in 256 512; do
      timeout 280 python3 "$NEW/benchmarks/async_scheduling_gpu.py" --max-num-seqs $seats \
        --out "$OUT/async_scheduling_gpu_seats$seats.json" 2>&1 | grep -v Warning | tail -7
    done
    ;;
  checks)
    timeout 300 python3 -m minikv.bench.throughput --num-requests 8 --sampling greedy \
      --skip triton_eager,defaults,hf_cb,hf_padded,torch 2>&1 | grep "^\[bench\] check" | cut -c1-400
    ;;
  qwen)
    timeout 580 python3 -m minikv.bench.throughput --hf-cap 45 --cap 120 --repeats 3 --out "$OUT/throughput_qwen.json" 2>&1 \
      | grep "^\[bench\]" | cut -c1-330
    ;;
  llama)
    timeout 560 python3 -m minikv.bench.throughput --shape llama-3.1-8b --hf-cap 45 --cap 150 \
      --out "$OUT/throughput_llama8b.json" 2>&1 | grep "^\[bench\]" | cut -c1-330
    ;;
  tiers)
    timeout 120 python3 "$NEW/benchmarks/tiers_bandwidth_gpu.py" --out "$OUT/tiers_bandwidth_gpu.json" 2>&1 | tail -20
    timeout 300 python3 -m minikv.bench.tiers_ttft --model random-qwen2.5-0.5b --device cuda --attention triton \
      --users 4 --turns 3 --doc-len 2048 --question-len 64 --out "$OUT/tiers_ttft_gpu.json" 2>&1 | tail -12
    ;;
esac
ls -la "$OUT"
