"""`minikv grade`: grade a class, one sub-folder per student, into a CSV (and JUnit XML).

    FOLDER/
      alice/01_causal_attention.ipynb ...            the notebooks as the student handed them in
      bob/exercises/01_causal_attention.ipynb ...    or a clone of their repository (found at any depth)

    grades.csv   student, <exercise>..., points, max_points       one row per student
    grades.xml   one <testsuite> per student, one <testcase> per exercise, the diagnosis in <failure>

The exercises are the course's (exercises/*.ipynb of the checkout minikv runs from, or --exercises);
a student missing one gets 0 of its points. Every notebook runs in its own process.
"""
from __future__ import annotations

import csv
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from minikv.classroom.check import DEFAULT_TIMEOUT, Grade, grade_notebooks, known_max_points, number
from minikv.classroom.notebooks import course_exercises, is_exercise, read_notebook

SKIP_DIRS = {".ipynb_checkpoints", ".git", "__pycache__", "solutions", "instructor"}


@dataclass
class StudentGrades:
    student: str
    grades: dict[str, Grade]  # exercise -> its grade

    @property
    def points(self) -> float:
        return sum(g.points for g in self.grades.values())

    @property
    def max_points(self) -> float:
        return sum(g.max_points for g in self.grades.values())


def students_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))


def find_notebook(student: Path, name: str) -> Path | None:
    """The student's `name` (a notebook file name): exercises/name if there, else the shallowest one."""
    found = [p for p in student.rglob(name) if not SKIP_DIRS & set(p.relative_to(student).parts[:-1])]
    found.sort(key=lambda p: (p.parent.name != "exercises", len(p.parts), str(p)))
    return found[0] if found else None


def exercise_names(folder: Path, exercises: Path | None) -> tuple[list[str], Path | None]:
    """The exercise notebook names that count, and the folder of their course copies (None if unknown)."""
    if exercises is not None:
        return sorted(p.name for p in exercises.glob("*.ipynb")), exercises
    course = course_exercises()
    if course:
        return [p.name for p in course], course[0].parent
    names = set()  # no course copy at hand: every exercise notebook some student has
    for student in students_in(folder):
        for p in student.rglob("*.ipynb"):
            if SKIP_DIRS & set(p.relative_to(student).parts[:-1]):
                continue
            try:
                if is_exercise(read_notebook(p)):
                    names.add(p.name)
            except Exception:  # noqa: BLE001  an unreadable file is no exercise
                continue
    return sorted(names), None


def grade_class(folder: Path, exercises: Path | None = None, jobs: int = 1, timeout: float = DEFAULT_TIMEOUT,
                log=None) -> tuple[list[str], list[StudentGrades]]:
    """Every student's every exercise; a missing notebook is graded 0 of the exercise's points."""
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such folder (one sub-folder per student)")
    names, reference = exercise_names(folder, exercises)
    if not names:
        raise FileNotFoundError("no exercise notebooks: give --exercises (the course's exercises/ folder)")
    students = students_in(folder)
    if not students:
        raise FileNotFoundError(f"{folder} has no sub-folders: put each student's notebooks in a folder of their own")
    wanted: list[tuple[str, str, Path]] = []
    result = [StudentGrades(s.name, {}) for s in students]
    for s, row in zip(students, result):
        for name in names:
            path = find_notebook(s, name)
            if path is None:
                g = Grade(exercise=Path(name).stem, path=str(s / name), error=f"missing: no {name} in {s.name}/")
                g.max_known = known_max_points(reference / name) if reference else 0.0
                row.grades[g.exercise] = g
            else:
                wanted.append((s.name, name, path))

    def done(g: Grade) -> None:
        if log is not None:
            log(f"{g.path}: {number(g.points)} of {number(g.max_points)}")

    grades = grade_notebooks([p for _, _, p in wanted], timeout=timeout, reference=reference, jobs=jobs,
                             on_done=done)
    rows = {r.student: r for r in result}
    for (student, _, _), g in zip(wanted, grades):
        rows[student].grades[g.exercise] = g
    stems = [Path(n).stem for n in names]
    for r in result:
        r.grades = {e: r.grades[e] for e in stems}
    return stems, result


def write_csv(path: Path, exercises: list[str], rows: list[StudentGrades]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["student", *exercises, "points", "max_points"])
        for r in rows:
            w.writerow([r.student, *(number(r.grades[e].points) for e in exercises), number(r.points),
                        number(r.max_points)])


def write_junit(path: Path, exercises: list[str], rows: list[StudentGrades]) -> None:
    """JUnit XML: a testsuite per student, a testcase per exercise (its points as properties)."""
    suites = ET.Element("testsuites", name="minikv grade", tests=str(len(rows) * len(exercises)))
    total_failures = 0
    for r in rows:
        failures = sum(not g.passed for g in r.grades.values())
        total_failures += failures
        suite = ET.SubElement(suites, "testsuite", name=r.student, tests=str(len(exercises)),
                              failures=str(failures), errors="0",
                              time=f"{sum(g.seconds for g in r.grades.values()):.1f}")
        props = ET.SubElement(suite, "properties")
        ET.SubElement(props, "property", name="points", value=str(number(r.points)))
        ET.SubElement(props, "property", name="max_points", value=str(number(r.max_points)))
        for e in exercises:
            g = r.grades[e]
            case = ET.SubElement(suite, "testcase", classname=r.student, name=e, time=f"{g.seconds:.1f}")
            cprops = ET.SubElement(case, "properties")
            ET.SubElement(cprops, "property", name="points", value=str(number(g.points)))
            ET.SubElement(cprops, "property", name="max_points", value=str(number(g.max_points)))
            if not g.passed:
                fail = ET.SubElement(case, "failure",
                                     message=f"{number(g.points)} of {number(g.max_points)} points")
                fail.text = g.message
    suites.set("failures", str(total_failures))
    ET.indent(suites)
    ET.ElementTree(suites).write(path, encoding="utf-8", xml_declaration=True)
