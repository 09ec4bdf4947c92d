"""Grades a teacher can trust: a class of students who cheat, each way a real class tried, graded once.

The class (one `grade_class` run, two notebooks at a time) works on two exercises: `sq`, a small one of
this file whose checker fails through minikv.checks.report.fail, and the course's 10a (the cheapest on the
real engine). Every cheat scores 0 for the work it fakes, and those that touch the grader are flagged.
"""
from __future__ import annotations

import csv
import json
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat
import pytest

from minikv.classroom import guard
from minikv.classroom.check import CheckResult, Grade, grade_notebook, grade_notebooks
from minikv.classroom.grade import StudentGrades, grade_class, write_csv, write_feedback, write_junit
from minikv.cli import main

ROOT = Path(__file__).resolve().parents[1]
TIERS = "10a_two_tier_store"

SQ_SETUP = ("from minikv.checks.report import fail, passed\n\n"
            "def check_square(fn):\n"
            "    for x in range(5):\n"
            "        if fn(x) != x * x:\n"
            "            fail(f'case {x} of 5', f'square({x}) returned {fn(x)!r}', f'expected {x * x}')\n"
            "    passed(5, 'square')\n")
SQ_STUB = "def square(x):\n    raise NotImplementedError('write square')\n"
SQ_CHECK = "check_square(square)"

# atexit rewriting the results, the checker's name rebound, check cells replaced by a print
FORGER = SQ_STUB + """
import atexit, glob, json, os

def forge():
    fake = {"check": {"number": 1, "error": None, "output": "all 5 cases passed", "seconds": 0, "tampered": []}}
    for fd in range(3, 64):
        try:
            os.write(fd, (json.dumps(fake) + "\\n").encode())
        except OSError:
            pass
    for f in glob.glob("/tmp/**/result*.json", recursive=True):
        open(f, "w").write(json.dumps({"running": None, "finished": True, "cells": []}))

atexit.register(forge)
check_square = lambda fn: print("all 5 cases passed: square")
"""

# the teacher's solution read from the grading checkout (by minikv's own path, or up from the notebook)
READER = """
import json, os, pathlib
import minikv

places = [pathlib.Path(minikv.__file__).resolve().parents[1], *pathlib.Path.cwd().resolve().parents]
for place in places:
    key = place / "solutions" / "10a_two_tier_store.ipynb"
    if key.is_file():
        cells = json.loads(key.read_text())["cells"]
        exec("".join(next(c for c in cells if "exercise" in c["metadata"].get("tags", []))["source"]))
        break
"""

# the checker's `fail` patched to do nothing: in a cell, and again from inside the learner's own code
PATCHER = """
import os
import sys

def nothing(*args, **kwargs):
    return None

def patch():
    for name, module in list(sys.modules.items()):
        if name.startswith("minikv.checks") and hasattr(module, "fail"):
            module.fail = nothing

patch()

import minikv.checks.tiers as checker  # and a checker's file rewritten on disk

try:
    os.chmod(os.path.dirname(checker.__file__), 0o755)
    os.chmod(checker.__file__, 0o644)
    with open(checker.__file__, "a") as f:
        f.write("\\ndef fail(*args, **kwargs):\\n    return None\\n")
except OSError:
    pass

class TwoTierStore:
    def __init__(self, fast_blocks, slow_blocks):
        patch()
    def put(self, key, value):
        pass
    def get(self, key):
        return None
    def __contains__(self, key):
        return False
    def where(self, key):
        return None
"""

ENGINE = "from minikv.checks.tiers import ReferenceTwoTierStore as TwoTierStore\n"


