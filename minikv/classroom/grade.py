"""`minikv grade`: grade a class, one sub-folder per student, into a CSV (and JUnit XML, and feedback).

    FOLDER/
      alice/01_causal_attention.ipynb ...            the notebooks as the student handed them in
      bob/exercises/01_causal_attention.ipynb ...    or a clone of their repository (found at any depth)

    grades.csv   student, <exercise>..., points, max_points, <exercise> status..., flags, review, commit, late,
                 written answers to review; one row per student, rewritten as each student finishes
    grades.xml   one <testsuite> per student, one <testcase> per exercise, the diagnosis in <failure>
    feedback/    <student>.md: every exercise's report, what the student reads, and their written answers

Written answers (the prose under each exercise's questions, cells tagged written-answer) are not
auto-scored and add no points: the grader reads them from the notebook's JSON, never runs them, and lists
them for the teacher, who grades them with the rubric of the instructor key (instructor/exercises/).

The exercises are the course's (the package's copy, the names of exercises/ of the checkout minikv runs
from, or --exercises); a student missing one gets 0 of its points. Every notebook runs in its own process.
Folders starting with `_` or `.` are no student's (the command says which it skipped).
"""
from __future__ import annotations

import csv
import re
import subprocess
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from minikv.classroom.check import DEFAULT_MEMORY_GB, DEFAULT_TIMEOUT, Grade, grade_notebooks, number
from minikv.classroom.notebooks import NotGradable, Written, course_exercises, read_notebook, written_answers
from minikv.classroom.registry import course, entry_of_notebook

SKIP_DIRS = {".ipynb_checkpoints", ".git", "__pycache__", "solutions", "instructor"}


@dataclass
class StudentGrades:
    student: str
    grades: dict[str, Grade]  # exercise -> its grade
    commit: str | None = None  # the date of the last commit of their repository (ISO 8601), when a git clone
    late: bool | None = None   # committed after --deadline (None: no deadline or no commit date)
    written: dict[str, list[Written]] = field(default_factory=dict)  # exercise -> its answer cells, as handed in

    @property
    def points(self) -> float:
        return sum(g.points for g in self.grades.values())

    @property
    def max_points(self) -> float:
        return sum(g.max_points for g in self.grades.values())

    @property
    def flags(self) -> list[str]:
        return [f"{e}: {f}" for e, g in self.grades.items() for f in g.flags]

    @property
    def review(self) -> list[str]:
        return [f"{e} {r}" for e, g in self.grades.items() for r in g.review]

    @property
    def written_to_review(self) -> list[str]:
        """'06a_block_hash_chain Q1, Q3' for each exercise with an answered written question (not scored)."""
        return [f"{e} " + ", ".join(f"Q{w.number}" for w in ws if w.answer)
                for e, ws in self.written.items() if any(w.answer for w in ws)]


def read_written(path: Path) -> list[Written]:
    """The answer cells of a handed-in notebook (read as JSON, never run); none when it cannot be read."""
    try:
        return written_answers(read_notebook(path))
    except (NotGradable, OSError, ValueError, TypeError, AttributeError):
        return []


def students_in(folder: Path) -> tuple[list[Path], list[str]]:
    """The student folders, and the names of the folders skipped (starting with _ or .)."""
    dirs = sorted(p for p in folder.iterdir() if p.is_dir())
    return ([p for p in dirs if not p.name.startswith((".", "_"))],
            [p.name for p in dirs if p.name.startswith((".", "_"))])


def find_notebook(student: Path, name: str) -> Path | None:
    """The student's `name` (a notebook file name): exercises/name if there, else the shallowest one."""
    found = [p for p in student.rglob(name) if not SKIP_DIRS & set(p.relative_to(student).parts[:-1])]
    found.sort(key=lambda p: (p.parent.name != "exercises", len(p.parts), str(p)))
    return found[0] if found else None


def exercise_names(exercises: Path | None) -> tuple[list[str], Path | None]:
    """The exercise notebook names that count, and the teacher's folder of them (None: the package's)."""
    if exercises is not None:
        if not exercises.is_dir():
            raise FileNotFoundError(f"--exercises {exercises}: no such folder (the course's exercise notebooks)")
        return sorted(p.name for p in exercises.glob("*.ipynb")), exercises
    names = [p.name for p in course_exercises()] or sorted(f"{n}.ipynb" for n in course())
    return names, None


