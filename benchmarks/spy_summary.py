"""What py-spy saw: a summary of its raw output (`py-spy record --format raw`, one folded stack and its
sample count per line), by thread.

    python3 benchmarks/spy_summary.py FILE [--top 12] [--json]

For each thread: its samples, and three views of them
- leaf lines: the innermost frame of each sample, where the time was spent in Python;
- own lines: the innermost frame in this project's code (minikv/ or benchmarks/), so that time in a
  library (torch, asyncio, the pipe) is charged to the project's line that called it;
- functions: every function of the project's on the stack, counted once per sample (its inclusive share).

Lines of raw output look like
    thread (551): MainThread;<module> (busy.py:8);g (busy.py:7);f (busy.py:4) 109
(`--threads` puts the thread first; without it every sample counts for the thread "?").
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

PROJECT = ("minikv/", "benchmarks/")  # frames of this project's own code (py-spy shortens the paths)
_FRAME = re.compile(r"^(?P<function>.*) \((?P<where>[^()]*):(?P<line>\d+)\)$")


def function_of(frame: str) -> str:
    """'f (busy.py:4)' -> 'f (busy.py)': the function, whichever of its lines."""
    m = _FRAME.match(frame)
    return f"{m['function']} ({m['where']})" if m else frame


def parse(text: str) -> list[tuple[str, list[str], int]]:
    """(thread, frames outermost first, samples) per line of raw output."""
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        stack, _, count = line.rstrip().rpartition(" ")
        if not count.isdigit():
            raise ValueError(f"not a line of py-spy's raw output (a folded stack, then its count): {line[:120]!r}")
        frames = stack.split(";")
        thread = "?"
        if frames and frames[0].startswith("thread ("):
            head = frames.pop(0)
            thread = head.partition(": ")[2] or head  # "thread (551): MainThread", or the bare "thread (551)"
        out.append((thread, frames, int(count)))
    return out


def summarize(text: str, top: int = 12) -> dict:
    """{"samples": all, "threads": {thread: {"samples", "leaf_lines", "own_lines", "functions"}}}, threads
    busiest first, each view's `top` rows as [frame, samples]."""
    samples: Counter[str] = Counter()
    views = {k: defaultdict(Counter) for k in ("leaf_lines", "own_lines", "functions")}
    for thread, frames, n in parse(text):
        samples[thread] += n
        if not frames:
            continue
        views["leaf_lines"][thread][frames[-1]] += n
        own = next((f for f in reversed(frames) if any(p in f for p in PROJECT)), "(none of the project's)")
        views["own_lines"][thread][own] += n
        for f in dict.fromkeys(function_of(f) for f in frames if any(p in f for p in PROJECT)):  # each once
            views["functions"][thread][f] += n
    return {"samples": sum(samples.values()),
            "threads": {t: {"samples": n, **{k: [[f, c] for f, c in v[t].most_common(top)] for k, v in views.items()}}
                        for t, n in samples.most_common()}}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", type=Path)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = ap.parse_args(argv)
    s = summarize(args.file.read_text(), args.top)
    if args.json:
        print(json.dumps(s, indent=1))
        return s
    print(f"{s['samples']} samples")
    for thread, t in s["threads"].items():
        print(f"== {thread}: {t['samples']} ({t['samples'] / max(1, s['samples']):.0%})")
        for view in ("leaf_lines", "own_lines", "functions"):
            for frame, n in t[view]:
                print(f"   {view:10} {n:6d} {n / t['samples']:5.0%}  {frame[:110]}")
    return s


if __name__ == "__main__":
    main(sys.argv[1:])
