"""Offline throughput of two minikv trees, alternating, on one GPU: is a change a regression or noise?

    python3 benchmarks/offline_ab.py --tree NEW --tree BASE --rounds 3 --out $OUT/offline_ab.json
    --tree 'NEW={"cuda_graph_max_tokens": 0}'     a tree with LLM options (JSON) of its own

Each round runs every tree in its own process (a fresh CUDA context, the pool fitted to an empty card)
on the nano-vllm workload (256 requests, prompts and outputs 100-1,024 tokens, EOS ignored, greedy),
Qwen2.5-0.5B shapes with random bf16 weights, `LLM(ckpt)` defaults; tokens of the first tree are the
reference for the others. Prints output tok/s per tree and round, and the median per tree.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time, torch
from minikv import LLM, SamplingParams
from minikv.bench.throughput import workload
reqs = workload()
llm = LLM(sys.argv[1], **json.loads(sys.argv[2]))
prompts = [p for p, _ in reqs]
params = [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in reqs]
llm.generate(prompts[:8], params[:8], use_tqdm=False)
torch.cuda.synchronize(); t0 = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
torch.cuda.synchronize(); s = time.perf_counter() - t0
n = sum(len(o.token_ids) for o in outs)
print(json.dumps({"tok_s": n / s, "tokens": [o.token_ids[:16] for o in outs[:32]]}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch

    from minikv.bench import environment
    from minikv.bench.throughput import QWEN25_05B_SHAPE, make_random_checkpoint

    tmp = Path(tempfile.mkdtemp())
    ckpt = str(make_random_checkpoint(QWEN25_05B_SHAPE, tmp / "qwen", dtype=torch.bfloat16))
    runs = {t: [] for t in args.tree}
    same = {t: True for t in args.tree}
    ref = None
    for r in range(args.rounds):
        for tree in args.tree:
            path, _, options = tree.partition("=")
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(path).resolve())]
                                                               + os.environ.get("PYTHONPATH", "").split(os.pathsep))}
            out = subprocess.run([sys.executable, "-c", CHILD, ckpt, options or "{}"], env=env, capture_output=True,
                                 text=True, cwd=path)
            if out.returncode:
                print(out.stderr[-3000:])
                return 1
            got = json.loads(out.stdout.strip().splitlines()[-1])
            ref = ref if ref is not None else got["tokens"]
            same[tree] &= got["tokens"] == ref
            runs[tree].append(got["tok_s"])
            print(f"round {r} {tree:40s} {got['tok_s']:10,.0f} tok/s", flush=True)
    for tree in args.tree:
        print(f"median {tree:40s} {statistics.median(runs[tree]):10,.0f} tok/s  tokens as the first tree: {same[tree]}")
    Path(args.out).write_text(json.dumps({"env": environment("cuda"), "runs": runs, "same_tokens": same}, indent=1,
                                         default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
