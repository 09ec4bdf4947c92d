"""`minikv serve` with and without its default prefix cache, against offline `LLM(ckpt)` with and without one.

    python3 benchmarks/serve_prefix_ab_gpu.py [--loads 2]

The nano-vllm workload (256 requests, Qwen2.5-0.5B shapes, random bf16, token-id prompts of 100-1,024,
outputs of 100-1,024, ignore_eos), 256 streaming clients over 8 client processes, as
`benchmarks/ratios_gpu.py` runs it. Servers take turns (none, hash, none, hash: `--prefix-caching`; hash
is `minikv serve`'s default), each warmed with 8 requests and then loaded `--loads` times with the whole
workload (the second load finds every prompt cached); then `LLM(ckpt)` offline, without and with the
hash cache (emptied between runs), `--loads` runs each. Prints one line per load: output tok/s and TTFT
p50. Why: the server's default prefix cache is work `LLM(ckpt)` does not do (NOTES_step_profile.md).
"""
from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch

if __name__ == "__main__":  # run as a script: minikv from this checkout, installed or not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minikv import LLM, SamplingParams  # noqa: E402
from minikv.bench.serve import Req, ServerProcess, pct, run_load  # noqa: E402
from minikv.bench.throughput import QWEN25_05B_SHAPE, make_random_checkpoint, workload  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loads", type=int, default=2)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: no CUDA device; run this on the GPU machine", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp())
    ckpt = str(make_random_checkpoint(QWEN25_05B_SHAPE, tmp / "qwen2.5-0.5b-random", dtype=torch.bfloat16))
    reqs = workload()
    for server_args in (["--prefix-caching", "none"], [], ["--prefix-caching", "none"], []):
        server = ServerProcess(ckpt, server_args, tmp / "server.log").wait_ready()
        try:
            import httpx

            name = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
            run_load(server.url, name, [Req(0.0, "warm", p, 8) for p, _ in reqs[:8]])
            for k in range(args.loads):
                load = [Req(0.0, f"t{i % 4}", p, n) for i, (p, n) in enumerate(reqs)]
                results, duration = run_load(server.url, name, load, processes=8)
                ok = [r for r in results if r.ok]
                print(f"serve {' '.join(server_args) or '(defaults: hash)'} load {k}: "
                      f"{sum(r.output_tokens for r in ok) / duration:,.0f} tok/s, "
                      f"ttft p50 {pct([r.ttft for r in ok], 50):.2f} s, failed {len(results) - len(ok)}", flush=True)
        finally:
            server.stop()
    prompts = [p for p, _ in reqs]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in reqs]
    for caching in (None, "hash"):
        llm = LLM(ckpt, prefix_caching=caching)
        llm.generate(prompts[:8], params[:8], use_tqdm=False)  # warm
        for k in range(args.loads):
            if caching:
                llm.reset_prefix_cache()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            print(f"offline prefix_caching={caching} run {k}: {sum(len(o.token_ids) for o in outs) / seconds:,.0f} "
                  f"tok/s, ttft p50 {pct([o.time_to_first_token for o in outs], 50):.2f} s", flush=True)
        llm.close()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
