"""How long an engine step takes in a quiet process, by its size: is a step of a few thousand tokens
bound by the host (launches, bookkeeping) or by the device? One process, nothing else running.

    python3 benchmarks/eager_step_gpu.py --label base --out benchmarks/eager_step_gpu.json

Qwen2.5-0.5B shapes (random bf16 weights), `LLM(ckpt, max_model_len=4096)`, defaults otherwise:
- ttft_ms_N: one prompt of N random token ids, one output token; the median time to first token of the
  last 5 of 7 prompts (each a new prompt: no prefix hit).
- wall_ms_Nx1024: N prompts of 1,024 tokens at once, one output token each (one prefill step of
  N x 1,024 tokens, within the default token budget), wall time with the device synchronized before
  and after, the median of the last 5 of 6.
- build_s: building the engine (weights, pool, graph capture); the first tree built in a fresh machine
  also compiles the Triton kernels, so compare it only between runs of the same state.
A step whose wall stays flat as N grows is bound by the host; one that grows with N, by the device.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

if __name__ == "__main__":  # run as a script: minikv from this checkout, installed or not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minikv import LLM, SamplingParams  # noqa: E402
from minikv.bench import environment  # noqa: E402
from minikv.bench.throughput import QWEN25_05B_SHAPE, make_random_checkpoint  # noqa: E402


def measure(ckpt: str) -> dict:
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm = LLM(ckpt, max_model_len=4096)
    torch.cuda.synchronize()
    res = {"build_s": round(time.perf_counter() - t, 2), "alloc_gib": round(torch.cuda.memory_allocated() / 2**30, 2)}
    rng = random.Random(1)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    for n in (300, 700, 1500, 3000):
        ts = [llm.generate([[rng.randrange(100, 50000) for _ in range(n)]], [one], use_tqdm=False)[0]
              .time_to_first_token * 1e3 for _ in range(7)]
        res[f"ttft_ms_{n}"] = round(statistics.median(ts[2:]), 2)
    for N in (1, 2, 4, 8, 16):
        walls = []
        for _ in range(6):
            prompts = [[rng.randrange(100, 50000) for _ in range(1024)] for _ in range(N)]
            torch.cuda.synchronize()
            t = time.perf_counter()
            llm.generate(prompts, [one] * N, use_tqdm=False)
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t) * 1e3)
        res[f"wall_ms_{N}x1024"] = round(statistics.median(walls[1:]), 2)
    llm.close()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="tree")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("[eager] needs a CUDA device", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = str(make_random_checkpoint(QWEN25_05B_SHAPE, Path(tmp) / "qwen2.5-0.5b-random", dtype=torch.bfloat16))
        res = {"benchmark": "eager_step_gpu", "label": args.label, **environment("cuda"), **measure(ckpt)}
    print("[eager]", json.dumps(res))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
