"""The classroom tools: `minikv check` grades what a learner saved, `minikv grade` a class, `minikv release
--student` a copy without solutions; a failing check reads as its diagnosis in a notebook.

Fast tests use small notebooks written here. The tests marked slow run the course itself: every
solution passes `minikv check` and every untouched exercise fails it with a message (each notebook in
a process of its own, two at a time), then a class of two students and a student copy reuse the
fastest of those exercises.
"""
from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat
import pytest
import yaml

from minikv.classroom.check import grade_notebook, grade_notebooks
from minikv.classroom.release import release_student, render_workflow
from minikv.cli import main

ROOT = Path(__file__).resolve().parents[1]
EXERCISES = sorted((ROOT / "exercises").glob("*.ipynb"))
SOLVED = [p for p in EXERCISES if (ROOT / "solutions" / p.name).is_file()]
SITE = [sysconfig.get_paths()[k] for k in ("purelib", "platlib")]


def notebook(path: Path, *cells: tuple[str, list[str]] | tuple[str, list[str], dict]) -> Path:
    """Write a notebook of code cells (source, tags[, extra metadata])."""
    nb = nbformat.v4.new_notebook()
    for source, tags, *meta in cells:
        c = nbformat.v4.new_code_cell(source)
        c.metadata["tags"] = tags
        c.metadata.update(meta[0] if meta else {})
        nb.cells.append(c)
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def minikv(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 300):
    """The command line in a process of its own (it imports torch: a few seconds)."""
    return subprocess.run([sys.executable, "-m", "minikv.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """The command line in this process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


SQUARE = "def square(x):\n    return x * x\n"
STUB = "def square(x):\n    raise NotImplementedError('write square: x times x')\n"
CHECK = ("def check_square(fn):\n"
         "    for x in range(5):\n"
         "        if fn(x) != x * x:\n"
         "            raise AssertionError(f'square({x}): expected {x * x}, got {fn(x)}')\n"
         "    print('all 5 cases passed: square')\n")


def exercise(path: Path, body: str = STUB, check2: str = "check_square(square)") -> Path:
    return notebook(path, (CHECK, []), (body, ["exercise"]), ("check_square(square)", ["check"]),
                    (check2, ["check"], {"minikv": {"points": 2}}))


# ---- minikv check on small notebooks -------------------------------------------------------------

def test_check_passes_a_written_exercise_and_prints_one_json_line(tmp_path, capsys):
    course = exercise(tmp_path / "course" / "sq.ipynb")
    nb = exercise(tmp_path / "sq.ipynb", SQUARE)
    code, out, err = cli(capsys, "check", "--json", "--reference", str(course), str(nb))
    assert code == 0, out + err
    lines = out.strip().splitlines()
    assert len(lines) == 1
    assert json.loads(lines[0]) == {"exercise": "sq", "passed": True, "points": 3, "max_points": 3,
                                    "status": "passed", "flags": [], "message": "all 2 checks passed"}


def test_check_fails_a_stub_with_its_diagnosis_not_a_traceback(tmp_path, capsys):
    nb = exercise(tmp_path / "sq.ipynb")
    code, out, _ = cli(capsys, "check", "--reference", str(nb), str(nb))
    assert code == 1
    assert "sq: 0 of 3 points" in out
    assert "FAIL  check 1 of 2 (cell 2): check_square(square)" in out
    assert "NotImplementedError: write square: x times x" in out
    assert "raised in square (cell 1, line 2)" in out
    assert "Traceback" not in out


def test_a_stub_is_named_as_one():
    from minikv.checks.report import explain

    namespace: dict = {}
    exec(compile(STUB, "<cell 3>", "exec"), namespace)
    with pytest.raises(NotImplementedError) as info:
        namespace["square"](2)
    assert explain(info.value) == ("NotImplementedError: write square: x times x\nsquare (cell 3, line 2) is still "
                                   "a stub: write its body, run its cell, then the check again")


def test_check_grades_each_check_cell_and_names_the_first_difference(tmp_path):
    wrong = "def square(x):\n    return x + x\n"  # right at 0 and 2 only
    nb = exercise(tmp_path / "sq.ipynb", wrong, check2="assert square(2) == 4\nprint('square(2) is 4')")
    g = grade_notebook(nb, reference=nb)
    assert (g.points, g.max_points, g.passed) == (2, 3, False)
    assert [c.passed for c in g.checks] == [False, True]
    assert "square(1): expected 1, got 2" in g.checks[0].message
    assert g.checks[1].message == "square(2) is 4"


def test_saved_outputs_count_for_nothing(tmp_path):
    """nbval passes a wrong function saved with its outputs; the grader runs it."""
    path = exercise(tmp_path / "sq.ipynb", "def square(x):\n    return 0\n")
    nb = nbformat.read(path, as_version=4)
    for c in nb.cells:
        if "check" in c.metadata["tags"]:
            c.outputs = [nbformat.v4.new_output("stream", name="stdout", text="all 5 cases passed: square\n")]
    nbformat.write(nb, path)
    assert grade_notebook(path, reference=exercise(tmp_path / "course" / "sq.ipynb")).points == 0


def test_an_edited_check_cell_is_graded_with_the_course_one(tmp_path):
    course = exercise(tmp_path / "course" / "sq.ipynb")
    mine = notebook(tmp_path / "me" / "sq.ipynb", (CHECK, []), ("def square(x):\n    return 3\n", ["exercise"]),
                    ("print('all 5 cases passed: square')", ["check"]))  # the second check deleted too
    g = grade_notebook(mine, reference=course.parent)
    assert (g.points, g.max_points) == (0, 3)
    assert any("a check cell the course does not have" in n for n in g.notes)
    assert [c.cell for c in g.checks] == [None, None]  # neither of the course's checks is in the notebook
    assert "square(0): expected 0, got 3" in g.checks[0].message


def test_an_error_in_the_learners_code_names_its_line(tmp_path):
    nb = exercise(tmp_path / "sq.ipynb", "def square(x):\n    y = x * x\n    return y / 0\n")
    g = grade_notebook(nb, reference=nb)
    assert "ZeroDivisionError: division by zero" in g.checks[0].message
    assert "raised in square (cell 1, line 3): return y / 0" in g.checks[0].message


@pytest.mark.slow  # over 6 s on a 2-core machine: make test runs it, make test-fast leaves it out
def test_a_hanging_cell_stops_at_the_notebooks_time_limit(tmp_path, capsys):
    nb = notebook(tmp_path / "hang.ipynb", ("x = 1", ["exercise"]), ("print('first')", ["check"]),
                  ("import threading\nthreading.Event().wait()  # never ends", ["check"]),
                  ("print('never')", ["check"]))
    code, out, _ = cli(capsys, "check", "--json", "--timeout", "15", "--reference", str(nb), str(nb))
    assert code == 1
    result = json.loads(out)
    assert (result["points"], result["max_points"]) == (1, 3)
    assert "ran past the notebook's 15 s limit" in result["message"]
    assert "did not run: check 2 was still running" in result["message"]


def test_the_grader_keeps_what_each_cell_printed_and_the_grading_tests_hold_it_to_the_stored_outputs(tmp_path):
    """The grading tests stand in for nbval on the notebooks they grade (the root conftest.py): what each
    cell printed, the learner's cells and the course's setup cells run only before its checks alike, must
    be the notebook's stored output as nbval compares it."""
    nb = notebook(tmp_path / "pr.ipynb", ("print('early', 2 + 1)", []), ("def f():\n    return 1", ["exercise"]),
                  ("assert f() == 1\nprint('checked')", ["check"]), ("print('late', 7)", []))
    g = grade_notebook(nb, reference=nb)
    assert g.passed
    assert g.outputs == {0: "early 3\n", 1: "", 3: "late 7\n"}  # cell 3 ran only in the course's phase
    assert "outputs" not in g.to_dict()

    def stored(early: str, late_output):
        book = nbformat.read(nb, as_version=4)
        book.cells[0].outputs = [nbformat.v4.new_output("stream", name="stdout", text=early)]
        book.cells[3].outputs = [late_output]
        nbformat.write(book, nb)

    stored("early 3\n", nbformat.v4.new_output("stream", name="stdout", text="late 7\n"))
    assert_prints_as_stored(nb, g)
    stored("early 3\n", nbformat.v4.new_output("stream", name="stdout", text="late 8\n"))
    with pytest.raises(AssertionError, match="cell 3"):
        assert_prints_as_stored(nb, g)
    stored("early 3\n", nbformat.v4.new_output("execute_result", data={"text/plain": "7"}, execution_count=4))
    with pytest.raises(AssertionError, match="the grader only what it prints"):
        assert_prints_as_stored(nb, g)


def test_exit_in_a_learners_cell_ends_only_that_cell(tmp_path):
    nb = notebook(tmp_path / "ex.ipynb", ("def f():\n    return 1\nexit()", ["exercise"]),
                  ("assert f() == 1\nprint('ok')", ["check"]), ("import sys\nsys.exit(3)", ["check"]),
                  ("import os\nos._exit(0)", []), ("print('after')", ["check"]))
    g = grade_notebook(nb, reference=nb)
    assert [c.passed for c in g.checks] == [True, False, False]
    assert "cell 0 (your exercise cell) raised: the cell called exit()" in g.notes
    assert g.checks[1].message == "the cell called exit() or sys.exit(3)"
    assert g.checks[2].message.startswith("did not run: the notebook's process ended (exit code 0) in the course's "
                                          "setup cell 3")


@pytest.mark.parametrize("setup, says", [
    (lambda d: d / "absent.ipynb", "absent.ipynb: no such file"),
    (lambda d: notebook(d / "plain.ipynb", ("print(1)", [])), "is not one of the course's exercises"),
    (lambda d: (d / "junk.ipynb").write_text("{not json") and d / "junk.ipynb", "is not a notebook"),
    (lambda d: d, "is a folder"),
])
def test_what_cannot_be_graded_exits_2_with_the_reason(tmp_path, setup, says, capsys):
    code, out, _ = cli(capsys, "check", "--json", str(setup(tmp_path)))
    assert code == 2
    result = json.loads(out)
    assert result["passed"] is False and result["points"] == 0 and says in result["message"]


def test_cells_tagged_solution_never_run(tmp_path):
    nb = notebook(tmp_path / "sq.ipynb", (CHECK, []), (STUB, ["exercise"]), (SQUARE, ["solution"]),
                  ("check_square(square)", ["check"]))
    assert grade_notebook(nb, reference=nb).points == 0


# ---- the diagnosis in a notebook -----------------------------------------------------------------

SHELL_PROBE = r"""
from IPython.core.interactiveshell import InteractiveShell
sh = InteractiveShell.instance()
sh.run_cell("from minikv.checks.report import fail")
sh.run_cell("fail('case 2 of 5: T=3', 'the output differs', 'first difference at position 1', 'scale?')")
print("=== tb")
sh.run_cell("%tb")
print("=== stub")
sh.run_cell("def f():\n    raise NotImplementedError('write f')\nf()")
print("=== own assert")
sh.run_cell("assert 1 == 2, 'mine'")
print("=== show all")
sh.run_cell("import minikv.checks.report as r\nr.SHOW_TRACEBACK = True\nfail('case 1', 'x', 'y')")
"""


def test_a_failing_check_shows_its_diagnosis_and_the_traceback_only_on_request():
    run = subprocess.run([sys.executable, "-c", SHELL_PROBE], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "NO_COLOR": "1"})
    parts = dict(p.split("\n", 1) for p in ("=== check\n" + run.stdout).split("=== ")[1:])
    check = parts["check"]
    assert "CheckFailed" in check and "case 2 of 5: T=3" in check and "hint: scale?" in check
    assert "Traceback" not in check and "report.py" not in check and "%tb shows it" in check
    assert "report.py" in parts["tb"], "%tb prints the whole traceback"
    assert "NotImplementedError" in parts["stub"] and "is still a stub" in parts["stub"]
    assert "report.py" not in parts["stub"]
    assert "Traceback" in parts["own assert"] or "----> 1" in parts["own assert"], "a learner's own assert: as usual"
    assert "report.py" in parts["show all"]


# ---- minikv release --student (the real course; nothing runs) ------------------------------------

def _tags(cell) -> set[str]:
    return set(cell.get("metadata", {}).get("tags", []))


@pytest.fixture(scope="module")
def student_copy(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("release") / "course"
    assert main(["release", "--student", str(out)]) == 0
    return out


def test_release_holds_the_course_and_no_solution_or_instructor_file(student_copy):
    files = [p.relative_to(student_copy) for p in student_copy.rglob("*") if p.is_file()]
    assert files
    for f in files:
        assert not {"solutions", "instructor"} & set(f.parts), f
        assert f.parts[0] != "tests" or f.suffix == ".py" and not f.name.startswith("test_"), f
    for folder in ("notebooks", "exercises"):
        assert sorted(p.name for p in (student_copy / folder).glob("*.ipynb")) == sorted(
            p.name for p in (ROOT / folder).glob("*.ipynb"))
    for name in ("pyproject.toml", "Makefile", "README.md", "minikv/cli.py", "minikv/classroom/runner.py",
                 "minikv/kernels/__init__.py", ".github/workflows/classroom.yml"):
        assert (student_copy / name).is_file(), name


def test_release_exercise_cells_are_the_stubs_and_no_cell_is_a_solution(student_copy):
    for path in student_copy.rglob("*.ipynb"):
        for cell in nbformat.read(path, as_version=4).cells:
            assert not _tags(cell) & {"solution", "instructor"}, f"{path}: a {sorted(_tags(cell))} cell"
    for path in EXERCISES:
        stub = [c.source for c in nbformat.read(path, as_version=4).cells if "exercise" in _tags(c)]
        shipped_nb = nbformat.read(student_copy / "exercises" / path.name, as_version=4)
        shipped = [c.source for c in shipped_nb.cells if "exercise" in _tags(c)]
        assert shipped == stub, f"{path.name}: an exercise cell of the student copy is not the stub"
        assert all(not c.get("outputs") and c.get("execution_count") is None
                   for c in shipped_nb.cells if c.cell_type == "code"), f"{path.name}: stored outputs shipped"
        solution = ROOT / "solutions" / path.name
        if solution.is_file():
            solved = [c.source for c in nbformat.read(solution, as_version=4).cells if "exercise" in _tags(c)]
            assert not set(solved) & set(shipped), f"{path.name}: a solution cell in the student copy"


def test_release_holds_back_the_interview_answers_and_says_so(student_copy):
    """The quiz's course answers (the instructor key's), drill references and fixed bug labs stay home; in the
    copy the quiz still runs on the questions beyond the course, and asking for a reference names why not."""
    pkg = student_copy / "minikv" / "interview"
    assert (pkg / "data" / "beyond.json").is_file() and not (pkg / "data" / "course.json").exists()
    assert list((pkg / "drill_files").glob("*_starter.py")) and not list((pkg / "drill_files").glob("*_reference.py"))
    assert list((pkg / "bug_files").glob("*_buggy.py")) and not list((pkg / "bug_files").glob("*_fixed.py"))
    env = {**os.environ, "PYTHONPATH": str(student_copy)}
    run = lambda *a: subprocess.run([sys.executable, "-m", "minikv.cli", *a], cwd=student_copy, env=env,  # noqa: E731
                                    capture_output=True, text=True, timeout=120)
    bank = run("quiz", "--export", "json")
    assert bank.returncode == 0 and json.loads(bank.stdout), bank.stderr
    shipped = [q for name in ("notebooks.json", "beyond.json", "interview.json")
               for q in json.loads((pkg / "data" / name).read_text())]  # the bank but the exercises' answers
    assert [q["id"] for q in json.loads(bank.stdout)] == [q["id"] for q in shipped]
    for args, word in ((("drill", "check", "gqa-attention", "--reference"), "reference"),
                       (("bugs", "check", "stale-prefix-entry", "--fixed"), "fixed code")):
        r = run(*args)
        assert r.returncode == 2 and f"the {word} is not part of a student copy" in r.stderr, r.stderr


def test_release_never_mentions_solutions(student_copy):
    for path in [student_copy / "README.md", student_copy / "pyproject.toml", *student_copy.glob("*/*.ipynb")]:
        text = path.read_text()
        if path.suffix == ".ipynb":
            text = "".join("".join(c.source) for c in nbformat.read(path, as_version=4).cells
                           if c.cell_type == "markdown")
        assert "solutions/" not in text and "and solutions" not in text, path


def test_release_makefile_grades_the_exercises_and_refuses_to_overwrite(student_copy, capsys):
    text = (student_copy / "Makefile").read_text()
    assert "minikv.cli check" in text and "-m pytest" not in text
    assert "Student copy" in (student_copy / "README.md").read_text()
    assert "lab/settings" in text and (student_copy / "lab" / "settings" / "overrides.json").is_file()  # make lab's
    code, _, err = cli(capsys, "release", "--student", str(student_copy))
    assert code == 2 and "--force" in err
    other = student_copy.parent / "other"
    other.mkdir()
    (other / "thesis.txt").write_text("keep me")
    code, _, err = cli(capsys, "release", "--student", str(other), "--force")
    assert code == 2 and "not a previous student copy" in err and (other / "thesis.txt").is_file()


def test_release_leaves_out_instructor_and_solution_material_of_any_course(tmp_path):
    """A small course with every kind of thing that must not ship."""
    root = tmp_path / "course"
    for name, text in {"README.md": "# c\n\nExercises (with their twins in `solutions/`) here.\n\n"
                                    "## For teachers\n\nthe key is in instructor/\n\n## Next\n\nok\n",
                       "pyproject.toml": "",
                       "Makefile": "# runs the tests\ntest: model\n\tpytest tests\n\nlab:\n\tjupyter\n",
                       "minikv/__init__.py": "", "minikv/kernels/__init__.py": "", "instructor/key.md": "answers",
                       "tests/helper.py": "X = 1\n", "tests/test_secret.py": "", "solutions/e.ipynb": "{}",
                       "exercises/notes/instructor/x.md": "answers", "minikv/__pycache__/x.pyc": ""}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    notebook(root / "notebooks" / "n.ipynb", ("import helper", []), ("answer = 42", ["instructor"]))
    notebook(root / "exercises" / "e.ipynb", (STUB, ["exercise"]), (SQUARE, ["solution"]),
             ("check_square(square)", ["check"]))
    out = tmp_path / "out"
    release_student(out, root=root)
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == [".github/workflows/classroom.yml", ".minikv-student-release", "Makefile", "README.md",
                     "exercises/e.ipynb", "minikv/__init__.py", "minikv/kernels/__init__.py", "notebooks/n.ipynb",
                     "pyproject.toml", "tests/helper.py"]
    assert [c.source for c in nbformat.read(out / "exercises/e.ipynb", as_version=4).cells] == [
        STUB, "check_square(square)"]
    assert [c.source for c in nbformat.read(out / "notebooks/n.ipynb", as_version=4).cells] == ["import helper"]
    readme = (out / "README.md").read_text()
    assert "For teachers" not in readme and "## Next" in readme and "Student copy" in readme
    assert "Exercises here." in readme and "solutions/" not in readme
    assert "pytest" not in (out / "Makefile").read_text() and "lab:" in (out / "Makefile").read_text()


# ---- the GitHub Classroom workflow ---------------------------------------------------------------

def test_the_classroom_workflow_template_is_the_courses_own():
    """One test per check, worth the check's points: Classroom's total is `minikv grade`'s partial credit."""
    committed = (ROOT / "classroom" / "autograding.yml").read_text()
    assert committed == render_workflow(EXERCISES), (
        "classroom/autograding.yml is out of date with exercises/: regenerate it with "
        "`minikv release --workflow classroom/autograding.yml`")
    steps = yaml.safe_load(committed)["jobs"]["run-autograding-tests"]["steps"]
    tests = {s["with"]["test-name"]: s["with"] for s in steps if "autograding-command-grader" in s.get("uses", "")}
    for p in EXERCISES:
        checks = [c for c in nbformat.read(p, as_version=4).cells if "check" in _tags(c)]
        for k, c in enumerate(checks, start=1):
            test = tests.pop(f"{p.stem} check {k}")
            assert test["command"].endswith(f"--check {k} exercises/{p.name}"), test["command"]
            assert test["max-score"] == c.metadata.get("minikv", {}).get("points", 1)
    assert not tests, f"tests for no check: {sorted(tests)}"


def test_one_check_at_a_time_grades_the_notebook_once(tmp_path, capsys):
    """`check --results DIR --check K`: the first call grades, the next reads that grade (the notebook may be gone)."""
    wrong = "def square(x):\n    return x + x\n"  # check 1 fails, check 2 (square(2) == 4) passes
    nb = exercise(tmp_path / "sq.ipynb", wrong, check2="assert square(2) == 4\nprint('square(2) is 4')")
    results = tmp_path / "results"
    code, out, _ = cli(capsys, "check", "--reference", str(nb), "--results", str(results), "--check", "1", str(nb))
    assert code == 1 and "check 1 of 1" in out and "square(1): expected 1, got 2" in out
    nb.unlink()
    code, out, _ = cli(capsys, "check", "--json", "--results", str(results), "--check", "2", str(nb))
    assert code == 0 and json.loads(out)["points"] == 2, out


def test_a_week_released_alone_with_its_workflow_and_hints_withheld(tmp_path):
    out = tmp_path / "week4"
    assert main(["release", "--student", str(out), "--week", "4", "--hints", "2"]) == 0
    shipped = sorted(p.name for p in (out / "exercises").glob("*.ipynb"))
    assert shipped == sorted(p.name for p in EXERCISES if p.name.startswith("04"))
    names = {s["with"]["test-name"].split()[0] for s in yaml.safe_load(
        (out / ".github" / "workflows" / "classroom.yml").read_text())["jobs"]["run-autograding-tests"]["steps"]
        if "with" in s and "test-name" in s["with"]}
    assert names == {Path(n).stem for n in shipped}
    for name in shipped:
        text = (out / "exercises" / name).read_text()
        assert "Hint 2" in text and "Hint 3" not in text, name
    (out / ".git").mkdir()
    (out / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (out / ".venv").mkdir()
    assert main(["release", "--student", str(out), "--exercises", "06b", "--force"]) == 0
    assert (out / ".git" / "HEAD").is_file() and (out / ".venv").is_dir(), "--force keeps a template's .git, .venv"
    assert [p.name for p in (out / "exercises").glob("*.ipynb")] == ["06b_radix_match.ipynb"]


def test_the_graders_copy_of_the_course_is_the_courses_own():
    """The checks the grader trusts (inside the package) are exercises/' own: one entry per exercise."""
    from minikv.classroom.registry import COURSE_FILE, render

    assert COURSE_FILE.read_text(encoding="utf-8") == render(ROOT / "exercises"), (
        "minikv/classroom/course.json is out of date with exercises/: regenerate it with `minikv release --registry`")


# ---- --help of each verb -------------------------------------------------------------------------

@pytest.mark.parametrize("verb, says", [("check", "exit status: 0 every check passed"),
                                        ("grade", "one sub-folder per student"),
                                        ("release", "Never solutions/, instructor/")])
def test_each_classroom_verb_explains_itself(verb, says, capsys):
    with pytest.raises(SystemExit) as done:
        main([verb, "--help"])
    assert done.value.code == 0
    assert says in " ".join(capsys.readouterr().out.split())


# ---- the course itself (slow) --------------------------------------------------------------------

@pytest.fixture(scope="module")
def course_grades() -> dict[tuple[str, str], object]:
    """`minikv check` of every solution and every untouched exercise, two notebooks at a time."""
    paths = [ROOT / "solutions" / p.name for p in SOLVED] + EXERCISES
    grades = grade_notebooks(paths, jobs=2, run_untouched=True)  # the stubs run too: each check calls them
    return {(p.parent.name, p.name): g for p, g in zip(paths, grades)}


def fastest(course_grades, n: int) -> list[str]:
    """The n exercises whose solution and stub ran quickest (to reuse in the class and release tests)."""
    return sorted((p.name for p in SOLVED), key=lambda name: course_grades["solutions", name].seconds
                  + course_grades["exercises", name].seconds)[:n]


def stored_prints(path: Path, patterns) -> dict[int, str]:
    """What nbval would compare in each code cell of `path`: its stored printed text (stdout and stderr),
    sanitized with `patterns` as nbval sanitizes it (tests/nbval_sanitize.cfg). Cells nbval ignores or
    skips, check cells and cells that must raise are left out; a compared output other than printed text
    fails here, since the grader sees only what a cell prints."""
    from test_notebook_markers import markers, sanitized  # tests/ is on the path

    found = {}
    for index, cell in enumerate(nbformat.read(path, as_version=4).cells):
        kinds = markers(cell)[0]
        if cell.cell_type != "code" or not cell.get("outputs") or kinds & {"ignore", "skip", "raises"} \
                or "check" in _tags(cell):
            continue
        kinds_out = {o.output_type for o in cell.outputs}
        assert kinds_out == {"stream"}, (f"{path.name} cell {index}: nbval compares its {sorted(kinds_out)} "
                                         "outputs, the grader only what it prints: print it, or mark the cell "
                                         "# NBVAL_IGNORE_OUTPUT")
        found[index] = sanitized("".join(o.text for o in cell.outputs), patterns)
    return found


def assert_prints_as_stored(path: Path, g) -> None:
    """The graded run printed what the notebook stores, cell by cell, as nbval would have compared it
    (where a session grades a notebook, nbval leaves it to this: the root conftest.py)."""
    from test_notebook_markers import sanitized, sanitizers

    patterns = sanitizers()
    for index, want in stored_prints(path, patterns).items():
        assert index in g.outputs, f"{path.name} cell {index}: the grader did not run it"
        assert sanitized(g.outputs[index], patterns) == want, f"{path.name} cell {index}"


@pytest.mark.slow
@pytest.mark.parametrize("name", [p.name for p in SOLVED])
def test_every_solution_passes_minikv_check(course_grades, name):
    g = course_grades["solutions", name]
    assert g.passed, g.report()
    assert g.points == g.max_points > 0
    assert not g.notes, g.notes  # no other cell raised
    assert_prints_as_stored(ROOT / "solutions" / name, g)


@pytest.mark.slow
@pytest.mark.parametrize("name", [p.name for p in EXERCISES])
def test_every_untouched_exercise_fails_minikv_check_with_a_message(course_grades, name):
    g = course_grades["exercises", name]
    assert g.error is None, g.error
    assert not g.notes, g.notes  # no other cell raised: the stub fails at its checks and nowhere else
    assert g.points == 0 < g.max_points, g.report()
    for c in g.checks:
        assert not c.passed and c.message.strip(), f"check {c.number}: {c.message!r}"
        assert "Traceback" not in c.message
    assert_prints_as_stored(ROOT / "exercises" / name, g)


@pytest.mark.slow
def test_grade_a_class_of_a_solver_and_an_untouched_copy(course_grades, tmp_path):
    one, two = sorted(fastest(course_grades, 2))  # the grade table lists exercises by name
    course = tmp_path / "course"  # the exercises that count: two of the course's
    for name in (one, two):
        (course).mkdir(exist_ok=True)
        shutil.copy(ROOT / "exercises" / name, course / name)
    cls = tmp_path / "class"
    for name in (one, two):  # alice: a clone of her repository, both solved
        (cls / "alice" / "exercises").mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "solutions" / name, cls / "alice" / "exercises" / name)
    (cls / "bob").mkdir()
    shutil.copy(ROOT / "exercises" / one, cls / "bob" / one)  # bob: one untouched, the other missing
    out, junit = tmp_path / "grades.csv", tmp_path / "grades.xml"
    run = minikv("grade", str(cls), "--out", str(out), "--junit", str(junit), "--exercises", str(course))
    assert run.returncode == 0, run.stderr
    a, b = (Path(n).stem for n in (one, two))
    pa, pb = (course_grades["exercises", n].max_points for n in (one, two))
    full = pa + pb
    rows = list(csv.reader(out.open()))
    assert rows[0][:5] == ["student", a, b, "points", "max_points"]
    assert rows[1][:7] == ["alice", str(int(pa)), str(int(pb)), str(int(full)), str(int(full)), "passed", "passed"]
    assert rows[2][:7] == ["bob", "0", "0", "0", str(int(full)), "not attempted", "missing"]
    assert rows[3][0] == "total"
    suites = {s.get("name"): s for s in ET.parse(junit).getroot()}
    assert sorted(suites) == ["alice", "bob"]
    assert suites["alice"].get("failures") == "0" and suites["bob"].get("failures") == "2"
    bob = {c.get("name"): c for c in suites["bob"].iter("testcase")}
    assert "not attempted" in bob[a].find("failure").text
    assert bob[b].find("failure").text == f"missing: no {two} in bob/"
    assert "alice: " in run.stdout and "bob: 0 of" in run.stdout


@pytest.mark.slow
def test_the_checkers_work_in_the_student_copy(course_grades, student_copy, tmp_path):
    """From the copy alone (on PYTHONPATH, not the checkout): an untouched exercise fails, a solution passes."""
    name = fastest(course_grades, 1)[0]
    mine = tmp_path / "mine" / name
    mine.parent.mkdir()
    shutil.copy(ROOT / "solutions" / name, mine)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(student_copy), *SITE]), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)

    def check(path: Path):
        return subprocess.run([sys.executable, "-S", "-m", "minikv.cli", "check", "--json", str(path)],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)

    untouched = check(student_copy / "exercises" / name)
    assert untouched.returncode == 1, untouched.stdout + untouched.stderr
    result = json.loads(untouched.stdout)
    assert result["points"] == 0 and result["status"] == "not attempted", result
    printed = tmp_path / "printed" / name  # the solution with its check cells replaced by a print
    printed.parent.mkdir()
    nb = nbformat.read(ROOT / "solutions" / name, as_version=4)
    for c in nb.cells:
        if "check" in _tags(c):
            c.source = "print('all cases passed')"
    nbformat.write(nb, printed)
    assert json.loads(check(printed).stdout)["points"] == json.loads(check(mine).stdout)["points"]
    solved = check(mine)  # graded by the checks inside the package: no checkout, no --reference
    assert solved.returncode == 0, solved.stdout + solved.stderr
    assert json.loads(solved.stdout)["passed"] is True


