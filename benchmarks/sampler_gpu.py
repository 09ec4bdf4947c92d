"""The batched sampler on a GPU: the pivoting kernel against the sampler it replaces, and against greedy.

    python3 benchmarks/sampler_gpu.py --baseline OLD_SAMPLER.py --out DIR_OR_FILE.json   (a CUDA device)

1. correctness: tokens of `sample_on_device` on the GPU (bf16 and float32 logits; temperature alone,
   top-p 0.95, top-k 50 + top-p, greedy rows beside them) against the CPU path's tokens on the same
   logits in float32. They may differ only where two noisy scores tie within the rounding of a log
   (the GPU's log is not the CPU's): the count of differing rows is printed and must stay under 1%.
   Seeds: the same rows alone and in a shuffled batch give the same tokens.
2. timing, CUDA events around each call, median of 30 after warm-up, logits rotated among 4 buffers:
   greedy argmax, then T = 0.6 alone and T = 0.6 with top-p 0.95, new sampler and --baseline (a copy of
   minikv/engine/sampler.py from before the kernel, loaded from a file), on flat rows (a random model:
   the nucleus holds most of the vocabulary) and peaked rows (a trained model's), B = 1, 64, 256,
   vocabulary 151,936. Beside each device time: the host time of the call, which equals the device
   time when the call waits for the device.
Prints a table and writes the figures as JSON. Exits with status 1 when a correctness check fails.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import minikv.kernels  # noqa: F401, I001  (first: on a CPU it switches Triton to its interpreter)
from minikv import SamplingParams
from minikv.bench import environment
from minikv.engine.sampler import draw_key, sample, sample_on_device

DEVICE = torch.device("cuda")
VOCAB = 151_936


def rows(n: int, kind: str, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """Logits: 'flat' like a random model's (std 0.05: the nucleus holds ~95% of the vocabulary),
    'peaked' like a trained model's (std 3 plus a few strong candidates)."""
    g = torch.Generator(DEVICE).manual_seed(seed)
    x = torch.randn(n, VOCAB, generator=g, device=DEVICE)
    if kind == "flat":
        x = x * 0.05
    else:
        x = x * 3.0
        x[:, :8] += 12.0 * torch.rand(n, 8, generator=g, device=DEVICE)
    return x.to(dtype)


def check(failures: list[str]) -> dict:
    out = {}
    settings = {"temperature": [SamplingParams(temperature=0.6, ignore_eos=True)],
                "top_p": [SamplingParams(temperature=0.6, top_p=0.95)],
                "mixed": [SamplingParams(), SamplingParams(temperature=0.6, top_p=0.95),
                          SamplingParams(temperature=1.0, top_k=50, top_p=0.9), SamplingParams(temperature=0.8)]}
    seed = 100
    for dtype in (torch.bfloat16, torch.float32):
        for kind in ("flat", "peaked"):
            for name, cycle in settings.items():
                n, seed = 256, seed + 1
                logits = rows(n, kind, seed=seed, dtype=dtype)
                params = [cycle[i % len(cycle)] for i in range(n)]
                keys = [draw_key(1000 + i, 17) for i in range(n)]
                got = sample_on_device(logits, params, keys).tolist()
                want = sample(logits.float().cpu(), params, keys)
                differ = sum(a != b for a, b in zip(got, want))
                perm = torch.randperm(n).tolist()
                shuffled = sample_on_device(logits[perm], [params[i] for i in perm], [keys[i] for i in perm]).tolist()
                alone = [sample_on_device(logits[i:i + 1], [params[i]], [keys[i]]).item() for i in range(8)]
                same = shuffled == [got[i] for i in perm] and alone == got[:8]
                label = f"{str(dtype).split('.')[-1]} {kind} {name}"
                out[label] = {"rows": n, "differ_from_cpu": differ, "batch_invariant": same}
                print(f"check {label:28s} rows differing from the CPU path: {differ:3d}/{n}   "
                      f"alone/shuffled identical: {same}")
                if differ > n // 100 or not same:
                    failures.append(label)
    return out


def timed(fn, buffers: list[torch.Tensor], trials: int = 30) -> tuple[float, float]:
    """(device ms, host ms) medians of fn(logits) over rotating buffers."""
    for b in buffers:
        fn(b)
    torch.cuda.synchronize()
    dev, host = [], []
    for t in range(trials):
        b = buffers[t % len(buffers)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        h0 = time.perf_counter()
        fn(b)
        h1 = time.perf_counter()
        end.record()
        torch.cuda.synchronize()
        dev.append(start.elapsed_time(end))
        host.append((h1 - h0) * 1e3)
    return statistics.median(dev), statistics.median(host)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", default=None, help="a copy of the earlier minikv/engine/sampler.py")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    failures: list[str] = []
    record = {"environment": environment("cuda"), "check": check(failures), "timing": []}
    samplers = {"new": sample_on_device}
    if args.baseline:
        spec = importlib.util.spec_from_file_location("baseline_sampler", args.baseline)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        samplers["baseline"] = old.sample_on_device
    print(f"\n{'rows':>5s} {'logits':7s} {'sampling':12s} {'sampler':9s} {'device ms':>10s} {'host ms':>9s} "
          f"{'x greedy':>9s}")
    for n in (1, 64, 256):
        for kind in ("flat", "peaked"):
            buffers = [rows(n, kind, seed=s) for s in range(4)]
            g_dev, g_host = timed(lambda b: b.argmax(dim=-1), buffers)
            record["timing"].append({"rows": n, "logits": kind, "sampling": "greedy", "sampler": "argmax",
                                     "device_ms": g_dev, "host_ms": g_host})
            print(f"{n:5d} {kind:7s} {'greedy':12s} {'argmax':9s} {g_dev:10.3f} {g_host:9.3f} {1.0:9.2f}")
            for sampling, p in (("T=0.6", SamplingParams(temperature=0.6)),
                                ("T=0.6 p=0.95", SamplingParams(temperature=0.6, top_p=0.95))):
                keys = [draw_key(i, 5) for i in range(n)]
                for name, fn in samplers.items():
                    d, h = timed(lambda b, fn=fn: fn(b, [p] * n, keys), buffers)
                    record["timing"].append({"rows": n, "logits": kind, "sampling": sampling, "sampler": name,
                                             "device_ms": d, "host_ms": h})
                    print(f"{n:5d} {kind:7s} {sampling:12s} {name:9s} {d:10.3f} {h:9.3f} {d / g_dev:9.2f}")
    record["failures"] = failures
    if args.out:
        out = Path(args.out)
        out = out / "sampler_gpu.json" if out.suffix != ".json" else out
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1))
    print("FAILED: " + ", ".join(failures) if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
