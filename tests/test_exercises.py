"""Every exercise notebook has a solution twin, and the two never drift apart.

The convention (exercises/NN_x.ipynb and solutions/NN_x.ipynb, same name):
  tag `exercise`  the cells the learner completes: a stub ending in `raise NotImplementedError(...)`
                  in the exercise, the completed code in the solution, defining the same names
  tag `check`     cells that run a checker; in the exercise they also carry `raises-exception`
  every other cell is identical in both notebooks, in the same order

Run top to bottom, the exercise's check cells fail (the stubs are not written yet) and no other cell
does: proven by `minikv check` in tests/test_classroom.py. Every cell of the solution passes, with its
saved outputs: proven by nbval, which `make test` runs over solutions/ (running them here too would
double the suite's longest part). Pairs are discovered
by glob, so a new exercise is covered the day it is added.
"""
from __future__ import annotations

import ast
import json
from pathlib import Path

import nbformat
import pytest

from minikv.classroom.notebooks import split_written

ROOT = Path(__file__).resolve().parents[1]
EXERCISES = sorted(p.name for p in (ROOT / "exercises").glob("*.ipynb"))
SOLUTIONS = sorted(p.name for p in (ROOT / "solutions").glob("*.ipynb"))


def load(folder: str, name: str):
    return nbformat.read(ROOT / folder / name, as_version=4)


def tags(cell) -> set[str]:
    return set(cell.get("metadata", {}).get("tags", []))


def defined_names(source: str) -> set[str]:
    tree = ast.parse(source)
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))} | {
        t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}


def ends_in_not_implemented(body: list[ast.stmt]) -> bool:
    last = body[-1] if body else None
    if not isinstance(last, ast.Raise) or last.exc is None:
        return False
    exc = last.exc.func if isinstance(last.exc, ast.Call) else last.exc
    return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"


def is_stub(source: str) -> bool:
    """Every function the cell defines (or the cell itself, if it defines none) ends in raise NotImplementedError."""
    tree = ast.parse(source)
    funcs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    return all(ends_in_not_implemented(f.body) for f in funcs) if funcs else ends_in_not_implemented(tree.body)


def test_there_are_exercises_and_each_has_exactly_one_solution():
    assert EXERCISES, "no notebooks in exercises/"
    assert EXERCISES == SOLUTIONS, "exercises/ and solutions/ must hold notebooks of the same names"


@pytest.mark.parametrize("name", EXERCISES)
def test_exercise_and_solution_do_not_drift(name):
    ex, sol = load("exercises", name), load("solutions", name)
    assert len(ex.cells) == len(sol.cells), (
        f"{name}: {len(ex.cells)} cells in the exercise, {len(sol.cells)} in the solution")
    kinds = set()
    for i, (a, b) in enumerate(zip(ex.cells, sol.cells)):
        where = f"{name} cell {i}"
        assert a.cell_type == b.cell_type, f"{where}: {a.cell_type} in the exercise, {b.cell_type} in the solution"
        ta, tb = tags(a), tags(b)
        assert ta - {"raises-exception"} == tb, f"{where}: tags {sorted(ta)} vs {sorted(tb)}"
        kinds |= ta
        if "exercise" in ta:
            assert a.cell_type == "code", f"{where}: an exercise cell must be code"
            assert is_stub(a.source), f"{where}: the exercise stub must end in raise NotImplementedError(...)"
            assert "NotImplementedError" not in b.source, f"{where}: the solution still raises NotImplementedError"
            assert defined_names(a.source) == defined_names(b.source), (
                f"{where}: stub and solution define different names")
        elif "written-answer" in ta:  # the learner's prose answer: blank in the exercise, the model answer solved
            assert a.cell_type == b.cell_type == "markdown" and a.id == b.id, f"{where}: answer cells differ in kind"
            (qa, ans_a), (qb, ans_b) = split_written(a.source), split_written(b.source)
            assert qa == qb and ans_a == "" and ans_b, (
                f"{where}: the exercise's answer cell must be blank, the solution's hold the model answer")
        else:
            assert a.source == b.source, f"{where}: not an exercise cell, but its source differs"
        if "check" in ta:
            assert "raises-exception" in ta, f"{where}: a check cell of the exercise needs the raises-exception tag"
    assert {"exercise", "check"} <= kinds, f"{name}: needs at least one exercise cell and one check cell"


