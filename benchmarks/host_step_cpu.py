"""The host's share of a decode step, on a CPU: N sequences decoding, the model stubbed out.

    python benchmarks/host_step_cpu.py --out benchmarks/host_step_cpu.json [--label after] [--seqs 240]
    PYTHONPATH=path/to/an/older/tree python benchmarks/host_step_cpu.py --label before ...

On a GPU a decode step of ~240 sequences costs ~2.6 ms of device time; with async scheduling
(minikv/engine/overlap.py) the host's work of step t+1 overlaps the device's of step t, so a step's
wall time is max(host, device). This script measures the host side alone. The paged engine runs on
the CPU with async scheduling forced on (the GPU default), and the model is replaced by a stub that
returns fixed logits: what is left is the engine's own Python, the part that does not depend on the
device.

    one overlapped engine call (LLM.step) = schedule t+1 + prepare t+1 (batch tensors)
        + sample t (the sampler; on a GPU kernels launched) + forward t+1 (here: the stub and the
        backend's metadata; on a GPU the graph's copies and replay)
        + apply (update: t counts as computed; append t's tokens, stop rules, events; keys, bookkeeping)

Each phase is timed by wrapping the engine's own functions (Scheduler.schedule, Scheduler.update,
ModelRunner.prepare_step, ModelRunner.forward, the core's sample_on_device); `apply` is the step's
wall time less the others. The host's work is schedule + update + prepare + apply (forward and
sample left out: on a GPU they are the device's), each a median over the measured steps. The steps
run inside `frozen_heap()`, as `generate` and the server run them (no full garbage collection walks
the engine's objects). Every request has the same length, so the batch stays at N sequences during
the measured steps (each finishes after them).

On a shared machine the OS takes the core away for a few milliseconds now and then: a step's total
then jumps by that much, while each phase's median skips those steps. Compare sum_of_medians.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

PHASES = ("schedule", "update", "prepare", "forward", "sample")


class StubModel(torch.nn.Module):
    """Fixed logits for every row asked for: the forward pass costs (almost) nothing."""

    def __init__(self, model, vocab_size: int):
        super().__init__()
        self.inner = model
        self.logits = torch.randn(4096, vocab_size, generator=torch.Generator().manual_seed(0))

    def forward(self, input_ids, positions, meta, backend, logits_indices=None):
        n = input_ids.numel() if logits_indices is None else logits_indices.numel()
        return self.logits[:n]


class Timer:
    def __init__(self):
        self.times: dict[str, list[float]] = defaultdict(list)
        self.current: dict[str, float] = defaultdict(float)

    def wrap(self, owner, name: str, phase: str) -> None:
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[phase] += time.perf_counter() - t

        setattr(owner, name, timed)

    def step(self, llm, record: bool) -> None:
        self.current.clear()
        t = time.perf_counter()
        llm.step()
        total = time.perf_counter() - t
        if record:
            for p in PHASES:
                self.times[p].append(self.current[p])
            self.times["apply"].append(total - sum(self.current[p] for p in PHASES))
            self.times["step"].append(total)
            self.times["host"].append(total - self.current["forward"] - self.current["sample"])

    def medians_ms(self) -> dict:
        return {p: round(statistics.median(v) * 1e3, 4) for p, v in self.times.items()}

    def host_ms(self) -> dict:
        """The host's work per step: the sum of its phases' medians (each phase is short, so its median
        skips the steps in which the OS gave the core to another process), and the quartiles of
        step - forward - sample, step by step."""
        med = self.medians_ms()
        q = statistics.quantiles(self.times["host"], n=4)
        return {"sum_of_medians": round(sum(med[p] for p in ("schedule", "update", "prepare", "apply")), 4),
                "per_step_p25": round(q[0] * 1e3, 4), "per_step_median": round(q[1] * 1e3, 4)}


def run(args) -> dict:
    import minikv
    import minikv.engine.core as core_mod
    from minikv import LLM, SamplingParams
    from minikv.engine.gc_pause import frozen_heap

    llm = LLM("tiny-random", kv_backend="paged", device="cpu", max_num_seqs=args.seqs + 2 * args.arrivals,
              block_size=args.block_size,
              num_blocks=args.seqs * (-(-(args.prompt_len + args.max_tokens) // args.block_size) + 2)
              + 2 * args.seqs + 16384 // args.block_size  # room to overlap every step (overlap.min_free_blocks)
              + 4 * args.arrivals * -(-args.prompt_len // args.block_size),  # and for the arrivals
              max_num_batched_tokens=16384, max_model_len=2048, **json.loads(args.options))
    llm.async_scheduling = args.async_scheduling
    runner = llm.runner if hasattr(llm, "runner") else llm.core.runner
    runner.model = StubModel(runner.model, 512)
    sch = llm.scheduler
    timer = Timer()
    timer.wrap(sch, "schedule", "schedule")
    timer.wrap(sch, "update", "update")
    timer.wrap(runner, "prepare_step", "prepare")
    timer.wrap(runner, "forward", "forward")
    timer.wrap(core_mod, "sample_on_device", "sample")
    timer.wrap(core_mod, "sample", "sample")
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True,
                            **(dict(temperature=0.6, top_p=0.95) if args.sampled else {}))
    for i in range(args.seqs):
        llm.add_request([(7 * i + 3 * j) % 500 + 3 for j in range(args.prompt_len)], params)
    for _ in range(args.skip):  # the prefills, and a few decode steps
        timer.step(llm, False)
    running = len(sch.running)
    gc.collect()
    arrival = SamplingParams(max_tokens=1, ignore_eos=True)
    with frozen_heap():  # as generate() and the server run: no full collection walks the old objects
        for step in range(args.steps):
            for j in range(args.arrivals):  # mixed steps: a prompt prefilled beside the decodes, then done
                llm.add_request([(11 * step + 5 * j + k) % 500 + 3 for k in range(args.prompt_len)], arrival)
            timer.step(llm, True)
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            llm.step()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    med = timer.medians_ms()
    return {"label": args.label, "minikv_file": minikv.__file__, "running_seqs": running,
            "async_scheduling": args.async_scheduling, "prompt_len": args.prompt_len, "block_size": args.block_size,
            "arrivals_per_step": args.arrivals, "options": json.loads(args.options), "sampled": args.sampled,
            "steps": args.steps, "median_ms": med, "host_ms": timer.host_ms(),
            "loadavg": os.getloadavg()}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", default="run")
    ap.add_argument("--out", default=None, help="a json file the run is added to (under its label)")
    ap.add_argument("--seqs", type=int, default=240)
    ap.add_argument("--prompt-len", type=int, default=1000, help="context ~ the GPU profile's ~1,100 tokens")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--skip", type=int, default=24)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--no-async", dest="async_scheduling", action="store_false")
    ap.add_argument("--arrivals", type=int, default=0,
                    help="requests (one token each) added before every measured step: mixed prefill + decode steps")
    ap.add_argument("--profile", action="store_true", help="then cProfile as many steps again")
    ap.add_argument("--sampled", action="store_true",
                    help="every row samples (temperature 0.6, top-p 0.95: the serve workload's), not greedy")
    ap.add_argument("--options", default="{}", help='more LLM arguments as JSON, e.g. \'{"prefix_caching": "hash"}\'')
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    record = run(args)
    print(json.dumps(record), flush=True)
    if args.out:
        add_run(Path(args.out), record)
    return record


def add_run(out: Path, record: dict) -> None:
    """Append one run's record to the json file `out` (its "runs"), made if missing."""
    runs = json.loads(out.read_text()) if out.exists() else {}
    runs.setdefault("runs", []).append(record)
    out.write_text(json.dumps(runs, indent=1) + "\n")
    print(f"added to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
