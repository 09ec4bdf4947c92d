"""The host's work per step over a whole run, on a CPU: the offline loop against the server's engine loop,
with and without the prefix cache, the model stubbed out.

    python benchmarks/host_run_cpu.py --out benchmarks/host_run_cpu.json [--requests 256] [--max-tokens 256]
    PYTHONPATH=path/to/an/older/tree python benchmarks/host_run_cpu.py --label before ...

Why: on a GPU the server's engine process is host-bound (NOTES_step_profile.md): whatever Python a step
runs on top of the offline engine's comes straight off its rate. This script measures that Python alone,
over the whole life of a workload (arrivals, prefills, decodes, finishes), where `host_step_cpu.py`
measures one steady decode step.

The workload is the nano-vllm one (`minikv.bench.throughput.workload`: prompts of 100-1,024 token ids,
outputs capped at --max-tokens, ignore_eos), its first --requests requests, arriving --burst per step as
the server's engine takes them (a burst of clients reaches it as a few batches). The paged engine runs
with async scheduling forced on (the GPU default) and the model replaced by `host_step_cpu.StubModel`.
Four loops, taking turns --repeats times:

    offline       LLM.step(), as generate() drives it
    server        what the server's engine process does per step (minikv/serve/core_process.py):
                  core.step(), the events as plain tuples (to_wire), the view's snapshot, and one message to
                  another process that reads them all: through the core's `EventWriter` (pickled and
                  written in this thread, never blocking), or, in a tree without one, a multiprocessing
                  queue (whose feeder thread pickles it under this interpreter's lock)
    each with prefix_caching None and "hash" (the server's default)

Prints ms per step (the median over repeats of each run's mean) and the ratios that matter.
"""
from __future__ import annotations

import argparse
import collections
import gc
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if __name__ == "__main__":  # run as a script: minikv from this checkout, installed or not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))

LOOPS = ("offline", "server")
CACHES = ("none", "hash")


def drain(results) -> None:
    """The server's side: take every message until told to stop."""
    get = results.recv if hasattr(results, "recv") else results.get
    while get() is not None:
        pass


def channel(ctx):
    """(the core's end, the server's end) of the core's messages, as this tree's server makes them."""
    try:
        from minikv.serve.core_process import EventWriter
    except ImportError:  # an older tree: a multiprocessing queue
        q = ctx.Queue()
        return q, q
    reader, writer = ctx.Pipe(duplex=False)
    return EventWriter(writer), reader


def one_run(loop: str, cache: str, reqs: list[tuple[list[int], int]], burst: int, results) -> dict:
    from host_step_cpu import StubModel

    from minikv import LLM, SamplingParams
    from minikv.engine.gc_pause import frozen_heap
    from minikv.serve.core_process import to_wire

    longest = max(len(p) + n for p, n in reqs)
    llm = LLM("tiny-random", kv_backend="paged", device="cpu", max_num_seqs=len(reqs), block_size=16,
              num_blocks=sum(-(-(len(p) + n) // 16) + 2 for p, n in reqs) + 2048, max_num_batched_tokens=16384,
              max_model_len=longest + 16, prefix_caching=None if cache == "none" else cache)
    llm.async_scheduling = True
    core, view = llm.core, llm.view
    core.runner.model = StubModel(core.runner.model, 512)
    core.detokenize = False  # as in the server's engine process
    pending = collections.deque(reqs)
    steps, tokens = 0, 0
    gc.collect()
    t0 = time.perf_counter()
    with frozen_heap():
        while pending or core.has_unfinished():
            for _ in range(min(burst, len(pending))):
                prompt, n = pending.popleft()
                llm.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
            if loop == "offline":
                tokens += len(llm.step())
            else:
                events = core.step()
                tokens += sum(1 for e in events if e.token_id is not None)
                results.put(("events", to_wire(events), view.snapshot(), None))
            steps += 1
    seconds = time.perf_counter() - t0
    llm.close()
    return {"steps": steps, "tokens": tokens, "seconds": seconds, "ms_per_step": seconds / steps * 1e3}


def workload_of(requests: int, max_tokens: int) -> list[tuple[list[int], int]]:
    from minikv.bench.throughput import workload

    return [([t % 500 + 3 for t in p], min(n, max_tokens)) for p, n in workload()[:requests]]


def run(args) -> dict:
    import minikv

    reqs = workload_of(args.requests, args.max_tokens)
    ctx = mp.get_context("spawn")
    results, server_end = channel(ctx)
    reader = ctx.Process(target=drain, args=(server_end,), daemon=True)
    reader.start()
    runs: dict[str, list[dict]] = {f"{loop}_{cache}": [] for loop in LOOPS for cache in CACHES}
    try:
        for _ in range(args.repeats):
            for name in runs:
                loop, cache = name.split("_")
                runs[name].append(one_run(loop, cache, reqs, args.burst, results))
    finally:
        results.put(None)
        if hasattr(results, "finish"):
            results.finish()
        reader.join(30)
    med = {name: round(statistics.median(r["ms_per_step"] for r in rs), 4) for name, rs in runs.items()}
    return {"label": args.label, "minikv_file": minikv.__file__, "channel": type(results).__name__,
            "requests": len(reqs), "burst": args.burst,
            "max_tokens": args.max_tokens, "repeats": args.repeats, "torch": torch.__version__,
            "median_ms_per_step": med,
            "ratios": {"server_none / offline_none": round(med["server_none"] / med["offline_none"], 3),
                       "offline_hash / offline_none": round(med["offline_hash"] / med["offline_none"], 3),
                       "server_hash / offline_none": round(med["server_hash"] / med["offline_none"], 3)},
            "tokens_equal": len({r["tokens"] for rs in runs.values() for r in rs}) == 1,
            "runs": runs, "loadavg": os.getloadavg()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", default="run")
    ap.add_argument("--out", default=None, help="a json file the run is added to (under its label)")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=256, help="outputs capped here (the run's length)")
    ap.add_argument("--burst", type=int, default=16, help="requests arriving before each step until all are in")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    if args.requests < 1 or args.repeats < 1 or args.burst < 1:
        ap.error("--requests, --repeats and --burst must be at least 1")
    torch.set_num_threads(1)
    record = run(args)
    for name, ms in record["median_ms_per_step"].items():
        print(f"{name:14s} {ms:.3f} ms per step")
    for name, r in record["ratios"].items():
        print(f"{name:28s} {r:.3f}")
    if args.out:
        from host_step_cpu import add_run

        add_run(Path(args.out), record)
    return record


if __name__ == "__main__":
    main()
