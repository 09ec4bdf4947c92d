"""`minikv check`: grade exercise notebooks a learner saved, by running them, never by their stored outputs.

    grade_notebook(path)  ->  Grade: points per check cell, the diagnosis of each failing one

Each notebook runs in a fresh Python process (minikv/classroom/runner.py) started in the notebook's
folder: its code cells in order, the learner's exercise cells as saved, the course's check cells.
nbval alone cannot grade: a wrong implementation saved with its outputs passes it. The process is
killed when the notebook runs past its time limit; a cell that calls exit() ends only itself.

The grader is not a sandbox: a learner's code runs with the grader's rights. Grade a class on a
machine (or a CI runner) that holds nothing else of value.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import minikv
from minikv.classroom.notebooks import Cell, NotGradable, find_reference, max_points, plan

RUNNER = Path(__file__).resolve().with_name("runner.py")
DEFAULT_TIMEOUT = 600.0  # seconds per notebook; each course exercise runs in about 2 minutes on 2 cores


@dataclass
class CheckResult:
    number: int       # 1.. among the notebook's check cells
    cell: int         # the cell's index in the notebook
    source: str
    points: float     # what it is worth
    passed: bool
    message: str      # the checker's last printed line when it passed, the diagnosis when not


@dataclass
class Grade:
    exercise: str     # the notebook's name without .ipynb, e.g. 04a_slot_mapping
    path: str
    checks: list[CheckResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)   # errors in other cells, what the grader replaced
    error: str | None = None    # set when the notebook could not be graded at all (missing, not an exercise)
    max_known: float = 0.0      # max points when no check ran (a missing or broken notebook)
    seconds: float = 0.0

    @property
    def points(self) -> float:
        return sum(c.points for c in self.checks if c.passed)

    @property
    def max_points(self) -> float:
        return sum(c.points for c in self.checks) if self.checks else self.max_known

    @property
    def passed(self) -> bool:
        return self.error is None and bool(self.checks) and all(c.passed for c in self.checks)

    @property
    def message(self) -> str:
        if self.error is not None:
            return self.error
        failing = [c for c in self.checks if not c.passed]
        if not failing:
            return f"all {len(self.checks)} checks passed"
        parts = [f"check {c.number} of {len(self.checks)} (cell {c.cell}) failed: {c.message}" for c in failing]
        return "\n".join(parts + self.notes)

    def to_json(self) -> str:
        return json.dumps({"exercise": self.exercise, "passed": self.passed, "points": number(self.points),
                           "max_points": number(self.max_points), "message": self.message})

    def report(self) -> str:
        """What `minikv check` prints: one line per check, the diagnosis under each failing one."""
        head = f"{self.exercise}: {number(self.points)} of {number(self.max_points)} points  ({self.path})"
        if self.error is not None:
            return f"{head}\n  {_indent(self.error, 2)}"
        lines = [head]
        for c in self.checks:
            code = [s for s in c.source.strip().splitlines() if s.strip()] or [""]
            first = next((s for s in code if "check" in s), code[0]).strip()
            lines.append(f"  {'pass' if c.passed else 'FAIL'}  check {c.number} of {len(self.checks)} "
                         f"(cell {c.cell}): {first}")
            if c.message:
                lines.append(f"        {_indent(c.message, 8)}")
        lines += [f"  note: {_indent(n, 8)}" for n in self.notes]
        return "\n".join(lines)


def number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def _indent(text: str, width: int) -> str:
    return text.replace("\n", "\n" + " " * width)


def _child_env(threads: int | None) -> dict[str, str]:
    env = dict(os.environ)
    here = Path(minikv.__file__).resolve().parents[1]
    if (here / "pyproject.toml").is_file():  # minikv runs from a checkout: the notebook imports the same one
        env["PYTHONPATH"] = os.pathsep.join([str(here)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("MPLBACKEND", "Agg")
    if threads is not None:
        env.setdefault("OMP_NUM_THREADS", str(threads))
    return env


def _kill(proc: subprocess.Popen) -> None:
    """End the notebook's process and whatever it started (its own session, see start_new_session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def _tail(path: Path, n: int = 600) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return text[-n:].strip()