# ---- written answers: collected for the teacher, never scored, shipped blank ----------------------

def _with_answer_cell(path: Path, answer: str = "") -> Path:
    """The small exercise with one written question under it and its answer cell."""
    from minikv.classroom.notebooks import WRITTEN, written_cell

    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_markdown_cell("## Questions an interviewer might ask\n\n1. Why x * x?"))
    cell = nbformat.v4.new_markdown_cell(written_cell(1, "Why x * x?", answer))
    cell.id, cell.metadata["tags"], cell.metadata["minikv"] = "written-q1", [WRITTEN], {"question": 1}
    nb.cells.append(cell)
    nbformat.write(nb, path)
    return path


def test_grade_collects_a_students_written_answer_for_the_teacher_and_scores_nothing_for_it(tmp_path):
    from minikv.classroom.grade import WRITTEN_COLUMN

    course = _with_answer_cell(exercise(tmp_path / "course" / "sq.ipynb"))
    cls = tmp_path / "class"
    _with_answer_cell(exercise(cls / "ann" / "sq.ipynb", SQUARE), "Because squaring is *x times x*.")
    _with_answer_cell(exercise(cls / "bob" / "sq.ipynb", SQUARE))  # solved, the question left blank
    out, feedback = tmp_path / "grades.csv", tmp_path / "feedback"
    run = minikv("grade", str(cls), "--out", str(out), "--feedback", str(feedback), "--exercises",
                 str(course.parent))
    assert run.returncode == 0, run.stderr
    by = {r["student"]: r for r in csv.DictReader(out.open())}
    assert by["ann"][WRITTEN_COLUMN] == "sq Q1" and by["bob"][WRITTEN_COLUMN] == ""
    assert by["ann"]["points"] == by["bob"]["points"] == "3", "a written answer adds no points"
    ann = (feedback / "ann.md").read_text()
    assert "not auto-scored" in ann and "**Q1.** Why x * x?" in ann and "Because squaring is *x times x*." in ann
    assert "_(no answer)_" in (feedback / "bob.md").read_text()


