"""How long an engine step takes in a quiet process, by its size: is a step of a few thousand tokens
bound by the host (launches, bookkeeping) or by the device? One process, nothing else running.

    python3 benchmarks/eager_step_gpu.py --label base --out benchmarks/eager_step_gpu.json
    python3 benchmarks/eager_step_gpu.py --model tiny-random --lengths 30,60 --batches 1,2 --prompt-len 64
        (on a CPU: the script's own check, as tests/test_bench_smoke.py runs it)

Qwen2.5-0.5B shapes (random bf16 weights), `LLM(ckpt, max_model_len=4096)`, defaults otherwise; random
token ids in [100, 50000):
- ttft_ms_N: one prompt of N (--lengths) tokens, one output token; the median time to first token of
  the last 5 of 7 prompts (each a new prompt: no prefix hit).
- wall_ms_NxL: N (--batches) prompts of L = 1,024 tokens (--prompt-len) at once, one output token each
  (one prefill step of N x L tokens, within the default token budget), wall time with the device
  synchronized before and after, the median of the last 5 of 6.
- profile_N (on a GPU): one more lone prompt of N tokens, its first step under torch.profiler
  (`step_profile.device_profile`): the step's wall time (with the profiler's own cost), its device
  busy time (the union of its kernels' spans), the kernels it launched, the costliest of them, and the
  host's synchronizing ops. A step whose device busy
  time is far below its wall time waits on the host: launches, or what runs around them.
- tokens_alone, tokens_together: 8 greedy tokens of one more prompt of each length (the same prompts in
  every run), each alone and all in one step, to compare trees and options.
- build_s: building the engine (weights, pool, graph capture); the first tree built in a fresh machine
  also compiles the Triton kernels, so compare it only between runs of the same state.
A step whose wall stays flat as N grows pays a fixed cost (profile_N says whether the host's or the
device's); one that grows with N is bound by its work on the device.
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
from minikv.bench import environment, load_script  # noqa: E402
from minikv.bench.throughput import QWEN25_05B_SHAPE, make_random_checkpoint  # noqa: E402


def measure(model: str, lengths: list[int], batches: list[int], prompt_len: int, options: dict | None = None) -> dict:
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t = time.perf_counter()
    llm = LLM(model, **({"max_model_len": 4096} if cuda else {"kv_backend": "paged"}) | (options or {}))
    sync()
    res = {"build_s": round(time.perf_counter() - t, 2),
           "alloc_gib": round(torch.cuda.memory_allocated() / 2**30, 2) if cuda else None}
    rng = random.Random(1)
    lo, hi = min(100, llm.config.vocab_size // 2), min(50000, llm.config.vocab_size)  # (tiny-random: its vocabulary)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    try:
        for n in lengths:
            ts = [llm.generate([[rng.randrange(lo, hi) for _ in range(n)]], [one], use_tqdm=False)[0]
                  .time_to_first_token * 1e3 for _ in range(7)]
            res[f"ttft_ms_{n}"] = round(statistics.median(ts[2:]), 2)
        if cuda:
            step_profile = load_script(Path(__file__).with_name("step_profile.py"))
            for n in lengths:
                llm.add_request([rng.randrange(lo, hi) for _ in range(n)], one)
                d = step_profile.device_profile(llm, 1)  # the prefill, and its sampling, launched and synced
                while llm.has_unfinished():
                    llm.step()
                res[f"profile_{n}"] = {"wall_ms": d["wall_ms_per_step"], "device_busy_ms": d["device_busy_ms_per_step"],
                                       "kernels": round(sum(calls for _, calls, _ in d["kernels"])),
                                       "device_ms_by_family": d["device_ms_by_family"],
                                       "top_kernels_ms": d["top_kernels_ms"], "host_sync_ops_ms": d["host_sync_ops_ms"]}
        # greedy tokens, for comparing trees or options (the same seed gives every run the same prompts)
        check = random.Random(7)
        prompts = [[check.randrange(lo, hi) for _ in range(n)] for n in lengths]
        eight = SamplingParams(max_tokens=8, ignore_eos=True)
        res["tokens_alone"] = [llm.generate([p], [eight], use_tqdm=False)[0].token_ids for p in prompts]
        res["tokens_together"] = [o.token_ids for o in llm.generate(prompts, [eight] * len(prompts), use_tqdm=False)]
        for N in batches:
            walls = []
            for _ in range(6):
                prompts = [[rng.randrange(lo, hi) for _ in range(prompt_len)] for _ in range(N)]
                sync()
                t = time.perf_counter()
                llm.generate(prompts, [one] * N, use_tqdm=False)
                sync()
                walls.append((time.perf_counter() - t) * 1e3)
            res[f"wall_ms_{N}x{prompt_len}"] = round(statistics.median(walls[1:]), 2)
    finally:
        llm.close()
    return res


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="tree")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--model", default=None, help="a checkpoint or tiny-random (default: Qwen2.5-0.5B shapes, "
                    "random bf16 weights, made in a temporary directory)")
    ap.add_argument("--lengths", type=ints, default=[300, 700, 1500, 3000], help="one-prompt lengths (comma-separated)")
    ap.add_argument("--batches", type=ints, default=[1, 2, 4, 8, 16], help="prompts in one step (comma-separated)")
    ap.add_argument("--prompt-len", type=int, default=1024, help="tokens of each prompt of a batch")
    ap.add_argument("--options", type=json.loads, default={},
                    help='more LLM arguments as JSON, e.g. \'{"cuda_graph_max_tokens": 2048}\'')
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(make_random_checkpoint(QWEN25_05B_SHAPE, Path(tmp) / "qwen2.5-0.5b-random",
                                                         dtype=torch.bfloat16))
        device = "cuda" if torch.cuda.is_available() else "cpu"
        res = {"benchmark": "eager_step_gpu", "label": args.label, "model": args.model or "qwen2.5-0.5b shapes",
               **environment(device), "options": args.options,
               **measure(model, args.lengths, args.batches, args.prompt_len, args.options)}
    print("[eager]", json.dumps(res))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
