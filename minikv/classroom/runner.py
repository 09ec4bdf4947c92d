"""Run a notebook's cells in this fresh process, in order, as a kernel would; record what each did.

    python minikv/classroom/runner.py PLAN.json RESULT.json

Started by minikv.classroom.check, by its path (not `-m`): nothing of minikv is imported before the
notebook's own cells import it, so a first cell that sets TRITON_INTERPRET still comes first.

PLAN.json    {"cwd": folder, "cells": [{"index": i, "source": "...", "role": "check" | "exercise" | "code"}]}
RESULT.json  rewritten after each cell: {"running": i or null, "cells": [{"index", "role", "error",
             "output", "seconds"}], "finished": bool}; a parent that finds "running" set after the
             process ended knows which cell hung or ended the process.

A cell's exception, SystemExit (exit(), sys.exit()) included, is recorded and the next cell runs.
"""
from __future__ import annotations

import ast
import asyncio
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


def _write(path: str, state: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(state, f)
    os.replace(tmp, path)


def _explain(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"the cell called exit() or sys.exit({'' if exc.code is None else repr(exc.code)})"
    report = sys.modules.get("minikv.checks.report")
    if report is not None:  # the notebook ran a checker: it knows its failures and the stubs
        return report.explain(exc)
    # no checker imported (so no check failure to recognise): the error and the learner's line it came from
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


def main(plan_path: str, result_path: str) -> int:
    with open(plan_path, encoding="utf-8") as f:
        plan = json.load(f)
    os.chdir(plan["cwd"])
    sys.path[0] = plan["cwd"]  # as a kernel started in the notebook's folder (not this script's folder)
    shell = _shell()
    namespace = shell.user_ns if shell is not None else {"__name__": "__main__"}
    results: list[dict] = []
    for cell in plan["cells"]:
        _write(result_path, {"running": cell["index"], "cells": results, "finished": False})
        name, source = f"<cell {cell['index']}>", cell["source"]
        linecache.cache[name] = (len(source), None, source.splitlines(True), name)  # tracebacks show the line
        out, error, start = io.StringIO(), None, time.perf_counter()
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
        text = out.getvalue()
        results.append({"index": cell["index"], "role": cell["role"], "error": error,
                        "output": text[-OUTPUT_KEPT:], "seconds": round(time.perf_counter() - start, 3)})
    _write(result_path, {"running": None, "cells": results, "finished": True})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