def grade_notebook(path: str | Path, timeout: float = DEFAULT_TIMEOUT, reference: Path | None = None,
                   threads: int | None = None) -> Grade:
    """Run one exercise notebook in a fresh process and grade its check cells."""
    path = Path(path)
    grade = Grade(exercise=path.stem, path=str(path))
    try:
        cells, grade.notes = plan(path, reference)
    except NotGradable as e:
        grade.error = str(e)
        ref = find_reference(path, reference)
        grade.max_known = known_max_points(ref) if ref is not None else 0.0
        return grade
    checks = [c for c in cells if c.role == "check"]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="minikv-check-") as tmp:
        plan_file, result_file, log_file = Path(tmp, "plan.json"), Path(tmp, "result.json"), Path(tmp, "log.txt")
        plan_file.write_text(json.dumps({"cwd": str(path.resolve().parent), "cells": [
            {"index": c.index, "source": c.source, "role": c.role} for c in cells]}))
        with open(log_file, "wb") as log:
            python = [sys.executable] + (["-S"] if sys.flags.no_site else [])  # the child imports as we do
            proc = subprocess.Popen([*python, str(RUNNER), str(plan_file), str(result_file)],
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=_child_env(threads), start_new_session=True)
            try:
                code, timed_out = proc.wait(timeout=timeout), False
            except subprocess.TimeoutExpired:
                _kill(proc)
                code, timed_out = proc.returncode, True
            except BaseException:  # Ctrl-C: the notebook's own session would outlive us
                _kill(proc)
                raise
        try:
            state = json.loads(result_file.read_text())
        except (OSError, json.JSONDecodeError):
            state = {"running": None, "cells": [], "finished": False}
        log_tail = _tail(log_file)
    grade.seconds = time.perf_counter() - start
    _collect(grade, cells, checks, state, code, timed_out, timeout, log_tail)
    return grade


def _collect(grade: Grade, cells: list[Cell], checks: list[Cell], state: dict, code: int | None,
             timed_out: bool, timeout: float, log_tail: str) -> None:
    ran = state.get("cells", [])  # the runner records cells in plan order: cells[len(ran)] was running
    stopped = this = None
    if not state.get("finished"):
        at = f"cell {cells[len(ran)].index}" if len(ran) < len(cells) else "the end"
        if timed_out:
            this = f"ran past the notebook's {timeout:g} s limit (a loop that never ends?); its process was stopped"
            stopped = f"did not run: {at} was still running when the notebook reached its {timeout:g} s limit"
        else:
            how = (f"was killed by signal {-code}" + (" (out of memory?)" if code == -signal.SIGKILL else "")
                   if code is not None and code < 0 else f"ended (exit code {code})")
            last = f"; its last output: {log_tail}" if log_tail else ""
            this = f"the notebook's process {how} in this cell{last}"
            stopped = f"did not run: the notebook's process {how} in {at}{last}"
    k = 0
    for position, cell in enumerate(cells):
        rec = ran[position] if position < len(ran) else None
        if cell.role != "check":
            if rec and rec["error"] and "raises-exception" not in cell.tags:
                what = "your exercise cell" if cell.role == "exercise" else "a cell"
                grade.notes.append(f"cell {cell.index} ({what}) raised: {rec['error']}")
            elif rec is None and position == len(ran) and this:
                grade.notes.append(f"cell {cell.index}: {this}")
            continue
        k += 1
        if rec is None:
            message = this if position == len(ran) else stopped or "did not run"
            grade.checks.append(CheckResult(k, cell.index, cell.source, cell.points, False, message))
            continue
        output = rec["output"].strip().splitlines()
        message = rec["error"] if rec["error"] else (output[-1] if output else "")
        grade.checks.append(CheckResult(k, cell.index, cell.source, cell.points, rec["error"] is None, message))
    assert k == len(checks)


def grade_notebooks(paths: list[Path], timeout: float = DEFAULT_TIMEOUT, reference: Path | None = None,
                    jobs: int = 1, on_done=None) -> list[Grade]:
    """Grade several notebooks, `jobs` processes at a time; results in the order of `paths`."""
    jobs = max(1, min(jobs, len(paths) or 1))
    threads = max(1, (os.cpu_count() or 1) // jobs) if jobs > 1 else None

    def one(p: Path) -> Grade:
        g = grade_notebook(p, timeout=timeout, reference=reference, threads=threads)
        if on_done is not None:
            on_done(g)
        return g

    with ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(one, paths))


def known_max_points(path: Path) -> float:
    """max points of an exercise by the notebook's own check cells (0 when it cannot be read)."""
    try:
        return max_points(path)
    except NotGradable:
        return 0.0
