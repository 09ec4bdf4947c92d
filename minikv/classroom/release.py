"""`minikv release --student OUT`: the course as a student receives it, and its GitHub Classroom workflow.

What the student copy holds (everything else of the checkout stays out):

    README.md           with a line saying what this copy is; the "For teachers" section left out
    pyproject.toml, Makefile, .gitignore, minikv/               enough to `pip install -e .`;
                        the Makefile's test targets grade the exercises (`minikv check`) instead
    notebooks/          the course, with its stored outputs (pictures and measured runs to read first)
    exercises/          the stubs, every output cleared: an exercise opens clean, with no stored run
    benchmarks/         the recorded runs the notebooks read
    tests/<module>.py   only a module a notebook imports (the beam-search oracle of notebook 07)
    .github/workflows/classroom.yml     autograding: one test per check of each exercise, its points

Never: solutions/, instructor/ (the instructor key), the rest of tests/, and no cell tagged
`solution` or `instructor` in any notebook, nor a mention of solutions/. An answer cell under a written
question (tagged `written-answer`) ships with its question and its prompt only, never an answer. A
teacher may release one week's exercises (`week=4`: 04a, 04b) or a list of them, and withhold hints past
a level (`hints=2`).
"""
from __future__ import annotations

import ast
import fnmatch
import json
import re
import shutil
import subprocess
from pathlib import Path

from minikv.classroom.check import number
from minikv.classroom.notebooks import NEVER_RUN, WRITTEN, blank_written, course_root, tags_of
from minikv.classroom.registry import entry_of_notebook

MARKER = ".minikv-student-release"
KEPT_ON_FORCE = {".git", ".venv", "venv", ".env"}  # a template repository's history and environment
HINT = re.compile(r"^#### Hint (\d+)\b")
TOP_FILES = ["README.md", "GLOSSARY.md", "pyproject.toml", "Makefile", ".gitignore", "LICENSE", "LICENSE.md", "NOTICE"]
FOLDERS = ["minikv", "notebooks", "exercises", "benchmarks", "lab"]  # lab/: make lab's JupyterLab settings
NEVER_SHIPPED = {"solutions", "instructor", "__pycache__", ".ipynb_checkpoints", ".pytest_cache", ".hypothesis"}
# Answers that live inside the package for self-study (`minikv quiz`, `drill check --reference`, `bugs check
# --fixed`) but would hand a class the key: the bank's course questions carry the instructor key's answers,
# a drill's reference is an exercise solved, a lab's fixed file is its answer.
HELD_BACK = ("minikv/interview/data/course.json", "minikv/interview/drill_files/*_reference.py",
             "minikv/interview/bug_files/*_fixed.py")
STUDENT_NOTE = ("> **Student copy.** The solutions, the tests and the instructor key are not part of this copy. "
                "Complete the exercises in `exercises/`: `minikv check exercises/01_causal_attention.ipynb` "
                "grades one (each check's diagnosis and your points), `make test` grades them all.")


class ReleaseError(Exception):
    pass


def _shipped(path: Path, root: Path) -> bool:
    rel = path.relative_to(root)
    parts = rel.parts
    return not (NEVER_SHIPPED & set(parts) or any(p.endswith(".egg-info") for p in parts)
                or path.suffix in (".pyc", ".pyo") or any(fnmatch.fnmatch(rel.as_posix(), g) for g in HELD_BACK))


def without_solutions(text: str) -> str:
    """Prose less its mentions of solutions/ (the student copy has none)."""
    text = re.sub(r" ?\([^()]*`solutions/`[^()]*\)", "", text)  # "(with their completed twins in `solutions/`)"
    text = re.sub(r",? and (?:a|their) completed twins? in `solutions/`", "", text)
    return text.replace("exercises and solutions", "exercises")


def _hint_level(cell: dict) -> int | None:
    m = HINT.match("".join(cell.get("source", "")) if cell.get("cell_type") == "markdown" else "")
    return int(m.group(1)) if m else None


def student_notebook(nb: dict, clear_outputs: bool, hints: int | None = None) -> dict:
    """The notebook without its solution/instructor cells (nor hints past level `hints`), its answer cells
    (written-answer) blank under their questions; with clear_outputs, without any stored run."""
    nb = dict(nb)
    nb["cells"] = [c for c in nb["cells"] if not tags_of(c) & NEVER_RUN
                   and not (hints is not None and (_hint_level(c) or 0) > hints)]
    nb["cells"] = [dict(c) for c in nb["cells"]]
    for c in nb["cells"]:
        if c.get("cell_type") == "markdown":
            src = "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
            if WRITTEN in tags_of(c):  # an answer cell ships blank, whatever the copy released holds
                c["source"] = blank_written(src)
            elif "solutions" in src:
                c["source"] = without_solutions(src)
    if clear_outputs:
        for c in nb["cells"]:
            if c.get("cell_type") == "code":
                c["outputs"], c["execution_count"] = [], None
        nb["metadata"] = {k: v for k, v in nb.get("metadata", {}).items() if k != "widgets"}  # state of cleared views
    return nb