def test_release_ships_answer_cells_blank_whatever_the_released_copy_holds():
    from minikv.classroom.notebooks import ANSWER_PROMPT, WRITTEN, written_answers, written_cell
    from minikv.classroom.release import student_notebook

    filled = {"cell_type": "markdown", "id": "written-q1", "metadata": {"tags": [WRITTEN]},
              "source": written_cell(1, "Why x * x?", "a model answer", prompt="**Model answer:**")}
    shipped = student_notebook({"cells": [filled], "metadata": {}}, clear_outputs=True)["cells"][0]
    assert shipped["source"] == f"> **Q1.** Why x * x?\n\n{ANSWER_PROMPT}" and shipped["id"] == "written-q1"
    assert WRITTEN in shipped["metadata"]["tags"] and "model answer" in filled["source"], "the original is kept"
    assert [(w.question, w.answer) for w in written_answers({"cells": [shipped]})] == [("Why x * x?", "")]


def test_the_student_copy_keeps_every_answer_cell_and_each_is_blank(student_copy):
    from minikv.classroom.notebooks import written_answers

    for path in EXERCISES:
        ours = written_answers(json.loads(path.read_text()))
        theirs = written_answers(json.loads((student_copy / "exercises" / path.name).read_text()))
        assert ours, f"{path.name}: no answer cell"
        assert [(w.id, w.question) for w in theirs] == [(w.id, w.question) for w in ours], path.name
        assert all(w.answer == "" for w in theirs), f"{path.name}: an answer cell of the student copy is filled"


