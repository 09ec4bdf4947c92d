"""Where the time to first token of one prefix hit goes, phase by phase, for caching off, hash and radix.

    python3 benchmarks/prefix_hit_phases.py --prefix 8192 [--out FILE.json]

Qwen2.5-0.5B shapes (random bf16), the workload of `benchmarks/ratios_gpu.py` (8 requests one at a time
sharing a prefix, 32 new tokens, 1 output token). Every engine method on the hit's path is wrapped with
a host clock (perf_counter, no synchronisation: a phase that waits for the device absorbs that wait), so
the table shows the host time of each phase of a request: checking the prompt, queueing, scheduling
(the prefix lookup and block acquisition), preparing the step, launching it, sampling (which waits for
the device), and finishing (caching and freeing blocks). The device's kernel time of the same request
(torch.profiler) and its largest kernels come after. Tokens are checked against caching off first.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from minikv import LLM, SamplingParams
from minikv.bench import environment
from minikv.bench.prefix_ttft import build_prompts
from minikv.bench.throughput import QWEN25_05B_SHAPE, make_random_checkpoint

if __name__ == "__main__":  # run as a script: the checkout's root on the path (as query_rows_step_gpu.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.ratios_gpu import turns  # noqa: E402  (off first, then hash and radix in alternating order)

PHASES = [  # (label, path to the object from the LLM, method)
    ("request", "", "request"),
    ("new_sequence", "core", "new_sequence"),
    ("enqueue", "core", "enqueue"),
    ("schedule", "core.scheduler", "schedule"),
    ("  match_prefix", "core.block_manager", "match_prefix"),
    ("  acquire_prefix", "core.block_manager", "acquire_prefix"),
    ("  grow", "core.block_manager", "grow"),
    ("prepare_step", "core.runner", "prepare_step"),
    ("forward", "core.runner", "forward"),
    ("sample (waits)", "core", "_sample"),
    ("update", "core.scheduler", "update"),
    ("  cache_blocks", "core.block_manager", "cache_blocks"),
    ("finish", "core.scheduler", "finish"),
    ("  free", "core.block_manager", "free"),
    ("retire", "core", "_retire"),
    ("output", "", "output"),
]


def resolve(llm, path: str):
    obj = llm
    for name in filter(None, path.split(".")):
        obj = getattr(obj, name)
    return obj


def instrument(llm) -> dict[str, list[float]]:
    spent: dict[str, list[float]] = defaultdict(list)
    for label, path, name in PHASES:
        obj = resolve(llm, path)
        if not hasattr(obj, name):
            continue
        inner = getattr(obj, name)

        def timed(*a, _inner=inner, _label=label, **kw):
            t0 = time.perf_counter()
            try:
                return _inner(*a, **kw)
            finally:
                spent[_label].append(time.perf_counter() - t0)
        setattr(obj, name, timed)
    return spent


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def kernels(llm, prompt, sp) -> tuple[float, list[tuple[str, float, int]]]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        llm.generate(prompt, sp)
        torch.cuda.synchronize()
    rows = [(e.key, e.self_device_time_total / 1e3, e.count) for e in prof.key_averages() if e.self_device_time_total]
    rows.sort(key=lambda r: -r[1])
    return sum(r[1] for r in rows), rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix", type=int, default=8192)
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--out", default=None)
    ap.add_argument("--trace", default=None, help="a directory: one warm request per mode as a Chrome trace")
    args = ap.parse_args(argv)
    ckpt = str(make_random_checkpoint(QWEN25_05B_SHAPE, Path(tempfile.mkdtemp()) / "qwen"))
    max_len = args.prefix + args.suffix + 4
    num_blocks = 2 * -(-max_len // 16) + args.requests * (-(-args.suffix // 16) + 2)
    engines = {str(m): LLM(ckpt, kv_backend="paged", prefix_caching=m, max_model_len=max_len, block_size=16,
                           num_blocks=num_blocks) for m in (None, "hash", "radix")}
    prompts = build_prompts(None, engines["None"].config.vocab_size, args.prefix, args.suffix, args.requests)
    warm = build_prompts(None, engines["None"].config.vocab_size, args.prefix + args.suffix - 1, 1, 1)[0]
    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    for llm in engines.values():
        llm.generate([(t + 17) % 10000 for t in warm], sp)
        if llm.prefix_cache is not None:
            llm.reset_prefix_cache()
    want = None
    spent = {k: instrument(llm) for k, llm in engines.items()}
    per_request = {k: defaultdict(list) for k in engines}  # label -> host seconds of each warm request
    ttft, wall = defaultdict(list), defaultdict(list)
    for i, p in enumerate(prompts):
        for k in turns(i):  # off first, then hash and radix in alternating order (ratios_gpu.turns says why)
            llm = engines[k]
            for times in spent[k].values():
                times.clear()
            sync()
            t0 = time.perf_counter()
            out = llm.generate(p, sp)[0]
            wall[k].append(time.perf_counter() - t0)
            ttft[k].append(out.time_to_first_token)
            if k == "None":
                want = out.token_ids
            elif out.token_ids != want:
                raise SystemExit(f"{k}: tokens differ from caching off at request {i}")
            if i >= 2:  # the first two requests fill the cache
                for label, times in spent[k].items():
                    per_request[k][label].append(sum(times))
    record = {"benchmark": "prefix_hit_phases", **environment(), "prefix_tokens": args.prefix, "modes": {}}
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"{device}, prefix {args.prefix}, suffix {args.suffix}; medians of "
          f"{args.requests - 2} warm requests, host ms per request")
    header = f"{'phase':20}" + "".join(f"{k:>10}" for k in engines)
    print(header)
    for label, _, _ in PHASES:
        cells = []
        for k in engines:
            xs = per_request[k].get(label)
            cells.append(f"{statistics.median(xs) * 1e3:10.3f}" if xs else f"{'-':>10}")
        print(f"{label:20}" + "".join(cells))
    print(f"{'TTFT':20}" + "".join(f"{statistics.median(ttft[k][2:]) * 1e3:10.3f}" for k in engines))
    print(f"{'generate wall':20}" + "".join(f"{statistics.median(wall[k][2:]) * 1e3:10.3f}" for k in engines))
    for k, llm in engines.items():
        total, rows = kernels(llm, prompts[-1], sp) if torch.cuda.is_available() else (0.0, [])
        print(f"\n{k}: device kernels {total:.3f} ms in {sum(r[2] for r in rows)} launches; largest:")
        for name, ms, count in rows[:8]:
            print(f"  {ms:8.3f} ms {count:5}x  {name[:90]}")
        record["modes"][k] = {
            "ttft_median_ms": statistics.median(ttft[k][2:]) * 1e3,
            "wall_median_ms": statistics.median(wall[k][2:]) * 1e3,
            "phases_median_ms": {lab: statistics.median(xs) * 1e3 for lab, xs in per_request[k].items()},
            "device_kernels_ms": total, "top_kernels": rows[:12]}
    if args.trace and torch.cuda.is_available():
        Path(args.trace).mkdir(parents=True, exist_ok=True)
        for k, llm in engines.items():
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                llm.generate(prompts[-2], sp)
                torch.cuda.synchronize()
            prof.export_chrome_trace(str(Path(args.trace) / f"hit_{args.prefix}_{k}.json"))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