def _write_notebook(path: Path, nb: dict) -> None:
    path.write_text(json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def student_makefile(text: str) -> str:
    """The course Makefile with its test targets grading the exercises (there is no tests/ to run)."""
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(test|test-fast):", lines[i])
        if not m:
            out.append(lines[i])
            i += 1
            continue
        while out and out[-1].startswith("#"):  # the comment that described the old recipe
            out.pop()
        i += 1
        while i < len(lines) and lines[i].startswith("\t"):
            i += 1
        if m.group(1) == "test":
            out += ["# grade every exercise (one: minikv check exercises/NN_name.ipynb)", "test: model",
                    "\t$(PY) -m minikv.cli check --jobs $(JOBS) exercises/*.ipynb"]
        else:
            out += ["test-fast: test"]
    return "\n".join(out) + "\n"


def student_readme(text: str) -> str:
    """The README less its "For teachers" section and its mentions of solutions/, with a note saying what
    this copy is."""
    text = re.sub(r"(?ms)^## For teachers\b.*?(?=^## |\Z)", "", text)
    text = without_solutions(text)
    lines = text.splitlines()
    at = next((i + 1 for i, line in enumerate(lines) if line.startswith("# ")), 0)
    return "\n".join(lines[:at] + ["", STUDENT_NOTE] + lines[at:]).rstrip() + "\n"


def imported_test_modules(root: Path) -> list[Path]:
    """tests/<name>.py modules that a notebook imports (sys.path.insert(0, "../tests"); import name)."""
    names: set[str] = set()
    for nb_path in [*root.glob("notebooks/*.ipynb"), *root.glob("exercises/*.ipynb")]:
        for cell in json.loads(nb_path.read_text(encoding="utf-8"))["cells"]:
            if cell.get("cell_type") != "code":
                continue
            src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            try:
                tree = ast.parse(src)
            except SyntaxError:  # a magic line: not Python
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    names.add(node.module.split(".")[0])
    return sorted(p for n in names if (p := root / "tests" / f"{n}.py").is_file())


RESULTS = "/tmp/minikv-results"  # outside the repository: a committed file cannot pose as this run's result


def render_workflow(exercises: list[Path]) -> str:
    """GitHub Classroom autograding: install once, then one test per check of each exercise, worth its points.

    The first test of an exercise grades the notebook (`minikv check --results`); the others read that
    grade, so each notebook runs once and the Classroom total equals `minikv grade`'s partial credit."""
    steps, runners = [], []
    for nb in exercises:
        entry = entry_of_notebook(nb)
        for k, chk in enumerate(entry.checks, start=1):
            step_id = "ex" + re.sub(r"[^a-z0-9]", "", nb.stem.lower()) + f"c{k}"  # the reporter's own rule
            runners.append(step_id)
            steps.append(f"""      - name: {nb.stem} check {k}
        id: {step_id}
        uses: classroom-resources/autograding-command-grader@v1
        with:
          test-name: {nb.stem} check {k}
          command: minikv check --timeout 540 --results {RESULTS} --check {k} exercises/{nb.name}
          timeout: 10
          max-score: {number(chk.points)}
""")
    env = "".join(f"          {r.upper()}_RESULTS: \"${{{{ steps.{r}.outputs.result }}}}\"\n" for r in runners)
    return f"""# GitHub Classroom autograding for minikv: one test per check of each exercise, worth its points.
# Written by `minikv release` (the student copy has it as .github/workflows/classroom.yml): regenerate it
# with `minikv release --workflow FILE` after adding or renaming an exercise. The first test of an exercise
# grades its notebook once (`minikv check`); each test passes when its check passes, its output the diagnosis.
# The student owns this repository, this file included: these scores are feedback; grade with `minikv grade`.
name: Autograding Tests
"on":
  - push
  - workflow_dispatch
  - repository_dispatch
permissions:
  checks: write
  actions: read
  contents: read
jobs:
  run-autograding-tests:
    runs-on: ubuntu-latest
    if: github.actor != 'github-classroom[bot]'
    steps:
      - name: Checkout code
        uses: actions/checkout@v4
      - uses: actions/setup-python@v5
        with:
          python-version: "3.11"
      - name: Cache the converted model
        uses: actions/cache@v4
        with:
          path: ~/.cache/minikv
          key: minikv-model-${{{{ hashFiles('pyproject.toml') }}}}
      - name: Install minikv (CPU torch) and prepare the offline model
        run: |
          python -m pip install --index-url https://download.pytorch.org/whl/cpu "torch>=2.7,<2.14"
          python -m pip install -e .
          minikv prepare
          rm -rf {RESULTS}
{"".join(steps)}      - name: Autograding Reporter
        uses: classroom-resources/autograding-grading-reporter@v1
        env:
{env}        with:
          runners: {",".join(runners)}
"""


def select_exercises(root: Path, week: int | None = None, names: list[str] | None = None) -> list[Path]:
    """The exercises to release: all, one week's (week 4: 04a_*, 04b_*), or those named (04a, 06b_radix_match)."""
    every = sorted((root / "exercises").glob("*.ipynb"))
    if week is None and not names:
        return every
    chosen = [p for p in every if (week is not None and re.match(rf"0*{week}[a-z]?_", p.stem))
              or any(p.stem == n or p.stem.startswith(f"{n}_") for n in names or [])]
    if not chosen:
        known = ", ".join(p.stem for p in every)
        raise ReleaseError(f"no exercise matches {'week ' + str(week) if week is not None else ', '.join(names)}; "
                           f"the exercises: {known}")
    return chosen


def _git_commit(root: Path) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def release_student(out: Path, force: bool = False, root: Path | None = None, exercises: list[Path] | None = None,
                    hints: int | None = None) -> list[Path]:
    """Write the student copy into `out` (new, or a previous release with force); the files written.

    exercises: those to ship (default all; see select_exercises). hints: the highest hint level shipped.
    force keeps a template repository's .git and .venv."""
    root = root or course_root()
    if root is None:
        raise ReleaseError("minikv release needs the course checkout (with exercises/ and pyproject.toml); "
                           "run it from a clone of the repository")
    out = out.resolve()
    for name in FOLDERS + ["solutions", "instructor", "tests"]:
        if out == (root / name).resolve() or out.is_relative_to((root / name).resolve()):
            raise ReleaseError(f"{out} is inside the course's {name}/; choose a folder outside it")
    if out == root.resolve():
        raise ReleaseError("the student copy cannot replace the course checkout; choose a new folder")
    if out.exists() and any(out.iterdir()):
        if not force:
            raise ReleaseError(f"{out} exists and is not empty; choose a new folder, or pass --force to "
                               "replace a previous student copy")
        if not (out / MARKER).is_file():
            raise ReleaseError(f"{out} is not a previous student copy (no {MARKER}); --force replaces only those")
        for child in out.iterdir():
            if child.name in KEPT_ON_FORCE:
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def put(dst: Path, text: str | None = None, src: Path | None = None) -> None:
        dst.parent.mkdir(parents=True, exist_ok=True)
        if text is not None:
            dst.write_text(text, encoding="utf-8")
        else:
            shutil.copy2(src, dst)
        written.append(dst)

    for name in TOP_FILES:
        src = root / name
        if not src.is_file():
            continue
        if name == "README.md":
            put(out / name, student_readme(src.read_text(encoding="utf-8")))
        elif name == "pyproject.toml":
            put(out / name, "".join(line for line in src.read_text(encoding="utf-8").splitlines(True)
                                    if "solutions/" not in line))
        elif name == "Makefile":
            put(out / name, student_makefile(src.read_text(encoding="utf-8")))
        else:
            put(out / name, src=src)
    chosen = sorted(exercises) if exercises is not None else sorted((root / "exercises").glob("*.ipynb"))
    for folder in FOLDERS:
        for src in sorted((root / folder).rglob("*")):
            if not src.is_file() or not _shipped(src, root):
                continue
            if folder == "exercises" and src.suffix == ".ipynb" and src not in chosen:
                continue
            dst = out / src.relative_to(root)
            if src.suffix == ".ipynb":
                nb = student_notebook(json.loads(src.read_text(encoding="utf-8")), clear_outputs=folder == "exercises",
                                      hints=hints if folder == "exercises" else None)
                dst.parent.mkdir(parents=True, exist_ok=True)
                _write_notebook(dst, nb)
                written.append(dst)
            else:
                put(dst, src=src)
    for src in imported_test_modules(root):
        put(out / src.relative_to(root), src=src)
    put(out / ".github" / "workflows" / "classroom.yml", render_workflow(chosen))
    put(out / MARKER, json.dumps({"from_commit": _git_commit(root), "exercises": [p.stem for p in chosen],
                                  "hints": hints}) + "\n")
    return written

