"""Async scheduling on vs off: the same tokens, and how much of a step's host work the overlap hides.

    python3 benchmarks/async_scheduling_gpu.py --out $OUT/async_scheduling_gpu.json     (GPU, ~3 min)
    python3 benchmarks/async_scheduling_gpu.py --small                                   (CPU smoke test)

Model: Qwen2.5-0.5B's shapes with random weights (minikv/bench/throughput.py), bf16, paged engine,
Triton attention, CUDA graphs, max_num_seqs 256, budget 16,384 tokens. One engine serves every run;
`llm.async_scheduling` is switched between runs (a property: it finishes a step in flight first), so
both modes share the pool, the captured graphs and the warm caches.

1. correctness: a smaller workload (48 requests, 50-200 tokens in and out, a few of 1 token) greedy and
   seeded-sampled (T=0.6, top-p 0.95), overlap on vs off: requests with identical tokens. A
   difference can only come from the batch (a wasted row can put a step in another CUDA-graph bucket,
   whose bf16 matrix products may round differently); the float32 run of the same check isolates it.
2. timing: nano-vllm's workload (256 requests, 100-1024 tokens in and out, EOS ignored), greedy and
   sampled, off then on, each driven by `step()` to the end. Per run: output tokens/s, steps, mean
   and median step wall time (host clock around `step()`), and mean device time of a step's forward
   (CUDA events recorded around `ModelRunner.forward`: graph replay or eager kernels). With the
   overlap the forward's device time stays, the wall time should fall toward it.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from minikv import LLM, SamplingParams
from minikv.bench import environment, first_divergence
from minikv.bench.throughput import QWEN25_05B_SHAPE, SAMPLING, SMALL_SHAPE, make_random_checkpoint, workload


def check_workload(num_requests: int, rng_seed: int = 7) -> list[tuple[list[int], int]]:
    """Short requests, some of a single output token (they finish with a wasted row behind them)."""
    rng = random.Random(rng_seed)
    return [([rng.randint(0, 10000) for _ in range(rng.randint(50, 200))], 1 if i % 7 == 3 else rng.randint(50, 200))
            for i in range(num_requests)]


class ForwardTimer:
    """CUDA events around every `runner.forward` of one engine (the device time of each step's model),
    and around every call of the sampler (`sample_on_device`, both where the engine core calls it and
    where `sample` does): a sampled step's kernels run on the device too, after the model's."""

    def __init__(self, llm: LLM):
        from minikv.engine import core, sampler
        self.pairs: list[tuple] = []
        self.sample_pairs: list[tuple] = []
        self.llm = llm
        llm.runner.forward = self._wrap(llm.runner.forward, self.pairs)
        self._restore = [(mod, mod.sample_on_device) for mod in (core, sampler)]
        for mod, fn in self._restore:
            mod.sample_on_device = self._wrap(fn, self.sample_pairs)

    def close(self) -> None:
        for mod, fn in self._restore:
            mod.sample_on_device = fn

    @staticmethod
    def _wrap(fn, pairs: list):
        def timed(*args, **kwargs):
            if not torch.cuda.is_available():
                return fn(*args, **kwargs)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            pairs.append((start, end))
            return out
        return timed

    def take_sample_ms(self) -> float:
        """Device ms of every sampler call since the last take."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        total = sum(s.elapsed_time(e) for s, e in self.sample_pairs)
        self.sample_pairs.clear()
        return total

    def take_ms(self) -> list[float]:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times = [s.elapsed_time(e) for s, e in self.pairs]
        self.pairs.clear()  # (in place: the wrappers hold this list)
        return times


def drive(llm: LLM, requests, sampling: str, timer: ForwardTimer) -> dict:
    """Queue every request, step until drained; tokens and per-step timings."""
    seqs = [llm.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True, seed=i, **SAMPLING[sampling]))
            for i, (p, n) in enumerate(requests)]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    timer.take_ms()
    timer.take_sample_ms()
    overlapped_before = llm.num_overlapped_steps
    walls = []
    t0 = time.perf_counter()
    while llm.has_unfinished():
        s = time.perf_counter()
        llm.step()
        walls.append(time.perf_counter() - s)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    device_ms = timer.take_ms()
    sample_ms = timer.take_sample_ms()
    made = sum(len(s.output_token_ids) for s in seqs)
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.scheduler.finishing, "blocks left after the drain"
    return {"tokens": [list(s.output_token_ids) for s in seqs], "seconds": elapsed, "output_tokens": made,
            "tokens_per_s": made / elapsed, "steps": len(walls),
            "overlapped_steps": llm.num_overlapped_steps - overlapped_before,
            "step_wall_ms_mean": 1e3 * statistics.fmean(walls), "step_wall_ms_median": 1e3 * statistics.median(walls),
            "forward_device_ms_mean": statistics.fmean(device_ms) if device_ms else None,
            "forward_device_ms_total": sum(device_ms) if device_ms else None,
            # the step's device time: the model's and the sampler's kernels (greedy: one argmax)
            "step_device_ms_mean": (sum(device_ms) + sample_ms) / len(walls) if device_ms else None}


