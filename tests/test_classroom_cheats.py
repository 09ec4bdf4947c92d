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
from minikv.classroom.grade import grade_class, write_csv, write_junit

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
import sys

def nothing(*args, **kwargs):
    return None

def patch():
    for name, module in list(sys.modules.items()):
        if name.startswith("minikv.checks") and hasattr(module, "fail"):
            module.fail = nothing

patch()

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
    names, rows = grade_class(cls, exercises=course, jobs=2, timeout=300)
    write_csv(base / "grades.csv", names, rows)
    write_junit(base / "grades.xml", names, rows)
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


def test_the_engines_own_answer_scores_zero_and_is_flagged(graded):
    g = graded[0]["engine"].grades[TIERS]
    assert g.points == 0 and g.status == "flagged", g.report()
    assert "ReferenceTwoTierStore" in g.flags[0]


def test_the_csv_and_junit_name_each_flag(graded):
    rows, base = graded
    table = {r["student"]: r for r in csv.DictReader((base / "grades.csv").open())}
    assert "ReferenceTwoTierStore" in table["engine"]["flags"] and not table["honest"]["flags"]
    assert table["untouched"][f"{TIERS} status"] == "not attempted"
    ET.parse(base / "grades.xml")  # parses


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
    found = guard._qualname(obj) if guard._from_minikv(obj) else guard.engine_use(
        obj, {"match_prefix": []}, ["minikv.cache.prefix.radix:RadixCache"], set())
    assert (found is None) if engine is None else (engine in (found or "")), found