def _notebook(path: Path, cells: list[tuple[str, list[str]]]) -> Path:
    nb = nbformat.v4.new_notebook()
    for source, tags in cells:
        c = nbformat.v4.new_code_cell(source)
        c.metadata["tags"] = tags
        nb.cells.append(c)
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def _tiers(path: Path, exercise: str | None = None, extra: list[str] = (), dup_checks: bool = False) -> None:
    """The course's 10a (the solution's code, or `exercise` in place of the stub)."""
    nb = nbformat.read(ROOT / ("solutions" if exercise is None else "exercises") / f"{TIERS}.ipynb", as_version=4)
    for c in nb.cells:
        if exercise is not None and "exercise" in c.metadata.get("tags", []):
            c.source = exercise
    if dup_checks:
        checks = [c for c in nb.cells if "check" in c.metadata.get("tags", [])]
        pasted = nbformat.from_dict(json.loads(json.dumps(checks[0])))
        pasted.id = "pasted-check"  # a copy keeps the code; Jupyter gives it a new id
        nb.cells.append(pasted)
    nb.cells += [nbformat.v4.new_code_cell(s) for s in extra]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    base = tmp_path_factory.mktemp("cheats")
    course = base / "course"
    _notebook(course / "sq.ipynb", [(SQ_SETUP, []), (SQ_STUB, ["exercise"]), (SQ_CHECK, ["check"])])
    shutil.copy(ROOT / "exercises" / f"{TIERS}.ipynb", course)
    cls = base / "class"
    tiers = f"{TIERS}.ipynb"
    # honest: 10a solved, with a check cell pasted twice; sq solved with its check cell renamed by hand
    _tiers(cls / "honest" / tiers, dup_checks=True)
    _notebook(cls / "honest" / "sq.ipynb", [(SQ_SETUP, []), ("def square(x):\n    return x * x\n", ["exercise"]),
                                             (SQ_CHECK + "  # my check", ["check"])])
    # untouched: both as handed out
    shutil.copy(course / "sq.ipynb", (cls / "untouched").mkdir(parents=True) or cls / "untouched" / "sq.ipynb")
    shutil.copy(course / tiers, cls / "untouched" / tiers)
    _notebook(cls / "forger" / "sq.ipynb", [(SQ_SETUP, []), (FORGER, ["exercise"]),
                                             ("print('all 5 cases passed: square')", ["check"])])
    _tiers(cls / "reader" / tiers, exercise=READER)
    fake = cls / "reader" / "minikv"  # a fake package beside the notebook whose checkers always pass
    for mod in ("__init__.py", "checks/__init__.py", "checks/report.py"):
        (fake / mod).parent.mkdir(parents=True, exist_ok=True)
        (fake / mod).write_text("def fail(*a, **k):\n    pass\n\ndef passed(*a, **k):\n    print('all passed')\n")
    shutil.copy(course / "sq.ipynb", cls / "reader" / "sq.ipynb")
    _tiers(cls / "patcher" / tiers, exercise=PATCHER)
    _tiers(cls / "engine" / tiers, exercise=ENGINE)
    seen: list[int] = []  # students in the CSV each time one finishes

    def finished(row) -> None:
        write_csv(base / "grades.csv", [Path(n).stem for n in sorted(p.name for p in course.glob("*.ipynb"))],
                  [row], merge=True)
        seen.append(sum(1 for r in csv.DictReader((base / "grades.csv").open()) if r["student"] != "total"))

    names, rows = grade_class(cls, exercises=course, jobs=2, timeout=300, on_student=finished)
    assert seen == list(range(1, len(rows) + 1)), seen  # written as each student finished, none lost
    write_junit(base / "grades.xml", names, rows)
    write_feedback(base / "feedback", names, next(r for r in rows if r.student == "engine"))
    return {r.student: r for r in rows}, base


def test_honest_work_keeps_every_point_and_a_pasted_check_cell_costs_nothing(graded):
    rows, _ = graded
    honest = rows["honest"]
    assert honest.points == honest.max_points == 3, {e: g.report() for e, g in honest.grades.items()}
    assert all(g.status == "passed" and not g.flags for g in honest.grades.values())


def test_untouched_work_is_not_attempted_rather_than_wrong(graded):
    rows, _ = graded
    assert {e: g.status for e, g in rows["untouched"].grades.items()} == {"sq": "not attempted",
                                                                          TIERS: "not attempted"}


def test_an_exit_hook_a_rebound_checker_and_printed_checks_score_nothing(graded):
    g = graded[0]["forger"].grades["sq"]
    assert g.points == 0, g.report()
    assert any("atexit" in r for r in g.review), g.review


