"""One all-reduce of a step's activations between two GPUs, alone: what tensor parallelism pays per
layer before any waiting for the other rank.

    python benchmarks/allreduce_gpu.py --out benchmarks/allreduce_h100x2.json     (a host with 2 GPUs)
    python benchmarks/allreduce_gpu.py --cpu-smoke                               (gloo, two CPU processes)

Two processes, NCCL (gloo on CPUs), bf16 tensors of [tokens, hidden] for the hidden sizes of the
course's shapes (Qwen2.5-0.5B 896, Llama-3.1-8B 4,096): the median of --iters all-reduces, each
timed with CUDA events after a barrier-free warm-up, on rank 0. A decode step of B sequences
all-reduces [B, hidden] twice per layer (after attention's o projection and the MLP's down
projection), so the step pays 2 x layers x this; the record prints that product for both shapes.
The sum is checked first (every element equals world_size x its value).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPES = {"qwen2.5-0.5b": (896, 24), "llama-3.1-8b": (4096, 32)}  # hidden size, layers
TOKENS = (1, 32, 256, 2048)


def worker(rank: int, world: int, port: int, cpu: bool, iters: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cpu") if cpu else torch.device("cuda", rank)
    if not cpu:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if cpu else "nccl", rank=rank, world_size=world, device_id=None if cpu else device)
    dtype = torch.float32 if cpu else torch.bfloat16
    rows = []
    for name, (hidden, layers) in SHAPES.items():
        for tokens in TOKENS:
            x = torch.full((tokens, hidden), float(rank + 1), dtype=dtype, device=device)
            dist.all_reduce(x)
            assert torch.all(x == sum(range(1, world + 1))), "all-reduce returned a wrong sum"
            times = []
            for _ in range(iters):
                if cpu:
                    t0 = time.perf_counter()
                    dist.all_reduce(x)
                    times.append((time.perf_counter() - t0) * 1e6)
                else:
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    dist.all_reduce(x)
                    b.record()
                    b.synchronize()
                    times.append(a.elapsed_time(b) * 1e3)
            us = statistics.median(times)
            rows.append({"shape": name, "hidden": hidden, "tokens": tokens, "bytes": x.numel() * x.element_size(),
                         "allreduce_us": us, "per_decode_step_us": 2 * layers * us})
    if rank == 0:
        env = {"device": "cpu" if cpu else torch.cuda.get_device_name(0), "world_size": world,
               "torch": torch.__version__, "nccl": None if cpu else ".".join(map(str, torch.cuda.nccl.version()))}
        Path(out).write_text(json.dumps({"benchmark": "allreduce", "env": env, "iters": iters, "rows": rows},
                                        indent=1) + "\n")
        print(f"{'shape':>14} {'tokens':>7} {'bytes':>11} {'us':>9} {'x 2 x layers us':>16}")
        for r in rows:
            print(f"{r['shape']:>14} {r['tokens']:>7} {r['bytes']:>11,} {r['allreduce_us']:>9.1f} "
                  f"{r['per_decode_step_us']:>16,.0f}")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", default="benchmarks/allreduce.json")
    args = ap.parse_args()
    if not args.cpu_smoke and torch.cuda.device_count() < 2:
        raise SystemExit("this benchmark needs 2 GPUs; use --cpu-smoke elsewhere")
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(2, port, args.cpu_smoke, 20 if args.cpu_smoke else args.iters, args.out), nprocs=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