def compare(a: list[list[int]], b: list[list[int]]) -> dict:
    firsts = [first_divergence(x, y) for x, y in zip(a, b)]
    return {"num_requests": len(a), "requests_identical": sum(f is None for f in firsts),
            "first_divergences": [f for f in firsts if f is not None][:10]}


def build(ckpt: Path, device: str, dtype: torch.dtype, small: bool, max_num_seqs: int = 256) -> LLM:
    # the pool is sized for the workload (256 x 2,048 tokens), not the card: the float32 engine comes second
    kw = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=16384, num_blocks=40_000) if not small else dict(
        max_num_seqs=32, max_num_batched_tokens=2048, num_blocks=2048)
    return LLM(str(ckpt), device=device, dtype=dtype, kv_backend="paged", max_model_len=2048, block_size=16,
               **({"attention": "torch"} if device == "cpu" else {}), **kw)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny model and workload (CPU smoke test)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--num-requests", type=int, default=None, help="first N requests of the timed workload")
    ap.add_argument("--max-num-seqs", type=int, default=256,
                    help="the engine's seats (512: what LLM(ckpt) picks on an H100 or H200)")
    ap.add_argument("--out", default=None, help="write the JSON record here")
    args = ap.parse_args(argv)
    dev, small = args.device, args.small
    shape = SMALL_SHAPE if small else QWEN25_05B_SHAPE
    record: dict = {"benchmark": "async scheduling on vs off", **environment(dev), "shape": "small" if small else
                    "qwen2.5-0.5b", "max_num_seqs": args.max_num_seqs, "checks": {}, "runs": []}
    timed = workload()[:args.num_requests or (24 if small else 256)]
    if small:
        timed = [(p[:120], min(n, 60)) for p, n in timed]
    checks = check_workload(12 if small else 48)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_random_checkpoint(shape, Path(tmp) / "ckpt", dtype=torch.float32)
        for dtype in ([torch.float32] if small else [torch.bfloat16, torch.float32]):
            llm = build(ckpt, dev, dtype, small, args.max_num_seqs)
            timer = ForwardTimer(llm)
            name = str(dtype).removeprefix("torch.")
            drive(llm, checks[:4], "greedy", timer)  # warm-up: kernels, autotuning, allocator
            for sampling in SAMPLING:
                got = {}
                for on in (False, True):
                    llm.async_scheduling = on
                    got[on] = drive(llm, checks, sampling, timer)
                result = compare(got[False]["tokens"], got[True]["tokens"])
                result["overlapped_steps"] = got[True]["overlapped_steps"]
                record["checks"][f"{name} {sampling}"] = result
                print(f"check {name:8s} {sampling:8s}: {result['requests_identical']}/{result['num_requests']} "
                      f"requests identical on vs off ({result['overlapped_steps']} overlapped steps)", flush=True)
            if dtype != torch.float32 or small:
                for sampling in SAMPLING:
                    off_tokens = None  # set by the run with async scheduling off, which goes first
                    for on in (False, True):
                        llm.async_scheduling = on
                        run = drive(llm, timed, sampling, timer)
                        tokens = run.pop("tokens")
                        run.update(sampling=sampling, async_scheduling=on, dtype=name)
                        record["runs"].append(run)
                        if on:
                            run["tokens_identical_to_off"] = compare(off_tokens, tokens)["requests_identical"]
                        off_tokens = tokens
                        print(f"run {sampling:8s} async={on!s:5s}: {run['tokens_per_s']:9,.0f} tok/s  "
                              f"{run['seconds']:6.2f} s  {run['steps']} steps  wall/step "
                              f"{run['step_wall_ms_mean']:.2f} ms  forward/step "
                              f"{run['forward_device_ms_mean'] or float('nan'):.2f} ms", flush=True)
            timer.close()
            del llm, timer
            gc.collect()
            if dev.startswith("cuda"):
                torch.cuda.empty_cache()
    runs = {(r["sampling"], r["async_scheduling"]): r for r in record["runs"]}
    record["speedup"] = {s: runs[(s, True)]["tokens_per_s"] / runs[(s, False)]["tokens_per_s"]
                         for s in SAMPLING if (s, True) in runs}
    print("\n| sampling | async | tok/s | seconds | steps | overlapped | wall/step mean (ms) | median | "
          "forward device/step (ms) | step device (ms, with sampling) | wall / step device | tokens = off |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in record["runs"]:
        dev_ms, step_ms = r["forward_device_ms_mean"], r["step_device_ms_mean"]
        ratio = "-" if not step_ms else f"{r['step_wall_ms_mean'] / step_ms:.2f}"
        print(f"| {r['sampling']} | {'on' if r['async_scheduling'] else 'off'} | {r['tokens_per_s']:,.0f} | "
              f"{r['seconds']:.2f} | {r['steps']} | {r['overlapped_steps']} | {r['step_wall_ms_mean']:.2f} | "
              f"{r['step_wall_ms_median']:.2f} | {'-' if dev_ms is None else f'{dev_ms:.2f}'} | "
              f"{'-' if step_ms is None else f'{step_ms:.2f}'} | {ratio} | {r.get('tokens_identical_to_off', '-')} |")
    print("\nspeedup (on / off):", {k: round(v, 3) for k, v in record["speedup"].items()})
    text = json.dumps(record, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    else:
        print(text[:2000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