def test_the_teachers_solutions_and_a_fake_minikv_beside_the_notebook_are_out_of_reach(graded):
    rows, _ = graded
    assert rows["reader"].points == 0, {e: g.report() for e, g in rows["reader"].grades.items()}
    tiers = rows["reader"].grades[TIERS]
    assert "name 'TwoTierStore' is not defined" in tiers.checks[0].message, tiers.report()  # no key was found


def test_patching_the_checkers_fail_scores_nothing_and_is_flagged(graded):
    g = graded[0]["patcher"].grades[TIERS]
    assert g.points == 0, g.report()
    assert g.status == "flagged" and any("fail" in (c.flag or "") for c in g.checks), g.report()
    assert any("on disk" in f for f in g.flags), g.flags


def test_the_engines_own_answer_scores_zero_and_is_flagged(graded):
    g = graded[0]["engine"].grades[TIERS]
    assert g.points == 0 and g.status == "flagged", g.report()
    assert "ReferenceTwoTierStore" in g.flags[0]


def test_the_csv_the_junit_and_the_feedback_name_each_flag(graded):
    rows, base = graded
    table = {r["student"]: r for r in csv.DictReader((base / "grades.csv").open())}
    assert "ReferenceTwoTierStore" in table["engine"]["flags"] and not table["honest"]["flags"]
    assert table["untouched"][f"{TIERS} status"] == "not attempted"
    assert table["honest"]["points"] == "3" and table["total"]["max_points"] == "3"
    ET.parse(base / "grades.xml")  # parses
    feedback = (base / "feedback" / "engine.md").read_text()
    assert "ReferenceTwoTierStore" in feedback and "flagged" in feedback


@pytest.mark.parametrize("answer, engine", [
    ("from minikv.cache.prefix.radix import match_prefix", "match_prefix"),
    ("from minikv.cache.prefix import radix\n\ndef match_prefix(root, token_ids, block_size):\n"
     "    return radix.match_prefix(root, token_ids, block_size)\n", "match_prefix"),
    ("import functools\nfrom minikv.cache.prefix.radix import match_prefix as m\nmatch_prefix = functools.partial(m)\n",
     "match_prefix"),
    ("from minikv.cache.prefix.radix import RadixCache\n\ndef match_prefix(root, token_ids, block_size):\n"
     "    return RadixCache(block_size).match(token_ids)\n", "RadixCache"),
    ("from minikv.cache.prefix.radix import Node\n\ndef match_prefix(root, token_ids, block_size):\n"
     "    node, blocks = root, []\n    return blocks, 0\n", None),
])
def test_a_wrapper_over_the_engines_answer_is_recognised(answer, engine):
    ns: dict = {}
    exec(compile(answer, "<cell 4>", "exec"), ns)
    obj = ns["match_prefix"]
    found = guard.engine_use(obj, {"match_prefix": []}, ["minikv.cache.prefix.radix:RadixCache"], set())
    assert (found is None) if engine is None else (engine in (found or "")), found


# ---- the teacher's tables (no notebook runs) -----------------------------------------------------

def _row(student: str, points: float, message: str = "") -> StudentGrades:
    g = Grade("sq", f"{student}/sq.ipynb", checks=[CheckResult(1, 2, SQ_CHECK, 1.0, points > 0, message)])
    return StudentGrades(student, {"sq": g})


def test_control_characters_in_a_students_output_keep_the_junit_xml_parseable(tmp_path):
    rows = [_row("ann", 0, "\x1b[31mred\x1b[0m and a NUL \x00 and \x07"), _row("bo", 1)]
    write_junit(tmp_path / "g.xml", ["sq"], rows)
    failure = ET.parse(tmp_path / "g.xml").getroot().find(".//failure").text
    assert "red and a NUL \\x00 and \\x07" in failure and "\x1b" not in failure


def test_grade_student_merges_one_row_into_the_csv(tmp_path):
    out = tmp_path / "g.csv"
    write_csv(out, ["sq"], [_row("ann", 0), _row("bo", 0)])
    write_csv(out, ["sq"], [_row("bo", 1)], merge=True)
    table = {r["student"]: r for r in csv.DictReader(out.open())}
    assert (table["ann"]["sq"], table["bo"]["sq"], table["total"]["sq"]) == ("0", "1", "0.5")