def commit_date(student: Path) -> str | None:
    """The committer date of the last commit of a student's clone (None when it is not a git repository)."""
    if not (student / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(student), "log", "-1", "--format=%cI"], capture_output=True,
                             text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def parse_deadline(text: str) -> datetime:
    """An ISO 8601 date or time (2026-03-01, 2026-03-01T23:59+01:00); a date means its end, UTC without a zone."""
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"--deadline {text!r} is not a date: write 2026-03-01 or 2026-03-01T23:59+01:00") from None
    if len(text) == 10:
        when = when.replace(hour=23, minute=59, second=59)
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when


def grade_class(folder: Path, exercises: Path | None = None, jobs: int = 1, timeout: float = DEFAULT_TIMEOUT,
                log=None, only: str | None = None, deadline: datetime | None = None, on_student=None,
                memory_gb: float | None = DEFAULT_MEMORY_GB) -> tuple[list[str], list[StudentGrades]]:
    """Every student's every exercise; a missing notebook is graded 0 of the exercise's points.

    only: grade that student alone. on_student(row) is called as each student's last notebook finishes."""
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such folder (one sub-folder per student)")
    names, reference = exercise_names(exercises)
    if not names:
        raise FileNotFoundError("no exercise notebooks: give --exercises (the course's exercises/ folder)")
    students, skipped = students_in(folder)
    if log is not None and skipped:
        log(f"skipped {', '.join(skipped)}: a folder starting with _ or . is no student's")
    if only is not None:
        students = [s for s in students if s.name == only]
        if not students:
            raise FileNotFoundError(f"{folder} has no student folder named {only!r}")
    if not students:
        raise FileNotFoundError(f"{folder} has no sub-folders: put each student's notebooks in a folder of their own")
    wanted: list[tuple[StudentGrades, str, Path]] = []
    result = [StudentGrades(s.name, {}) for s in students]
    entries = course()
    for s, row in zip(students, result):
        row.commit = commit_date(s)
        if deadline is not None and row.commit is not None:
            row.late = datetime.fromisoformat(row.commit) > deadline
        for name in names:
            path = find_notebook(s, name)
            if path is None:
                g = Grade(exercise=Path(name).stem, path=str(s / name), error=f"missing: no {name} in {s.name}/")
                g.max_known = _max_points(name, reference, entries)
                row.grades[g.exercise] = g
            else:
                wanted.append((row, name, path))
                row.written[Path(name).stem] = read_written(path)
    stems = [Path(n).stem for n in names]
    left = {r.student: sum(w[0] is r for w in wanted) for r in result}

    def finished(r: StudentGrades) -> None:
        r.grades = {e: r.grades[e] for e in stems}
        if on_student is not None:
            on_student(r)

    for r in result:
        if left[r.student] == 0:
            finished(r)
    by_path = {str(p): (row, name) for row, name, p in wanted}

    def done(g: Grade) -> None:
        row, name = by_path[g.path]
        g.exercise = Path(name).stem  # the name it counts as, whatever the notebook calls itself
        row.grades[g.exercise] = g
        if log is not None:
            log(f"{g.path}: {number(g.points)} of {number(g.max_points)} ({g.status})")
        left[row.student] -= 1
        if left[row.student] == 0:
            finished(row)

    grade_notebooks([p for _, _, p in wanted], timeout=timeout, reference=reference, jobs=jobs, on_done=done,
                    memory_gb=memory_gb)
    return stems, result


def _max_points(name: str, reference: Path | None, entries) -> float:
    try:
        if reference is not None:
            return entry_of_notebook(reference / name).max_points
    except NotGradable:
        return 0.0
    e = entries.get(Path(name).stem)
    return e.max_points if e is not None else 0.0


HEADER_TAIL = ["points", "max_points"]
WRITTEN_COLUMN = "written answers to review"  # not auto-scored: the questions answered, read in feedback/


def csv_header(exercises: list[str]) -> list[str]:
    return ["student", *exercises, *HEADER_TAIL, *(f"{e} status" for e in exercises), "flags", "review",
            "commit", "late", WRITTEN_COLUMN]


def csv_row(exercises: list[str], r: StudentGrades) -> list:
    late = "" if r.late is None else "yes" if r.late else "no"
    return [r.student, *(number(r.grades[e].points) for e in exercises), number(r.points), number(r.max_points),
            *(r.grades[e].status for e in exercises), "; ".join(r.flags), "; ".join(r.review), r.commit or "", late,
            "; ".join(r.written_to_review)]


def check_writable(path: Path) -> None:
    """Fail before grading (not after an hour of it) when the CSV cannot be written there."""
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise FileNotFoundError(f"{parent}/ does not exist: create it, or write --out elsewhere")
    if path.is_dir():
        raise FileNotFoundError(f"{path} is a folder: give a file name, e.g. {path / 'grades.csv'}")


