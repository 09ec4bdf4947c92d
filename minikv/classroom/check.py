"""`minikv check`: grade exercise notebooks a learner saved, by running them, never by their stored outputs.

    grade_notebook(path)  ->  Grade: points per check, the diagnosis of each failing one, flags

Each notebook is copied alone into a temporary folder and runs in a fresh Python process
(minikv/classroom/runner.py) that imports minikv from a copy of the package, never from the checkout
(no solutions/, no instructor key beside it): first the learner's code cells in order, then the
course's checks of that exercise from the package (minikv/classroom/registry.py), never the
notebook's own check cells. Results come back over a pipe, event by event, as each check finishes;
the process ends without running exit hooks. It is killed past its time limit, and cannot grow past
its memory limit; its printed output is kept to its end. What this defends against, and what not:
classroom/README.md.

grade_notebooks, on Linux, forks each notebook's process from a warm server that has imported torch
and minikv from its own copy of the package (minikv/classroom/forkserver.py): the same isolation, without
a second of imports per notebook. MINIKV_GRADER_FORK=0 (or fork=False) starts a fresh process instead.
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import minikv
from minikv.classroom import forkserver
from minikv.classroom.guard import suspect
from minikv.classroom.notebooks import (
    Cell,
    NotGradable,
    code_cells,
    course_exercises,
    find_reference,
    normalised,
    read_notebook,
)
from minikv.classroom.registry import CourseCell, Entry, course, entry_of_notebook, identify

DEFAULT_TIMEOUT = 600.0  # seconds per notebook; each course exercise runs in about 2 minutes on 2 cores
DEFAULT_MEMORY_GB = 8.0  # address space per notebook (a notebook of the course peaks near 2.5 GB)
LOG_KEPT = 4096          # bytes of the process's own output kept (what it printed past the cells' capture)


@dataclass
class CheckResult:
    number: int         # 1.. among the exercise's checks
    cell: int | None    # where the check sits in the learner's notebook (None: not there; it ran anyway)
    source: str
    points: float       # what it is worth
    passed: bool
    message: str        # the checker's last printed line when it passed, the diagnosis when not
    flag: str | None = None  # why it scored 0 whatever it printed (the engine's own answer, tampering)


@dataclass
class Grade:
    exercise: str     # the course's name of the exercise, e.g. 04a_slot_mapping
    path: str
    checks: list[CheckResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)   # errors in other cells, what the grader replaced
    flags: list[str] = field(default_factory=list)   # what a teacher should look at: scored 0 for it
    error: str | None = None    # set when the notebook could not be graded at all (missing, not an exercise)
    max_known: float = 0.0      # max points when no check ran (a missing or broken notebook)
    seconds: float = 0.0
    attempted: bool = True      # False: every exercise cell is still the course's stub
    review: list[str] = field(default_factory=list)  # code of the learner's a teacher should read (no score change)
    # what each cell printed (the end of it), by its index in the notebook: the learner's cells, and the
    # course's setup cells that only the second phase ran; the course's tests compare it with the stored
    # outputs (not written to the results: `to_dict` leaves it out)
    outputs: dict[int, str] = field(default_factory=dict)

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
    def status(self) -> str:
        """passed, partial, failed, not attempted, flagged, missing or not gradable."""
        if self.error is not None:
            return "missing" if self.error.startswith("missing") else "not gradable"
        if self.flags:
            return "flagged"
        if self.passed:
            return "passed"
        if self.points > 0:
            return "partial"
        return "failed" if self.attempted else "not attempted"

    @property
    def message(self) -> str:
        if self.error is not None:
            return self.error
        failing = [c for c in self.checks if not c.passed]
        if not failing:
            return f"all {len(self.checks)} checks passed"
        parts = [f"check {c.number} of {len(self.checks)}{_at(c)} failed: {c.message}" for c in failing]
        return "\n".join(self.flags + parts + self.notes)

    def to_json(self) -> str:
        return json.dumps({"exercise": self.exercise, "passed": self.passed, "points": number(self.points),
                           "max_points": number(self.max_points), "status": self.status, "flags": self.flags,
                           "message": self.message})

    def to_dict(self) -> dict:
        d = {k: v for k, v in vars(self).items() if k not in ("checks", "outputs")}
        d["checks"] = [vars(c) for c in self.checks]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Grade:
        return cls(**{**d, "checks": [CheckResult(**c) for c in d.get("checks", [])]})

    def only(self, k: int) -> Grade:
        """This grade reduced to its check k (1..): what a one-check test of GitHub Classroom reports."""
        if not 1 <= k <= len(self.checks):
            return Grade(self.exercise, self.path, error=f"{self.exercise} has {len(self.checks)} checks, no check {k}")
        return Grade(self.exercise, self.path, [self.checks[k - 1]], self.notes, self.flags, self.error,
                     seconds=self.seconds, attempted=self.attempted, review=self.review)

    def report(self) -> str:
        """What `minikv check` prints: one line per check, the diagnosis under each failing one."""
        head = f"{self.exercise}: {number(self.points)} of {number(self.max_points)} points  ({self.path})"
        if self.error is not None:
            return f"{head}\n  {_indent(self.error, 2)}"
        lines = [head] + [f"  FLAG  {_indent(f, 8)}" for f in self.flags]
        for c in self.checks:
            code = [s for s in c.source.strip().splitlines() if s.strip()] or [""]
            first = next((s for s in code if "check" in s), code[0]).strip()
            lines.append(f"  {'pass' if c.passed else 'FAIL'}  check {c.number} of {len(self.checks)}{_at(c)}: {first}")
            if c.message:
                lines.append(f"        {_indent(c.message, 8)}")
        lines += [f"  note: {_indent(n, 8)}" for n in self.notes]
        lines += [f"  read: {r}" for r in self.review]
        return "\n".join(lines)


def _at(c: CheckResult) -> str:
    return f" (cell {c.cell})" if c.cell is not None else " (not in your notebook; the course's ran)"


def number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def _indent(text: str, width: int) -> str:
    return text.replace("\n", "\n" + " " * width)


def _ignore_held_back(folder: str, names: list[str]) -> set[str]:
    """What the grader's copy of the package leaves out: the interview answers kept for self-study."""
    f = folder.replace(os.sep, "/")
    if f.endswith("interview/data"):
        return {"course.json"} & set(names)
    if f.endswith("interview/drill_files"):
        return {n for n in names if n.endswith("_reference.py")}
    if f.endswith("interview/bug_files"):
        return {n for n in names if n.endswith("_fixed.py")}
    return set()


