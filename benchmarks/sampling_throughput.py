"""Sampled vs greedy throughput on a GPU, this engine beside an earlier commit's, in one run.

    python benchmarks/sampling_throughput.py --out DIR [--num-requests 64] [--cap 40]

The nano-vllm workload (minikv.bench.throughput.workload: seeded prompts and output lengths in
[100, 1024], EOS ignored) on a Qwen2.5-0.5B-shaped model with seeded random bf16 weights, paged
attention with Triton kernels and CUDA graphs, max_num_seqs=256, max_num_batched_tokens=16384:

    greedy            SamplingParams(max_tokens=n, ignore_eos=True)
    sampled           the same with temperature=0.6, top_p=0.95 (nano-vllm's own benchmark samples)

Run it once per engine version in the same session on the same card: the `minikv` it imports is the
one on sys.path (a checkout with PYTHONPATH=., or an installed earlier commit), and the record names
its commit. Each run is capped at --cap seconds and reports the tokens it made by then.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def run(ckpt: Path, requests, params_of, cap_s: float) -> dict:
    import torch

    from minikv import LLM, SamplingParams

    llm = LLM(str(ckpt), kv_backend="paged", max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=16384)
    llm.generate([list(range(1, 65))], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    seqs = [llm.add_request(p, params_of(n)) for p, n in requests]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    steps = 0
    while llm.has_unfinished() and time.perf_counter() - t0 < cap_s:
        llm.step()
        steps += 1
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    made = sum(len(s.output_token_ids) for s in seqs)
    for s in seqs:
        if not s.is_finished:
            llm.abort(s)
    del llm
    torch.cuda.empty_cache()
    return {"output_tokens": made, "seconds": round(seconds, 3), "tokens_per_s": round(made / seconds, 1),
            "steps": steps, "complete": made == sum(n for _, n in requests)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--cap", type=float, default=40.0)
    ap.add_argument("--label", default="")
    ap.add_argument("--greedy-only", action="store_true", help="time greedy only (to repeat it for the spread)")
    args = ap.parse_args(argv)
    import minikv
    from minikv import SamplingParams
    from minikv.bench import throughput as tp

    try:  # one environment() for every benchmark since issue 10; the earlier commit kept it in throughput
        from minikv.bench import environment
        env = environment("cuda")
    except ImportError:
        env = tp.environment("cuda", None)
    requests = tp.workload()[: args.num_requests]
    record = {"label": args.label, "minikv_file": minikv.__file__, "env": env,
              "workload": {"num_requests": len(requests), "output_tokens": sum(n for _, n in requests),
                           "model": "Qwen2.5-0.5B shapes, random bf16", "max_num_seqs": 256,
                           "max_num_batched_tokens": 16384, "cap_s": args.cap}}
    with tempfile.TemporaryDirectory() as d:
        ckpt = tp.make_random_checkpoint(tp.QWEN25_05B_SHAPE, Path(d) / "qwen")
        record["greedy"] = run(ckpt, requests, lambda n: SamplingParams(max_tokens=n, ignore_eos=True), args.cap)
        print("greedy", record["greedy"], flush=True)
        if args.greedy_only:
            return record
        record["sampled"] = run(ckpt, requests, lambda n: SamplingParams(max_tokens=n, ignore_eos=True,
                                                                          temperature=0.6, top_p=0.95), args.cap)
        print("sampled", record["sampled"], flush=True)
    record["sampled_over_greedy"] = round(record["sampled"]["tokens_per_s"] / record["greedy"]["tokens_per_s"], 3)
    out = Path(args.out) / f"sampling_throughput_{args.label or 'run'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(json.dumps({k: record[k] for k in ("label", "sampled_over_greedy")}), file=sys.stderr)
    return record


if __name__ == "__main__":
    main()