@pytest.mark.parametrize("name", EXERCISES)
def test_every_written_question_of_an_exercise_has_an_answer_cell_under_it(name):
    """One markdown cell per question the exercise asks, after the cell that asks them, in order, quoting the
    question, tagged written-answer with the id written-q<n>: what `minikv grade` collects for the teacher."""
    from minikv.classroom.notebooks import ANSWER_PROMPT, written_answers
    from minikv.interview.asked import questions_in_markdown

    nb = json.loads((ROOT / "exercises" / name).read_text())
    cells = nb["cells"]
    asking = [i for i, c in enumerate(cells) if c["cell_type"] == "markdown"
              and questions_in_markdown("".join(c["source"]))]
    asked = [q for i in asking for q in questions_in_markdown("".join(cells[i]["source"]))]
    assert asked, f"{name} asks no written question"
    written = written_answers(nb)
    assert [(w.id, w.number, w.question) for w in written] == [
        (f"written-q{n}", n, q) for n, q in enumerate(asked, 1)], f"{name}: run python instructor/answer_cells.py"
    first = next(i for i, c in enumerate(cells) if "written-answer" in c["metadata"].get("tags", []))
    assert first == asking[-1] + 1, f"{name}: the answer cells must follow the cell that asks the questions"
    for c in cells[first:first + len(written)]:
        assert "".join(c["source"]).rstrip().endswith(ANSWER_PROMPT), f"{name}: an answer cell not left blank"


def used_names(source: str) -> set[str]:
    return {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}


@pytest.mark.parametrize("name", EXERCISES)
def test_only_check_cells_hand_the_learners_code_to_the_engine(name):
    """A cell that builds an engine around the learner's function keeps the function it saw: fix the
    function, re-run only the check, and the check still runs the old one ("does check 1 pass?" forever).
    So the learner's names appear only in their own cells and in check cells, which pass them to the
    checker when they run (the checker builds the engine: `llm.derive(seam=fn)`)."""
    cells = load("exercises", name).cells
    learner: set[str] = set()
    for i, cell in enumerate(cells):
        if cell.cell_type != "code":
            continue
        if "exercise" in tags(cell):
            learner |= {n for n in defined_names(cell.source)}
            continue
        stale = used_names(cell.source) & learner
        assert "check" in tags(cell) or not stale, (
            f"{name} cell {i} uses {sorted(stale)}, defined by the learner, outside a check cell: it keeps "
            "the version it saw when it ran. Pass the function in the check cell instead "
            "(check_..._in_engine(llm, fn, ...) builds llm.derive(seam=fn) itself)")


HINT_TITLES = ("Hint 1 — a nudge", "Hint 2 — the idea", "Hint 3 — the formula")


@pytest.mark.parametrize("name", EXERCISES)
def test_every_stub_is_followed_by_three_collapsed_hints_before_its_check(name):
    """Hints in tiers (a nudge, the idea, the formula), collapsed, between each stub and the next check."""
    cells = load("exercises", name).cells
    stubs = [i for i, c in enumerate(cells) if "exercise" in tags(c)]
    for i in stubs:
        hints = cells[i + 1:i + 1 + len(HINT_TITLES)]
        for title, cell in zip(HINT_TITLES, hints):
            where = f"{name} cell {cells.index(cell)}"
            assert cell.cell_type == "markdown" and cell.source.startswith(f"#### {title}"), (
                f"{where}: expected the markdown cell '#### {title}' after the stub in cell {i}")
            assert cell.metadata.get("jupyter", {}).get("source_hidden") is True, (
                f"{where}: a hint must be collapsed (metadata jupyter.source_hidden = true)")
            assert len(cell.source.split("\n", 1)[-1].strip()) > 40, f"{where}: the hint says nothing"
        assert len(hints) == len(HINT_TITLES), f"{name}: the stub in cell {i} needs its three hints"
        nxt = next((j for j in range(i + 1, len(cells)) if tags(cells[j]) & {"check", "exercise"}), None)
        assert nxt is None or "check" in tags(cells[nxt]), f"{name}: the stub in cell {i} has no check after its hints"


def test_a_fixed_function_passes_when_only_its_cell_and_the_check_are_rerun():
    """The learner's path in 09b (tiny-random, seconds): run the exercise top to bottom (the checks fail on
    the stub), write the function, re-run its cell and the last check only: the check passes."""
    ex, sol = load("exercises", "09b_window_blocks.ipynb"), load("solutions", "09b_window_blocks.ipynb")
    ns: dict = {}
    checks = []
    for i, cell in enumerate(ex.cells):
        if cell.cell_type != "code":
            continue
        try:
            exec(compile(cell.source, f"<cell {i}>", "exec"), ns)
        except (AssertionError, NotImplementedError):
            assert "check" in tags(cell), f"cell {i} failed outside a check cell"
        if "check" in tags(cell):
            checks.append(i)
    for i, cell in enumerate(sol.cells):
        if "exercise" in tags(cell):
            exec(compile(cell.source, f"<cell {i}>", "exec"), ns)
    exec(compile(ex.cells[checks[-1]].source, f"<cell {checks[-1]}>", "exec"), ns)
