"""Run a learner's notebook, then the course's checks on what it defined, in this fresh process.

    python runner.py FD  < PLAN.json       (started by minikv.classroom.check, by its path, not `-m`)
    python runner.py --serve SOCKET THREADS  a fork server: main's imports once, then main in a child per
                                            notebook (minikv/classroom/forkserver.py)

PLAN.json    {"cwd", "env", "memory", "threads", "cells": [{"index", "source", "role"}], "course": {...}}
FD           a pipe to the grader: one JSON line per event, written as it happens:
             {"running": "cell 4"}, {"cell": {...}}, {"setup": {...}}, {"answer": {...}}, {"check": {...}},
             {"done": true}

Two phases:
1. the learner's cells, in order, as a kernel runs them (never their check cells: those are the course's);
2. the course's cells (minikv/classroom/registry.py) in a new namespace, with the checkers imported
   afresh (minikv.checks is dropped from sys.modules first): its setup cells, the learner's objects where
   the course has an exercise cell, its check cells. Around each check the grader compares the
   checkers, the engine, torch and builtins with what they were (minikv/classroom/guard.py).
The process ends with os._exit right after its last event: an atexit hook of the learner never runs.
A cell's exception, SystemExit (exit(), sys.exit()) included, is recorded and the next cell runs.
"""
from __future__ import annotations

import ast
import asyncio
import builtins
import contextlib
import inspect
import io
import json
import linecache
import os
import sys
import time
import traceback

OUTPUT_KEPT = 2000  # characters of a cell's printed output kept for the report (the end of it)


class Tail(io.TextIOBase):
    """A stream that keeps only the last `keep` characters written to it (a cell printing 200 MB costs nothing)."""

    def __init__(self, keep: int = OUTPUT_KEPT):
        self.keep, self.text = keep, ""

    def writable(self) -> bool:
        return True

    def write(self, s) -> int:
        s = str(s)
        self.text = (self.text + s)[-self.keep:]
        return len(s)

    def getvalue(self) -> str:
        return self.text


def _explain(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"the cell called exit() or sys.exit({'' if exc.code is None else repr(exc.code)})"
    report = sys.modules.get("minikv.checks.report")
    if report is not None:  # the notebook ran a checker: it knows its failures and the stubs
        try:
            return report.explain(exc)
        except Exception:  # noqa: BLE001  a broken explanation must not lose the error
            pass
    text = f"{type(exc).__name__}: {exc}"
    mine = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename.startswith("<cell ")]
    if mine:
        f = mine[-1]
        at = f"{f.filename[1:-1]}, line {f.lineno}"
        text += f"\nraised in {at if f.name == '<module>' else f'{f.name} ({at})'}: {(f.line or '').strip()}"
    return text


def _shell():
    """An IPython shell for magics (%time, !cmd) and get_ipython(); None without IPython."""
    try:
        from IPython.core.interactiveshell import InteractiveShell
    except ImportError:
        return None
    shell = InteractiveShell.instance()
    if not hasattr(shell, "ask_exit"):  # exit() and quit() ask the shell to end (a kernel's shell has this)
        shell.ask_exit = lambda: setattr(shell, "exit_now", True)
    return shell


def _run(source: str, name: str, namespace: dict, shell) -> tuple[str | None, str, float]:
    """Run one cell's source: (its error explained or None, the end of its output, seconds)."""
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)  # tracebacks show the line
    out, error, start = Tail(), None, time.perf_counter()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = shell.transform_cell(source) if shell is not None else source
            compiled = compile(code, name, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
            ran = eval(compiled, namespace)  # noqa: S307  the learner's notebook, as a kernel runs it
            if inspect.iscoroutine(ran):
                asyncio.run(ran)
    except BaseException as e:  # noqa: BLE001  SystemExit and KeyboardInterrupt too: recorded, never fatal
        error = _explain(e)
    if shell is not None and shell.exit_now:  # exit() in IPython asks the shell to end after the cell
        shell.exit_now = False
        error = error or "the cell called exit()"
    return error, out.getvalue(), round(time.perf_counter() - start, 3)


def _limit(plan: dict) -> None:
    """Memory (address space) and threads, before any of the notebook's imports."""
    if plan.get("memory"):
        try:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (int(plan["memory"]), int(plan["memory"])))
        except (ImportError, ValueError, OSError):
            pass
    os.environ.update(plan.get("env", {}))
    threads = plan.get("threads")
    if threads:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            os.environ[var] = str(threads)


