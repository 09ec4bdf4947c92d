"""The clock of the drills and bug labs: when each was started, how many checks, when it first passed.

    $MINIKV_HOME/drill_clock.json (default ~/.minikv)
    {"radix-tree":           {"started": 1764240000.0, "attempts": 3, "passed_after": 1712.4},
     "bugs:missing-rescale": {"started": 1764243600.0, "attempts": 1, "passed_after": null}}

`start` again keeps a running clock (an interview does not restart because you reopened the file);
`restart=True` resets it. The first passing check stops it: later checks report that time.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path


def home() -> Path:
    """Where the quiz scores, the clocks and the mock reports live: $MINIKV_HOME, else ~/.minikv."""
    return Path(os.environ.get("MINIKV_HOME") or Path.home() / ".minikv")


def clock_file() -> Path:
    return home() / "drill_clock.json"


def load() -> dict[str, dict]:
    try:
        data = json.loads(clock_file().read_text())
    except (OSError, ValueError):
        return {}
    # an older file held only the start time of each clock
    return {k: (v if isinstance(v, dict) else {"started": float(v), "attempts": 0, "passed_after": None})
            for k, v in data.items()}


def _save(clocks: dict[str, dict]) -> None:
    path = clock_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(clocks, indent=1))
    tmp.replace(path)


def start(name: str, now: float | None = None, restart: bool = False) -> tuple[dict, bool]:
    """Start the clock of `name`, or keep it running if it is; return (its entry, whether it was kept).
    `now` (a test's clock) sets the start time."""
    clocks = load()
    entry = clocks.get(name)
    if entry is not None and not restart and now is None:
        return entry, True
    entry = {"started": time.time() if now is None else now, "attempts": 0, "passed_after": None}
    clocks[name] = entry
    _save(clocks)
    return entry, False


def get(name: str) -> dict | None:
    return load().get(name)


def record(name: str, passed: bool, now: float | None = None) -> dict | None:
    """Count one check; the first pass stops the clock. Returns the entry (None: never started)."""
    clocks = load()
    entry = clocks.get(name)
    if entry is None:
        return None
    entry["attempts"] = entry.get("attempts", 0) + 1
    if passed and entry.get("passed_after") is None:
        entry["passed_after"] = (time.time() if now is None else now) - entry["started"]
        entry["passed_attempts"] = entry["attempts"]
    _save(clocks)
    return entry


def elapsed(entry: dict, now: float | None = None) -> float:
    """Seconds on the clock: until the first pass, or until now."""
    if entry.get("passed_after") is not None:
        return entry["passed_after"]
    return (time.time() if now is None else now) - entry["started"]


def describe(entry: dict | None, limit_minutes: int, verb: str, name: str) -> str:
    """One line for `status` and after a check: time used against the limit, attempts, passed or not."""
    if entry is None:
        return f"time: not started (`minikv {verb} start {name}` starts the clock); limit {limit_minutes} min"
    taken = elapsed(entry) / 60
    tries = entry.get("passed_attempts", entry.get("attempts", 0))
    if entry.get("passed_after") is not None:
        head = f"time: passed after {taken:.1f} min and {tries} check{'s' * (tries != 1)}, limit {limit_minutes} min"
    else:
        head = f"time: {taken:.1f} min of {limit_minutes} min, {tries} check{'s' * (tries != 1)} so far"
    if taken > limit_minutes:
        return head + f" ({taken - limit_minutes:.1f} min over the limit)"
    if entry.get("passed_after") is None:
        return head + f" ({limit_minutes - taken:.1f} min left)"
    return head + " (within the limit)"