def write_csv(path: Path, exercises: list[str], rows: list[StudentGrades], merge: bool = False) -> None:
    """The table, a row per student and a last row `total` (the class's mean of each column of points).

    merge: keep the rows of students not in `rows` from the CSV already at `path` (grade --student)."""
    kept: list[list[str]] = []
    if merge and path.is_file():
        with open(path, newline="", encoding="utf-8") as f:
            old = list(csv.reader(f))
        if old and old[0] != csv_header(exercises):
            raise ValueError(f"{path} has other columns than this grading ({', '.join(old[0][:4])}, ...); "
                             "merge into a CSV of the same exercises, or write a new one")
        mine = {r.student for r in rows}
        kept = [row for row in old[1:] if row and row[0] not in mine and row[0] != "total"]
    table = sorted(kept + [[str(x) for x in csv_row(exercises, r)] for r in rows], key=lambda row: row[0])
    n = 1 + len(exercises) + len(HEADER_TAIL)
    means = []
    for col in range(1, n):
        values = [float(row[col]) for row in table if row[col] not in ("", None)]
        means.append(number(round(sum(values) / len(values), 2)) if values else "")
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(csv_header(exercises))
        w.writerows(table)
        if table:
            w.writerow(["total", *means] + [""] * (len(csv_header(exercises)) - n))
    tmp.replace(path)


def clean(text: str) -> str:
    """Text safe in XML: ANSI colours dropped, other control characters (NUL included) as \\xNN."""
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)
    return re.sub(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff\ufffe\uffff]", lambda m: f"\\x{ord(m.group()):02x}",
                  text)


def write_junit(path: Path, exercises: list[str], rows: list[StudentGrades]) -> None:
    """JUnit XML: a testsuite per student, a testcase per exercise (its points as properties)."""
    suites = ET.Element("testsuites", name="minikv grade", tests=str(len(rows) * len(exercises)))
    total_failures = 0
    for r in rows:
        failures = sum(not g.passed for g in r.grades.values())
        total_failures += failures
        suite = ET.SubElement(suites, "testsuite", name=clean(r.student), tests=str(len(exercises)),
                              failures=str(failures), errors="0",
                              time=f"{sum(g.seconds for g in r.grades.values()):.1f}")
        props = ET.SubElement(suite, "properties")
        ET.SubElement(props, "property", name="points", value=str(number(r.points)))
        ET.SubElement(props, "property", name="max_points", value=str(number(r.max_points)))
        for e in exercises:
            g = r.grades[e]
            case = ET.SubElement(suite, "testcase", classname=clean(r.student), name=e, time=f"{g.seconds:.1f}")
            cprops = ET.SubElement(case, "properties")
            ET.SubElement(cprops, "property", name="points", value=str(number(g.points)))
            ET.SubElement(cprops, "property", name="max_points", value=str(number(g.max_points)))
            ET.SubElement(cprops, "property", name="status", value=g.status)
            if not g.passed:
                fail = ET.SubElement(case, "failure",
                                     message=f"{number(g.points)} of {number(g.max_points)} points ({g.status})")
                fail.text = clean(g.message)
    suites.set("failures", str(total_failures))
    ET.indent(suites)
    ET.ElementTree(suites).write(path, encoding="utf-8", xml_declaration=True)


def written_section(exercises: list[str], r: StudentGrades) -> list[str]:
    """The student's written answers, question by question, for the teacher to grade (no points here)."""
    answered = [(e, r.written[e]) for e in exercises if r.written.get(e)]
    if not answered:
        return []
    out = ["", "# Written answers (not auto-scored: the teacher grades them with the instructor key's rubric)"]
    for e, ws in answered:
        out += ["", f"## {e}"]
        for w in ws:
            out += ["", f"**Q{w.number}.** {w.question}", "", w.answer if w.answer else "_(no answer)_"]
    return out


def write_feedback(folder: Path, exercises: list[str], r: StudentGrades) -> Path:
    """<student>.md: the points, then every exercise's report as `minikv check` prints it."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [f"# {r.student}: {number(r.points)} of {number(r.max_points)} points", ""]
    if r.late is not None:
        lines += [f"Last commit {r.commit}: {'after' if r.late else 'before'} the deadline.", ""]
    lines += [f"- {e}: {number(r.grades[e].points)} of {number(r.grades[e].max_points)} ({r.grades[e].status})"
              for e in exercises]
    for e in exercises:
        lines += ["", f"## {e}", "", "```", r.grades[e].report(), "```"]
    lines += written_section(exercises, r)
    path = folder / f"{r.student}.md"
    path.write_text(clean("\n".join(lines)) + "\n", encoding="utf-8")
    return path
