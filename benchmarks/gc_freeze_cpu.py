"""Does a run freeze the heap when the interpreter started with some objects frozen, and what does each
generate() call pay for it? (CPython 3.12 starts every process with 375 objects frozen; 3.11 and 3.13
with none: minikv/engine/gc_pause.py.)

    PYTHONPATH=. python benchmarks/gc_freeze_cpu.py                         this tree
    PYTHONPATH=. python benchmarks/gc_freeze_cpu.py --trees base=/tmp/a new=.  each tree in turn (`git archive
        <commit> | tar -x -C /tmp/a`), each in a fresh process -> benchmarks/gc_freeze_cpu.json

Each child freezes the heap first, as 3.12's start does (here: whatever lived at that moment), then builds
`tiny-random` and reports, per tree:
  frozen_in_run     objects frozen while a generate() runs (above the start-up count: the run froze its heap)
  unfrozen_in_run   tracked objects a full collection would walk during that run
  frozen_after      objects still frozen once it ended
  ms_per_call       median wall time of one generate() of one token (a tree that leaves the heap frozen and
                    counts it at every call pays a walk over all of it here)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import gc, json, statistics, time
gc.freeze()  # as CPython 3.12 starts: what lives now is frozen before minikv is imported
start_up = gc.get_freeze_count()
from minikv import LLM, SamplingParams
llm = LLM("tiny-random", kv_backend="paged", block_size=4, num_blocks=64)
params = SamplingParams(max_tokens=1, ignore_eos=True)
seen = []
class Look:
    def on_step(self, llm, batch, events):
        seen.append((gc.get_freeze_count(), len(gc.get_objects())))
remove = llm.add_observer(Look())
llm.generate([1, 2, 3], params)
remove()
for _ in range(3):
    llm.generate([1, 2, 3], params)
times = []
for _ in range(CALLS):
    t = time.perf_counter()
    llm.generate([1, 2, 3], params)
    times.append(time.perf_counter() - t)
print(json.dumps({"start_up_frozen": start_up, "frozen_in_run": seen[0][0], "unfrozen_in_run": seen[0][1],
                  "frozen_after": gc.get_freeze_count(), "ms_per_call": 1e3 * statistics.median(times)}))
"""


def measure(tree: Path, calls: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD.replace("CALLS", str(calls))], capture_output=True,
                         text=True, cwd="/", env={**os.environ, "PYTHONPATH": str(tree)}, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trees", nargs="*", default=[f"this={Path(__file__).resolve().parents[1]}"],
                    help="LABEL=PATH (or PATH) of each tree")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--out", default=str(Path(__file__).with_name("gc_freeze_cpu.json")))
    args = ap.parse_args(argv)
    rows = {}
    for spec in args.trees:
        label, _, tree = spec.rpartition("=")
        rows[label or tree] = r = measure(Path(tree).resolve(), args.calls)
        print(f"{label or tree}: frozen at start {r['start_up_frozen']:,}, in the run {r['frozen_in_run']:,} (unfrozen "
              f"{r['unfrozen_in_run']:,}), after {r['frozen_after']:,}; {r['ms_per_call']:.2f} ms per generate()")
    from minikv.bench import environment

    Path(args.out).write_text(json.dumps({"benchmark": "gc_freeze_cpu", "environment": environment("cpu"),
                                          "calls": args.calls, "trees": rows}, indent=1) + "\n")
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
