"""Where the time of one prefix hit goes on a GPU: the host (cProfile of one `generate`) and the device
(torch.profiler's kernel time for the same hit), beside the same request with caching off.

    python3 benchmarks/prefix_hit_profile.py --prefix 2048 [--out DIR]

Qwen2.5-0.5B shapes (random bf16), `LLM(ckpt, kv_backend="paged", prefix_caching="radix")` with the GPU
defaults; the prefix is cached by a first request, then one more request with the same prefix and 32
new tokens is timed: wall time of generate(), its time to first token, the device's kernel time, and
the 25 functions with the most cumulative host time. Tokens are checked against caching off first.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from minikv import LLM, SamplingParams
from minikv.bench.prefix_ttft import build_prompts
from minikv.bench.throughput import QWEN25_05B_SHAPE, make_random_checkpoint


def kernel_ms(fn) -> float:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    ckpt = str(make_random_checkpoint(QWEN25_05B_SHAPE, Path(tempfile.mkdtemp()) / "qwen"))
    max_len = args.prefix + args.suffix + 4
    num_blocks = 4 * -(-max_len // 16) + 64
    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    engines = {m: LLM(ckpt, kv_backend="paged", prefix_caching=m, max_model_len=max_len, num_blocks=num_blocks)
               for m in (None, "radix")}
    prompts = build_prompts(None, engines[None].config.vocab_size, args.prefix, args.suffix, 6)
    want = [o.token_ids for o in engines[None].generate(prompts[:3], sp)]
    for p in prompts[:3]:
        engines["radix"].generate(p, sp)  # kernels warm, the prefix cached
    assert [o.token_ids for o in engines["radix"].generate(prompts[:3], sp)] == want, "tokens differ from caching off"
    lines = []
    for name, llm in engines.items():
        walls, ttfts = [], []
        for p in prompts[3:]:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = llm.generate(p, sp)[0]
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
            ttfts.append(out.time_to_first_token)
        device = kernel_ms(lambda: llm.generate(prompts[3], sp))
        lines.append(f"{str(name):6} cached {out.num_cached_tokens:5} tokens: "
                     f"generate {statistics.median(walls) * 1e3:6.2f} ms, "
                     f"TTFT {statistics.median(ttfts) * 1e3:6.2f} ms, device kernels {device:6.2f} ms")
    prof = cProfile.Profile()
    prof.runcall(engines["radix"].generate, prompts[4], sp)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(25)
    report = "\n".join([torch.cuda.get_device_name(), *lines, text.getvalue()])
    print(report)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"prefix_hit_profile_{args.prefix}.txt").write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
