"""grade_notebooks forks each notebook's process from a warm server (minikv/classroom/forkserver.py); a
forked notebook is as isolated as one in a fresh process.

One run grades five small notebooks, one after another, from one job's server: `leaker` patches torch,
minikv, os.environ and sys and writes to every file descriptor it holds; `clean` checks nothing of that
reached it; `hang` starts a `sleep` and never ends; `writer` rewrites a checker in the server's copy of
the package; `after` checks it got a new one. Each notebook writes its pid, its parent's pid and a
random number (numpy's) to a file of the test's.
"""
from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest

from minikv.classroom import forkserver
from minikv.classroom.check import grade_notebooks

TIMEOUT = 15.0  # seconds per notebook: `hang` stops here, the others take a second or two

WHO = ("import os, numpy\n"
       "open({file!r}, 'w').write(f'{{os.getpid()}} {{os.getppid()}} {{numpy.random.random()}}')\n")

LEAKER = """
import sys
import minikv
import torch

torch.allclose = lambda *args, **kwargs: True
minikv.LEAKED = True
os.environ["LEAKED"] = "1"
sys.leaked = True
for fd in range(3, 256):  # a forged answer to whatever the process holds open: only its events pipe is the grader's
    try:
        os.write(fd, b'{"exit": 0}\\n')
    except OSError:
        pass
"""

CLEAN = """
import os
import sys
import minikv
import minikv.checks.report as report
import torch

assert not torch.allclose(torch.zeros(1), torch.ones(1)), "torch.allclose is still patched"
assert not hasattr(minikv, "LEAKED") and "LEAKED" not in os.environ and not hasattr(sys, "leaked")
assert not hasattr(report, "LEAKED"), "the checker rewritten on disk was imported"
print("nothing leaked")
"""

HANG = """
import subprocess
import threading

child = subprocess.Popen(["sleep", "600"])
open({file!r}, "w").write(str(child.pid))
threading.Event().wait()  # never ends
"""

WRITER = """
import pathlib
import minikv

checker = pathlib.Path(minikv.__file__).parent / "checks" / "report.py"
os.chmod(checker.parent, 0o755)
os.chmod(checker, 0o644)
checker.write_text(checker.read_text() + "\\nLEAKED = True\\n")
"""


def _notebook(path: Path, exercise: str, check: str) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(exercise, metadata={"tags": ["exercise"]}),
                nbformat.v4.new_code_cell(check, metadata={"tags": ["check"]})]
    nbformat.write(nb, path)
    return path


def _who(folder: Path, name: str) -> tuple[int, int, float]:
    pid, ppid, rand = (folder / name).read_text().split()
    return int(pid), int(ppid), float(rand)


@pytest.fixture(scope="module")
def forked(tmp_path_factory):
    base = tmp_path_factory.mktemp("fork")
    course, who = base / "course", base / "who"
    course.mkdir()
    who.mkdir()
    paths = [_notebook(course / "leaker.ipynb", WHO.format(file=str(who / "leaker")) + LEAKER, "print('patched')"),
             _notebook(course / "clean.ipynb", WHO.format(file=str(who / "clean")), CLEAN),
             _notebook(course / "hang.ipynb", WHO.format(file=str(who / "hang")), HANG.format(file=str(who / "sleep"))),
             _notebook(course / "writer.ipynb", WHO.format(file=str(who / "writer")) + WRITER, "print('written')"),
             _notebook(course / "after.ipynb", WHO.format(file=str(who / "after")), CLEAN)]
    grades = grade_notebooks(paths, reference=course, jobs=1, timeout=TIMEOUT, fork=True)
    return {p.stem: g for p, g in zip(paths, grades)}, who


def test_each_notebook_is_forked_from_one_warm_server_not_started_by_the_grader(forked):
    _, who = forked
    servers = {name: _who(who, name)[1] for name in ("leaker", "clean", "hang", "writer")}
    assert len(set(servers.values())) == 1, servers  # one server for the job
    assert os.getpid() not in servers.values()
    pids = {_who(who, name)[0] for name in ("leaker", "clean", "hang", "writer", "after")}
    assert len(pids) == 5, "a process per notebook"
    randoms = {_who(who, name)[2] for name in ("leaker", "clean", "hang", "writer", "after")}
    assert len(randoms) == 5, "each child reseeds numpy's global generator, as a fresh process does"


def test_what_a_forked_notebook_patches_never_reaches_the_next(forked):
    grades, _ = forked
    assert grades["leaker"].flags and "torch.allclose" in grades["leaker"].checks[0].message  # the guard saw it
    assert grades["clean"].passed, grades["clean"].report()


def test_a_forked_notebook_that_hangs_is_stopped_with_what_it_started(forked):
    grades, who = forked
    hang = grades["hang"]
    assert not hang.checks[0].passed and f"ran past the notebook's {TIMEOUT:g} s limit" in hang.checks[0].message
    sleep = int((who / "sleep").read_text())
    try:
        state = Path(f"/proc/{sleep}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state in ("gone", "Z", "X"), f"the notebook's `sleep` outlived it (state {state})"


def test_a_notebook_that_changed_the_servers_package_copy_is_flagged_and_the_next_gets_a_new_server(forked):
    grades, who = forked
    assert any("changed the grader's copy of minikv on disk" in f for f in grades["writer"].flags)
    assert grades["after"].passed, grades["after"].report()
    assert _who(who, "after")[1] != _who(who, "writer")[1], "a new server, with a new copy of the package"


@pytest.mark.parametrize("how", ["MINIKV_GRADER_FORK=0", "fork=False", "a server never ready"])
def test_without_forking_each_notebook_starts_a_fresh_process_and_is_graded_the_same(how, tmp_path, monkeypatch):
    course = tmp_path / "course"
    course.mkdir()
    nb = _notebook(course / "clean.ipynb", WHO.format(file=str(tmp_path / "clean")), CLEAN)
    if how == "MINIKV_GRADER_FORK=0":
        monkeypatch.setenv("MINIKV_GRADER_FORK", "0")  # the variable wins over fork=True
    if how == "a server never ready":
        monkeypatch.setattr(forkserver, "READY_TIMEOUT", 0.001)  # its imports take far longer
    [g] = grade_notebooks([nb], reference=course, fork=how != "fork=False")
    assert g.passed, g.report()
    assert _who(tmp_path, "clean")[1] == os.getpid(), "started by the grader itself"
