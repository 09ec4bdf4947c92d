"""pytest configuration for the whole checkout (the tests' own fixtures are in tests/conftest.py).

`make test` runs every exercise and solution notebook through nbval, and tests/test_classroom.py grades
each of them with the course's checks: every solution scores full marks, every untouched exercise fails
at its checks with a message and nowhere else. The notebooks' check cells are those same checks
(minikv/classroom/course.json is rendered from exercises/, tests/test_classroom.py holds them equal), so
nbval would run each of them a second time: about a minute of a two-core run. Where this session grades a
notebook, nbval runs every cell of it but its check cells. Run alone (`pytest --nbval solutions/...`),
a notebook keeps its check cells.
"""
from __future__ import annotations

from pathlib import Path

import pytest

GRADED_BY = {  # the grading test of tests/test_classroom.py -> the folder of the notebooks it grades
    "test_every_solution_passes_minikv_check": "solutions",
    "test_every_untouched_exercise_fails_minikv_check_with_a_message": "exercises",
}


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected theirs: only gradings that will run count
def pytest_collection_modifyitems(config, items):
    graded = {(GRADED_BY[item.originalname], item.callspec.params["name"]) for item in items
              if getattr(item, "originalname", None) in GRADED_BY and hasattr(item, "callspec")}
    if not graded:
        return
    keep, drop = [], []
    for item in items:
        cell = getattr(item, "cell", None)  # an nbval item: one code cell of a notebook
        path = Path(str(item.fspath))
        if cell is not None and (path.parent.name, path.name) in graded and "check" in cell.metadata.get("tags", ()):
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
