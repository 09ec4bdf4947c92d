"""Tensor parallelism: TP = 2 against TP = 1 on the same host, in the same call.

    python benchmarks/tensor_parallel.py                      (CUDA host with 2 GPUs, NCCL; the recorded run)
    python benchmarks/tensor_parallel.py --cpu-smoke          (any machine: gloo, a narrow model, seconds)

For each model shape (Llama-3.1-8B, then Qwen2.5-0.5B; random bf16 weights: speed does not depend
on what the weights say) and each tensor_parallel_size, one engine runs nano-vllm's workload
(minikv/bench/throughput.py `workload`: 256 requests, prompts and outputs uniform in [100, 1024],
EOS ignored), greedy. Recorded per run:

    throughput          output tokens per second of the whole workload
    kv_blocks           the blocks the pool fitted on each rank (each rank holds 1/N of the K/V heads,
                        so the same free memory fits ~N times the tokens, plus the weights it no longer holds)
    all-reduce per step from a torch profile of a few decode steps on rank 0: the device time of the
                        all-reduce kernels (NCCL) or the gloo calls (CPU), divided by the steps

Both sizes run with the same options (eager decode, no overlapped step: tensor parallelism refuses
CUDA graphs and the overlap), so the ratio isolates the split itself. The 8B model is where TP pays
(each GPU reads half the weights per step); Qwen2.5-0.5B is where it stops paying (its matmuls take
microseconds, about what one all-reduce takes, and there are 2 per layer). Writes a JSON record with
the device and library versions (--out).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from minikv.bench import environment
from minikv.bench.throughput import (
    LLAMA31_8B_SHAPE,
    QWEN25_05B_SHAPE,
    SMALL_SHAPE,
    make_random_checkpoint,
    release,
    workload,
)

SHAPES = {"llama-3.1-8b": LLAMA31_8B_SHAPE, "qwen2.5-0.5b": QWEN25_05B_SHAPE, "small": SMALL_SHAPE}


class StepCounter:
    """Counts the engine's steps (an observer)."""

    def __init__(self):
        self.steps = 0

    def on_step(self, llm, batch, events):
        self.steps += 1


def allreduce_per_step(llm, requests, device: str) -> dict:
    """Profile a few decode-heavy steps on rank 0: all-reduce time per step (device time of the NCCL
    kernels on a GPU, CPU time of the gloo calls on a CPU) and its share of the step."""
    from torch.profiler import ProfilerActivity, profile

    from minikv import SamplingParams

    counter = StepCounter()
    remove = llm.add_observer(counter)
    prompts = [p[:64] for p, _ in requests]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))  # warm
    counter.steps = 0
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        llm.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
        if device == "cuda":
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    remove()
    total = 0.0
    for e in prof.key_averages():
        name = e.key.lower()
        if device == "cuda" and "nccl" in name and "allreduce" in name.replace("_", ""):
            total += e.self_device_time_total
        elif device != "cuda" and ("allreduce" in name.replace("_", "")) and "c10d" in name:
            total += e.cpu_time_total
    steps = max(counter.steps, 1)
    return {"steps": counter.steps, "allreduce_us_per_step": total / steps,
            "step_ms": 1000 * wall / steps, "allreduce_share": (total / 1e6) / wall if wall else None}


def run(ckpt: Path, tp: int, requests, device: str, dtype: torch.dtype, options: dict) -> dict:
    from minikv import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(str(ckpt), device=device, dtype=dtype, kv_backend="paged", tensor_parallel_size=tp,
              cuda_graphs=False, async_scheduling=False, **options)
    start_s = time.perf_counter() - t0
    try:
        stats = llm.stats()
        ranks = stats["tensor_parallel"]["ranks"] if tp > 1 else [{"rank": 0, "num_blocks": stats["num_blocks"],
                                                                   "bytes_per_token": stats["bytes_per_token"]}]
        params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for _, n in requests]
        t0 = time.perf_counter()
        outs = llm.generate([p for p, _ in requests], params)
        elapsed = time.perf_counter() - t0
        tokens = sum(len(o.token_ids) for o in outs)
        out = {"tp": tp, "start_s": start_s, "elapsed_s": elapsed, "output_tokens": tokens,
               "throughput_tok_s": tokens / elapsed, "kv_blocks": [r["num_blocks"] for r in ranks],
               "kv_bytes_per_token": [r["bytes_per_token"] for r in ranks],
               "block_size": stats["block_size"], "max_num_seqs": stats["config"]["max_num_seqs"],
               "num_preemptions": llm.stats()["num_preemptions"]}
        out.update(allreduce_per_step(llm, requests[:32], device) if tp > 1 else {})
        return out
    finally:
        llm.close()
        del llm
        release(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="gloo on the CPU, a narrow model, a short workload")
    ap.add_argument("--shapes", default="llama-3.1-8b,qwen2.5-0.5b", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--sizes", default="1,2", help="tensor_parallel_size values, each run in turn")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--out", default=None, help="JSON record (default: benchmarks/tensor_parallel_<device>.json)")
    args = ap.parse_args()
    if args.cpu_smoke:
        device, dtype, shapes = "cpu", torch.float32, ["small"]
        requests = workload(num_requests=min(args.num_requests, 8), min_len=8, max_len=32)
        options = dict(num_blocks=256, max_model_len=128)
    else:
        if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
            raise SystemExit("this benchmark needs a CUDA host with 2 GPUs; use --cpu-smoke elsewhere")
        device, dtype, shapes = "cuda", torch.bfloat16, args.shapes.split(",")
        requests, options = workload(num_requests=args.num_requests), {}
    sizes = [int(s) for s in args.sizes.split(",")]
    record = {"benchmark": "tensor_parallel", "env": environment(device), "workload": {
        "requests": len(requests), "prompt_tokens": sum(len(p) for p, _ in requests),
        "output_tokens": sum(n for _, n in requests)}, "runs": {}}
    out = Path(args.out) if args.out else Path(__file__).parent / f"tensor_parallel_{device}.json"
    for shape in shapes:
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = make_random_checkpoint(SHAPES[shape], Path(tmp) / shape, dtype=dtype, device=device)
            release(device)
            runs = [run(ckpt, tp, requests, device, dtype, options) for tp in sizes]
        record["runs"][shape] = runs
        base = runs[0]["throughput_tok_s"]
        print(f"\n{shape} ({record['env']['device']}, {dtype}, {len(requests)} requests)")
        print(f"{'TP':>3} {'tok/s':>9} {'vs TP=1':>8} {'KV blocks/rank':>15} {'KV B/token/rank':>16} "
              f"{'all-reduce us/step':>19} {'step ms':>8}")
        for r in runs:
            print(f"{r['tp']:>3} {r['throughput_tok_s']:>9,.0f} {r['throughput_tok_s'] / base:>7.2f}x "
                  f"{r['kv_blocks'][0]:>15,} {r['kv_bytes_per_token'][0]:>16,} "
                  f"{r.get('allreduce_us_per_step', 0):>19,.0f} {r.get('step_ms', 0):>8.1f}")
        out.write_text(json.dumps(record, indent=1) + "\n")  # after each shape: a run cut short keeps what it did
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