def package_copy(root: Path) -> str:
    """Copy the minikv package into root/minikv, read-only; its digest (to find it changed after a run).

    A notebook imports this copy: its minikv.__file__ leads to no checkout (no solutions/, instructor/ or
    tests/ beside it), and a notebook that rewrites a checker on disk changes its own copy alone."""
    shutil.copytree(Path(minikv.__file__).resolve().parent, root / "minikv", ignore=_ignore_held_back)
    for p in (root / "minikv").rglob("*"):
        p.chmod(0o444 if p.is_file() else 0o555)
    (root / "minikv").chmod(0o555)
    return _digest(root / "minikv")


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        h.update(str(p.relative_to(folder)).encode() + b"\0")
        if p.is_file() and not p.is_symlink():
            h.update(p.read_bytes())
    return h.hexdigest()


def _writable(folder: Path) -> None:
    """Undo package_copy's read-only modes (and whatever a notebook set) so the folder can be removed."""
    for p in [folder, *folder.rglob("*")]:
        try:
            if not p.is_symlink():
                p.chmod(0o755 if p.is_dir() else 0o644)
        except OSError:
            pass


def _child_env(package: Path) -> dict[str, str]:
    """The grader's environment less anything naming the checkout; minikv from the package copy."""
    here = str(Path(minikv.__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if here not in v and not k.startswith("MINIKV_GRADER")}
    env["PYTHONPATH"] = os.pathsep.join([str(package)] + [p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p and here not in p])
    env.setdefault("MPLBACKEND", "Agg")
    env.pop("PYTHONSTARTUP", None)
    return env


class WarmProcess:
    """A job slot's fork server (minikv/classroom/forkserver.py) and the package copy it imported minikv from.

    Started on first use. A notebook that changed that copy on disk (its grade is flagged) or a server that
    died retires it: the next notebook gets a new server with a new copy, never what a notebook left. A
    server that never got ready is not tried again: the slot's notebooks start fresh processes."""

    def __init__(self, threads: int | None):
        self.threads = threads
        self.server: forkserver.ForkServer | None = None
        self.package: Path | None = None
        self.digest = ""
        self.gave_up = False

    def fork(self, env: dict[str, str], events_fd: int) -> forkserver.Forked | None:
        """A notebook's process, or None: it needs a fresh one (a course's environment the server lacks)."""
        if self.gave_up:
            return None
        if self.server is None or self.server.environ is None:
            self.close()
            self.package = Path(tempfile.mkdtemp(prefix="minikv-grader-"))
            self.digest = package_copy(self.package)
            try:
                self.server = forkserver.ForkServer(self.package / "minikv" / "classroom" / "runner.py",
                                                    self.package, _child_env(self.package), self.threads)
            except OSError:
                self.server = None
            if self.server is None or self.server.environ is None:
                self.gave_up = True
                self.close()
                return None
        return self.server.fork(events_fd) if self.server.can_run(env) else None

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.package is not None:
            _writable(self.package)
            shutil.rmtree(self.package, ignore_errors=True)
        self.server, self.package = None, None


def _kill(proc: subprocess.Popen | forkserver.Forked) -> None:
    """End the notebook's process and whatever it started (its own session, see start_new_session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def _entry_for(path: Path, nb: dict, reference: Path | None) -> Entry:
    ref = find_reference(path, reference)
    if ref is not None:
        return entry_of_notebook(ref, name=path.stem)
    if reference is not None:
        raise NotGradable(f"{reference} holds no {path.name}: give the course's copy of this exercise")
    entries = course()
    entry = identify(nb, path.stem, entries)
    if entry is None and any(p.stem == path.stem for p in course_exercises()):
        raise NotGradable(f"{path.name} is in this checkout's exercises/ but not in the grader's copy of the course "
                          "(minikv/classroom/course.json): run `minikv release --registry`")
    if entry is None:
        raise NotGradable(f"{path.name} is not one of the course's exercises ({len(entries)} known: "
                          f"{', '.join(sorted(entries)[:3])}, ...); the grader runs only the course's own checks. "
                          "For an exercise of your own, give its copy: --reference YOUR_COPY.ipynb")
    return entry


@dataclass
class Plan:
    entry: Entry
    cells: list[Cell]               # the learner's cells that run (phase 1)
    where: list[int | None]         # each course check: the index of its cell in the learner's notebook
    notes: list[str]
    attempted: bool
    review: list[str]
    untouched: bool                 # every code cell is one of the course's, the stubs as handed out
    setup_at: dict[int, int]        # a course setup cell (its position in the course) -> its index in the notebook


def plan(path: Path, reference: Path | None = None) -> Plan:
    """What grading `path` runs: the learner's cells less every check cell, then the course's cells.

    A learner's check cell is recognised by its tag, its cell id or its code: edited, replaced by a print,
    renumbered or pasted twice, it never runs; the course's checks do, once each."""
    nb = read_notebook(path)
    entry = _entry_for(path, nb, reference)
    cells = code_cells(nb)
    check_ids = {c.id for c in entry.checks}
    check_src = {normalised(c.source) for c in entry.checks}
    last = max((i for i, c in enumerate(entry.cells) if c.role == "exercise"), default=-1)
    late_setup = {normalised(c.source) for c in entry.cells[last + 1:] if c.role == "setup"}
    run, notes = [], []
    for c in cells:
        src = normalised(c.source)
        if c.role == "check" or c.id in check_ids or src in check_src:
            if c.role == "check" and c.id not in check_ids and src not in check_src:
                notes.append(f"cell {c.index}: a check cell the course does not have; the course's checks ran instead")
            continue
        if c.role != "exercise" and src in late_setup:  # the course runs it before its checks
            continue
        run.append(c)
    where = [_index_in(cells, chk) for chk in entry.checks]
    stubs = {normalised(c.source) for c in entry.cells if c.role == "exercise"}
    mine = [c for c in cells if c.role == "exercise"] or [c for c in run if c.role == "code"]
    attempted = any(normalised(c.source) not in stubs for c in mine)
    course_src = {normalised(c.source) for c in entry.cells}
    review = sorted({f"cell {c.index}: {s}" for c in cells if normalised(c.source) not in course_src
                     for s in suspect(c.source)})
    untouched = all(normalised(c.source) in course_src for c in run)  # check cells never run: they do not count
    ref = find_reference(path, reference)
    if ref is not None and ref.resolve() == path.resolve():
        untouched = False  # a notebook graded against itself (its own checks) runs
    setup_at = {k: at for k, c in enumerate(entry.cells)  # the course's setup cells in the notebook
                if c.role == "setup" and (at := _index_in(cells, c)) is not None}
    return Plan(entry, run, where, notes, attempted, review, untouched, setup_at)


def _index_in(cells: list[Cell], course_cell: CourseCell) -> int | None:
    """Where one of the course's cells sits in the learner's notebook: by its cell id, else by its code (the
    first such cell); None when it is not there."""
    if course_cell.id:
        at = next((c.index for c in cells if c.id == course_cell.id), None)
        if at is not None:
            return at
    src = normalised(course_cell.source)
    return next((c.index for c in cells if normalised(c.source) == src), None)


class _Reader(threading.Thread):
    """Drain a pipe, keeping the end of it (`keep` characters) or its JSON lines (at most `max_bytes`)."""

    def __init__(self, stream, keep: int = 0, max_bytes: int = 8 << 20):
        super().__init__(daemon=True)
        self.stream, self.keep, self.max_bytes = stream, keep, max_bytes
        self.tail, self.events, self.garbled, self.read = b"", [], 0, 0

    def run(self) -> None:
        try:
            for line in self.stream:
                self.read += len(line)
                if self.keep:
                    self.tail = (self.tail + line)[-self.keep:]
                elif self.read <= self.max_bytes:
                    try:
                        self.events.append(json.loads(line))
                    except ValueError:
                        self.garbled += 1
        except (OSError, ValueError):
            pass


NOT_ATTEMPTED = "not attempted: every cell is the course's own, the stubs unchanged (not run: a stub fails every check)"


def grade_notebook(path: str | Path, timeout: float = DEFAULT_TIMEOUT, reference: Path | None = None,
                   threads: int | None = 1, memory_gb: float | None = DEFAULT_MEMORY_GB,
                   run_untouched: bool = False, warm: WarmProcess | None = None) -> Grade:
    """Run one exercise notebook in a fresh process (or one forked by `warm`), then the course's checks on
    what it defined.

    A notebook whose every cell is the course's (an exercise handed back as it was handed out) scores 0
    without running, unless run_untouched."""
    path = Path(path)
    grade = Grade(exercise=path.stem, path=str(path))
    try:
        p = plan(path, reference)
    except NotGradable as e:
        grade.error = str(e)
        try:
            grade.max_known = _entry_for(path, {"cells": []}, reference).max_points
        except NotGradable:
            grade.max_known = 0.0
        return grade
    grade.exercise, grade.notes, grade.attempted, grade.review = p.entry.name, list(p.notes), p.attempted, p.review
    if p.untouched and not run_untouched:
        grade.checks = [CheckResult(k, at, c.source, c.points, False, NOT_ATTEMPTED)
                        for k, (c, at) in enumerate(zip(p.entry.checks, p.where), start=1)]
        return grade
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="minikv-notebook-") as work, ExitStack() as fresh:
        shutil.copy(path, Path(work) / path.name)  # the notebook alone: nothing of its folder or the checkout
        course_plan = {"cwd": work, "env": p.entry.env, "threads": threads,
                       "memory": int(memory_gb * 2**30) if memory_gb else None,
                       "cells": [{"index": c.index, "source": c.source, "role": c.role} for c in p.cells],
                       "course": p.entry.to_dict()}
        r, w = os.pipe()
        try:
            proc = warm.fork(p.entry.env, w) if warm is not None else None
            if proc is not None:
                package, digest = warm.package, warm.digest
            else:  # a fresh process, with a package copy of its own
                package = Path(fresh.enter_context(tempfile.TemporaryDirectory(prefix="minikv-grader-")))
                fresh.callback(_writable, package)
                digest = package_copy(package)
                proc = _start_fresh(package, work, w)
        finally:
            os.close(w)
        events = _Reader(os.fdopen(r, "rb"))
        log = _Reader(proc.stdout, keep=LOG_KEPT)
        events.start()
        log.start()
        try:
            try:
                proc.stdin.write(json.dumps(course_plan).encode())
                proc.stdin.close()
            except BrokenPipeError:
                pass
            try:
                code, timed_out = proc.wait(timeout=timeout), False
            except subprocess.TimeoutExpired:
                _kill(proc)
                code, timed_out = proc.returncode, True
            try:  # whatever the notebook started and left running (it would hold the pipes open)
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        except BaseException:  # Ctrl-C: the notebook's own session would outlive us
            _kill(proc)
            raise
        events.join(10)
        log.join(10)
        changed_on_disk = _digest(package / "minikv") != digest
        if changed_on_disk and warm is not None:
            warm.close()  # no later notebook imports what this one wrote
    grade.seconds = time.perf_counter() - start
    if changed_on_disk:
        grade.flags.append("changed the grader's copy of minikv on disk (a checker's file): its checks score 0")
    _collect(grade, p, events, code, timed_out, timeout, log.tail.decode("utf-8", "replace").strip()[-600:],
             changed_on_disk)
    return grade


