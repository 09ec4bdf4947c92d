"""The scheduler's host time per decode step with 256 sequences running, on the CPU.

    python benchmarks/schedule_cpu.py [--steps 60]

tiny-random (the forward is cheap; the scheduler is what is timed), paged, 256 requests of 20-100 prompt
tokens decoding 400 tokens each, all running at once. Times every `Scheduler._schedule` call (the
decision: grow, copy-on-write, admit) and prints the median over the decode steps after the first 10.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from minikv import LLM, SamplingParams


def main(argv=None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args(argv)
    if args.steps <= 10:
        ap.error(f"--steps must be more than 10 (the first 10 are left out of the median), got {args.steps}")
    llm = LLM("tiny-random", device="cpu", kv_backend="paged", max_num_seqs=256, max_num_batched_tokens=4096,
              num_blocks=8192, block_size=16)
    rng = random.Random(0)
    for _ in range(256):
        prompt = [rng.randrange(1, 200) for _ in range(rng.randint(20, 100))]
        llm.add_request(prompt, SamplingParams(max_tokens=400, ignore_eos=True))
    scheduler, times = llm.scheduler, []
    decide = scheduler._schedule

    def timed():
        t = time.perf_counter()
        batch = decide()
        times.append(time.perf_counter() - t)
        return batch

    scheduler._schedule = timed
    for _ in range(args.steps):
        llm.step()
    ms = statistics.median(times[10:]) * 1e3
    print(f"{len(scheduler.running)} running: schedule {ms:.3f} ms per step (median of {len(times) - 10})")
    return ms


if __name__ == "__main__":
    main()
