"""pytest configuration for the whole checkout (the tests' own fixtures are in tests/conftest.py).

`make test` runs every notebook through nbval, and tests/test_classroom.py grades every exercise and
solution notebook with the course's checks: every solution scores full marks with no cell raising, every
untouched exercise fails at its checks with a message and nowhere else. The grader runs every cell of the
notebook (the learner's cells, then the course's setup and check cells, which are the notebook's: course.json
is rendered from exercises/), and the grading tests compare what each cell printed with its stored output,
as nbval compares it (`assert_prints_as_stored`). nbval would run the same notebook a second time, in a
kernel of its own: about two minutes of CPU of a two-core run. So where this session grades a notebook,
nbval leaves it to the grading test. Run alone (`pytest --nbval solutions/...`), a notebook goes through
nbval, every cell of it.
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
        path = Path(str(item.fspath))
        if getattr(item, "cell", None) is not None and (path.parent.name, path.name) in graded:  # an nbval cell
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