def test_grade_checks_the_output_path_before_grading(tmp_path, capsys):
    (tmp_path / "class" / "ann").mkdir(parents=True)
    code = main(["grade", str(tmp_path / "class"), "--out", str(tmp_path / "missing" / "g.csv")])
    assert code == 2 and "missing/ does not exist" in capsys.readouterr().err


def test_late_work_and_skipped_folders_are_reported(tmp_path):
    """A clone committed after the deadline is late; `_template` and `.cache` are named as skipped."""
    import subprocess

    course = tmp_path / "course"
    _notebook(course / "sq.ipynb", [(SQ_SETUP, []), (SQ_STUB, ["exercise"]), (SQ_CHECK, ["check"])])
    cls = tmp_path / "class"
    for d in ("ann", "_template", ".cache"):
        (cls / d).mkdir(parents=True)
    env = {"GIT_COMMITTER_DATE": "2026-03-02T10:00:00+00:00", "GIT_AUTHOR_DATE": "2026-03-02T10:00:00+00:00",
           "GIT_AUTHOR_NAME": "a", "GIT_AUTHOR_EMAIL": "a@b", "GIT_COMMITTER_NAME": "a", "GIT_COMMITTER_EMAIL": "a@b",
           "PATH": "/usr/bin:/bin"}
    subprocess.run(["git", "init", "-q"], cwd=cls / "ann", check=True, env=env)
    subprocess.run(["git", "commit", "-q", "--allow-empty", "-m", "x"], cwd=cls / "ann", check=True, env=env)
    from minikv.classroom.grade import parse_deadline

    said: list[str] = []
    _, rows = grade_class(cls, exercises=course, log=said.append, deadline=parse_deadline("2026-03-01"))
    assert [r.student for r in rows] == ["ann"] and rows[0].late is True
    assert rows[0].grades["sq"].status == "missing"
    assert any(".cache, _template" in line and "skipped" in line for line in said), said


@pytest.mark.parametrize("process", ["fresh", "forked"])
def test_a_notebook_is_held_to_its_memory_one_thread_and_its_output_is_kept_short(tmp_path, process):
    course = _notebook(tmp_path / "course" / "sq.ipynb", [(SQ_SETUP, []), (SQ_STUB, ["exercise"]),
                                                          (SQ_CHECK, ["check"]), ("import os\nos._exit(3)", [])])
    mine = _notebook(tmp_path / "me" / "sq.ipynb", [
        ("def square(x):\n    return x * x\n", ["exercise"]),
        ("hog = bytearray(6 * 2**30)", []),                                  # past the 4 GiB limit
        ("import os\nfor _ in range(400):\n    os.write(1, b'x' * 100_000)", []),  # 40 MB past the cell's capture
        ("print('y' * 10_000_000)", []),
        ("import torch\nassert torch.get_num_threads() == 1, torch.get_num_threads()", [])])  # one thread
    if process == "fresh":
        g = grade_notebook(mine, reference=course, memory_gb=4)
    else:  # by a fork server (minikv/classroom/forkserver.py), as grade_notebooks grades a class
        [g] = grade_notebooks([mine], reference=course, memory_gb=4, fork=True)
    assert g.checks[0].passed, g.report()
    assert [n for n in g.notes if "raised" in n] == [n for n in g.notes if "MemoryError" in n] != [], g.notes
    assert len(g.report()) < 5000, "every output is kept to its end"


def test_a_renamed_notebook_is_graded_by_the_course_checks_of_its_exercise(tmp_path):
    """Renamed, with its check cells replaced by a print, it is still 10a: the course's checks run."""
    from minikv.classroom.check import plan

    _tiers(tmp_path / "my_store.ipynb")
    nb = nbformat.read(tmp_path / "my_store.ipynb", as_version=4)
    for c in nb.cells:
        if "check" in c.metadata.get("tags", []):
            c.source = "print('all 308 cases passed')"
    nbformat.write(nb, tmp_path / "my_store.ipynb")
    p = plan(tmp_path / "my_store.ipynb")
    assert p.entry.name == TIERS and [c.source for c in p.entry.checks][0] == "check_two_tier_store(TwoTierStore)"
    assert not any("all 308 cases passed" in c.source for c in p.cells)
