"""For the classroom: grade what learners saved, grade a class, write a student copy of the course.

    minikv check NOTEBOOK [--json]          one exercise: run it, the diagnosis of each check
    minikv grade FOLDER --out grades.csv    a class: one sub-folder per student
    minikv release --student OUT            the course without solutions/ or the instructor key

All three read the notebooks' cell tags (minikv/classroom/notebooks.py says which). The checks the grader
runs come from the package (registry.py, course.json), never from a submitted notebook; guard.py holds
what the notebook's process checks around them (tampering, the engine's own answers).
"""
from minikv.classroom.check import CheckResult, Grade, grade_notebook, grade_notebooks

__all__ = ["CheckResult", "Grade", "grade_notebook", "grade_notebooks"]