def _start_fresh(package: Path, work: str, events_fd: int) -> subprocess.Popen:
    """`python runner.py FD` from the package copy, in its own session, the notebook's folder its cwd."""
    python = [sys.executable] + (["-S"] if sys.flags.no_site else [])  # the child imports as we do
    return subprocess.Popen([*python, str(package / "minikv" / "classroom" / "runner.py"), str(events_fd)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            pass_fds=(events_fd,), cwd=work, env=_child_env(package), start_new_session=True)


def _collect(grade: Grade, p: Plan, events: _Reader, code: int | None, timed_out: bool, timeout: float,
             log_tail: str, changed_on_disk: bool = False) -> None:
    cells: dict[int, dict] = {}
    setups: dict[int, str] = {}  # notebook index -> what the course's setup cell printed
    checks: dict[int, dict] = {}
    running, done, fatal, odd = None, False, None, []
    for e in events.events:
        if not isinstance(e, dict):
            odd.append("a line that is not an event")
        elif done:
            odd.append("an event after the last")
        elif "running" in e:
            running = str(e["running"])
        elif "cell" in e and isinstance(e["cell"], dict):
            cells.setdefault(e["cell"].get("index"), e["cell"])
        elif "setup" in e and isinstance(e["setup"], dict):
            at = p.setup_at.get(e["setup"].get("cell"))
            if at is not None:
                setups.setdefault(at, str(e["setup"].get("output") or ""))
        elif "answer" in e and isinstance(e["answer"], dict):
            a = e["answer"]
            if a.get("engine"):
                grade.flags.append(f"`{a.get('name')}` is the engine's own {a['engine']} (or a wrapper over it), "
                                   "not your code: its checks score 0")
            elif a.get("missing"):
                grade.notes.append(f"your notebook defines no `{a.get('name')}` (its exercise cell is missing or "
                                   "did not run)")
        elif "check" in e and isinstance(e["check"], dict):
            n = e["check"].get("number")
            if n in checks:
                odd.append(f"check {n} reported twice")
            elif n != len(checks) + 1:
                odd.append(f"check {n} reported out of order")
            else:
                checks[n] = e["check"]
        elif e.get("done") is True:
            done = True
        elif "fatal" in e:
            fatal = str(e["fatal"])
    if events.garbled:
        odd.append(f"{events.garbled} lines that are not the grader's")
    if odd:
        grade.flags.append("the grader's results channel was written by the notebook's code ("
                           + "; ".join(sorted(set(odd))) + "): its checks score 0")
    grade.outputs = setups | {i: str(rec.get("output") or "") for i, rec in cells.items() if isinstance(i, int)}
    for c in p.cells:
        rec = cells.get(c.index)
        if rec and rec.get("error") and "raises-exception" not in c.tags:
            what = "your exercise cell" if c.role == "exercise" else "a cell"
            grade.notes.append(f"cell {c.index} ({what}) raised: {rec['error']}")
    stopped = this = None
    if not done:
        if timed_out:
            this = f"ran past the notebook's {timeout:g} s limit (a loop that never ends?); its process was stopped"
            stopped = f"did not run: {running or 'the notebook'} was still running when the notebook reached its " \
                      f"{timeout:g} s limit"
        else:
            how = (f"was killed by signal {-code}" + (" (out of memory?)" if code == -signal.SIGKILL else "")
                   if code is not None and code < 0 else f"ended (exit code {code})")
            last = f"; its last output: {log_tail}" if log_tail else ""
            this = f"the notebook's process {how} in {running or 'its first cell'}{last}"
            stopped = f"did not run: the notebook's process {how} in {running or 'its first cell'}{last}"
        if fatal:
            this = stopped = fatal
        if running and running.startswith("cell "):
            grade.notes.append(f"{running}: {this}")
    engine = any(f.startswith("`") for f in grade.flags)
    for k, (chk, at) in enumerate(zip(p.entry.checks, p.where), start=1):
        rec = checks.get(k)
        if rec is None:
            message = this if running == f"check {k}" else stopped or "did not run"
            grade.checks.append(CheckResult(k, at, chk.source, chk.points, False, message or "did not run"))
            continue
        output = str(rec.get("output") or "").strip().splitlines()
        error = rec.get("error")
        message = str(error) if error else (output[-1] if output else "")
        passed = error is None
        flag = None
        if rec.get("tampered"):
            flag = "changed the grader's or the engine's code: " + ", ".join(map(str, rec["tampered"][:6]))
        elif engine or changed_on_disk:
            flag = grade.flags[0]
        elif odd:
            flag = grade.flags[-1]
        if flag is not None:
            passed, message = False, f"{flag}\n{message}".strip()
            if not any(f.startswith("changed the grader") for f in grade.flags) and rec.get("tampered"):
                grade.flags.append(flag)
        grade.checks.append(CheckResult(k, at, chk.source, chk.points, passed, message, flag))


def grade_notebooks(paths: list[Path], timeout: float = DEFAULT_TIMEOUT, reference: Path | None = None,
                    jobs: int = 1, on_done=None, memory_gb: float | None = DEFAULT_MEMORY_GB,
                    run_untouched: bool = False, fork: bool | None = None) -> list[Grade]:
    """Grade several notebooks, `jobs` processes at a time; results in the order of `paths`. on_done(grade)
    is called as each notebook finishes, one call at a time (two graders finishing together never run it
    at once: the CLI's callback merges each student's row into the CSV).

    Each job forks its notebooks' processes from a warm server (WarmProcess) when there are several
    notebooks (fork=None), or even one (fork=True); never with fork=False, on a system other than Linux
    or with MINIKV_GRADER_FORK=0 in the environment: then each notebook starts a fresh process."""
    jobs = max(1, min(jobs, len(paths) or 1))
    threads = max(1, (os.cpu_count() or 1) // jobs) if jobs > 1 else 1
    one_at_a_time = threading.Lock()
    warm = forkserver.available() and (len(paths) > 1 if fork is None else fork)  # one notebook: nothing shared
    slots: queue.SimpleQueue[WarmProcess | None] = queue.SimpleQueue()
    servers = [WarmProcess(threads) if warm else None for _ in range(jobs)]
    for s in servers:
        slots.put(s)

    def one(p: Path) -> Grade:
        slot = slots.get()
        try:
            g = grade_notebook(p, timeout=timeout, reference=reference, threads=threads, memory_gb=memory_gb,
                               run_untouched=run_untouched, warm=slot)
        finally:
            slots.put(slot)
        if on_done is not None:
            with one_at_a_time:
                on_done(g)
        return g

    try:
        with ThreadPoolExecutor(jobs) as pool:
            return list(pool.map(one, paths))
    finally:
        for s in servers:
            if s is not None:
                s.close()

