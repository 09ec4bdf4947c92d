"""When each step of an engine was scheduled, and how much it ran: a burst's timeline, to set the server's
engine (MINIKV_STEP_TRACE=PATH, minikv/serve/core_process.py) beside an offline one on the same requests.

    trace = StepTrace(); llm.add_observer(trace); llm.generate(...)
    timeline(trace.rows, start)   # tokens and steps scheduled by 50, 100, 200, 300 ms after `start`
"""
from __future__ import annotations

import bisect
import time

MARKS_S = (0.05, 0.1, 0.2, 0.3)


class StepTrace:
    """An engine observer: (time.perf_counter(), tokens, sequences) of every step, as it is scheduled."""

    def __init__(self):
        self.rows: list[tuple[float, int, int]] = []

    def on_schedule(self, llm, batch) -> None:
        self.rows.append((time.perf_counter(), sum(batch.num_new_tokens), len(batch.seqs)))


def first_steps(rows: list, start: float, end: float = float("inf"), n: int = 48) -> list[tuple[float, int, int]]:
    """The first `n` steps scheduled between `start` and `end`: (ms after `start`, tokens, sequences)."""
    return [(round((t - start) * 1e3, 1), k, s) for t, k, s in sorted(r for r in rows if start <= r[0] <= end)[:n]]


def timeline(rows: list, start: float, end: float = float("inf"),
             marks: tuple[float, ...] = MARKS_S) -> dict[str, list]:
    """By each mark (seconds after `start`): the steps scheduled (before `end`) and the tokens they ran, so far."""
    rows = sorted(r for r in rows if start <= r[0] <= end)
    times, tokens, out = [r[0] for r in rows], [0], {"marks_s": list(marks), "steps": [], "tokens": []}
    for r in rows:
        tokens.append(tokens[-1] + r[1])
    for m in marks:
        k = bisect.bisect_right(times, start + m)
        out["steps"].append(k)
        out["tokens"].append(tokens[k])
    return out