def _sanitize_path(cwd: str) -> None:
    """sys.path as a kernel started in the notebook's folder, less any folder holding another minikv checkout."""
    keep = [p for p in sys.path[1:] if p and not os.path.isfile(os.path.join(p, "pyproject.toml"))]
    sys.path[:] = [cwd, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p], *keep]
    sys.path[:] = list(dict.fromkeys(sys.path))


def main(fd: int) -> int:
    plan = json.loads(sys.stdin.read())
    channel = os.fdopen(fd, "w", buffering=1, encoding="utf-8")

    def send(event: dict) -> None:
        channel.write(json.dumps(event) + "\n")
        channel.flush()

    _limit(plan)
    os.chdir(plan["cwd"])
    _sanitize_path(plan["cwd"])
    try:  # torch and the engine before the learner's code: the guard's picture of them is the untouched one
        import torch

        if plan.get("threads"):
            torch.set_num_threads(int(plan["threads"]))
        import minikv  # noqa: F401
        from minikv.classroom import guard
    except Exception as e:  # noqa: BLE001  every check will say so
        send({"fatal": f"the grader could not import minikv: {type(e).__name__}: {e}"})
        os._exit(0)
    shell = _shell()
    untouched = guard.snapshot(skip_checks=True)
    package_path = list(sys.modules["minikv"].__path__)

    namespace = shell.user_ns if shell is not None else {"__name__": "__main__"}
    for cell in plan["cells"]:
        send({"running": f"cell {cell['index']}"})
        error, output, seconds = _run(cell["source"], f"<cell {cell['index']}>", namespace, shell)
        send({"cell": {"index": cell["index"], "role": cell["role"], "error": error, "output": output,
                       "seconds": seconds}})

    # ---- phase 2: the course's cells, the checkers imported afresh ----
    for name in [n for n in sys.modules if n == "minikv.checks" or n.startswith("minikv.checks.")]:
        del sys.modules[name]
    vars(sys.modules["minikv"]).pop("checks", None)
    sys.modules["minikv"].__path__ = list(package_path)  # the checkers come from the package, nowhere else
    course = plan["course"]
    course_ns: dict = {"__name__": "__main__", "__builtins__": builtins}
    answers = {n: m for c in course["cells"] if c["role"] == "exercise" for n, m in c.get("names", {}).items()}
    broken_setup = None
    number = 0
    baselines = [untouched]  # the untouched picture, then one before each check: a change to any stays found
    tampered: set[str] = set()
    for k, cell in enumerate(course["cells"]):
        if cell["role"] == "setup":
            send({"running": f"the course's setup cell {k}"})
            error, output, _ = _run(cell["source"], f"<course cell {k}>", course_ns, None)
            send({"setup": {"cell": k, "output": output}})
            if error is not None and broken_setup is None:
                broken_setup = f"the course's setup cell {k} failed: {error}"
        elif cell["role"] == "exercise":
            allowed = {id(v) for v in course_ns.values()}
            for name in cell.get("names", {}):
                if name not in namespace:
                    send({"answer": {"name": name, "missing": True}})
                    course_ns.pop(name, None)
                    continue
                obj = namespace[name]
                course_ns[name] = obj
                try:
                    engine = guard.engine_use(obj, answers, course.get("engine_answers", []), allowed)
                except Exception:  # noqa: BLE001  an object that breaks the inspection is the learner's own
                    engine = None
                send({"answer": {"name": name, "engine": engine}})
        else:
            number += 1
            send({"running": f"check {number}"})
            baselines.append(guard.snapshot())
            error, output, seconds = _run(cell["source"], f"<course check {number}>", course_ns, None)
            if error is not None and broken_setup is not None:
                error = f"{error}\n({broken_setup})"
            for snap in baselines:
                tampered.update(guard.changed(snap))
            send({"check": {"number": number, "error": error, "output": output, "seconds": seconds,
                            "tampered": sorted(tampered)}})
    send({"done": True})
    channel.close()
    sys.stdout.flush()
    os._exit(0)


def serve(sock_fd: int, threads: int) -> None:
    """What main imports before a notebook's code, once, under the same thread limit; then a forked child
    per notebook runs main, which finds them imported (minikv/classroom/forkserver.py)."""
    _limit({"threads": threads})
    _sanitize_path(os.getcwd())
    import torch  # noqa: F401  no torch work here: a fork must not inherit a thread pool

    import minikv  # noqa: F401
    from minikv.classroom import forkserver, guard  # noqa: F401

    try:
        from IPython.core import interactiveshell  # noqa: F401  the shell itself starts a thread: made per child
    except ImportError:
        pass
    forkserver.serve(sock_fd, main)


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve(int(sys.argv[2]), int(sys.argv[3]))
    else:
        sys.exit(main(int(sys.argv[1])))