def test_graders_that_finish_together_report_one_at_a_time(monkeypatch):
    """grade_notebooks runs `jobs` graders on threads; their on_done calls never overlap (the CLI's callback
    merges each student's row into the CSV, and two at once lost a row)."""
    import threading

    import minikv.classroom.check as check

    together = threading.Barrier(2, timeout=30)

    def fake_grade(path, **_):
        together.wait()  # both graders finish at the same moment
        return check.Grade(exercise=Path(path).stem, path=str(path))

    monkeypatch.setattr(check, "grade_notebook", fake_grade)
    active, most = [0], [0]
    second_in = threading.Event()

    def on_done(_grade) -> None:
        active[0] += 1
        most[0] = max(most[0], active[0])
        if active[0] > 1:
            second_in.set()  # let in while the first is still inside: what must never happen
        else:
            second_in.wait(1.0)  # the first stays inside until the second comes in, or 1 s (it is kept out)
        active[0] -= 1

    grades = grade_notebooks([Path("a.ipynb"), Path("b.ipynb")], jobs=2, on_done=on_done)
    assert [g.exercise for g in grades] == ["a", "b"] and most[0] == 1


def test_a_course_cell_is_found_by_its_id_else_by_its_code_never_by_a_missing_id():
    """Where grading looks for the course's check and setup cells in a learner's notebook: the cell with the
    same id (moved or edited), else the first with the same code; a course cell without an id is found by
    its code, never by the first learner cell that has no id either."""
    from minikv.classroom.check import _index_in
    from minikv.classroom.notebooks import Cell
    from minikv.classroom.registry import CourseCell

    cells = [Cell(0, "x = 1", frozenset()), Cell(1, "check_it()", frozenset(), id="c1"),
             Cell(2, "check_other()", frozenset()), Cell(3, "print(x)", frozenset(), id="c9")]
    assert _index_in(cells, CourseCell("c9", "check", "something edited away")) == 3  # by id
    assert _index_in(cells, CourseCell("gone", "check", "check_it()")) == 1  # the id is gone: by code
    assert _index_in(cells, CourseCell("", "check", "check_other()")) == 2  # no id: by code, not cell 0
    assert _index_in(cells, CourseCell("", "setup", "import nothing")) is None
