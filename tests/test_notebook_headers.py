"""Every course notebook opens with what a learner or a teacher plans by: what it teaches, what it needs
first, and how long it takes to read and to run (the run time as measured by scripts/notebook_times.py,
never a placeholder)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
TIME = re.compile(r"\*\*Time:\*\* about \d+ minutes to read.{0,120}?about \d+ (s|seconds|minutes?)\b.{0,40}?to run")


def header(path: Path) -> str:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    text = "".join(cells[0]["source"]) if cells and cells[0]["cell_type"] == "markdown" else ""
    return re.sub(r"\n>?\s*", " ", text)  # one line: a header's sentences wrap inside its quote block


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_opens_with_objectives_prerequisites_and_times(path):
    text = header(path)
    assert text.startswith("# "), f"{path.name}: the first cell should be the title and its header block"
    assert re.search(r"You will learn to|Learning objectives", text), f"{path.name}: no learning objectives"
    assert "**Prerequisites:**" in text, f"{path.name}: no prerequisites line"
    assert TIME.search(text), (f"{path.name}: no '**Time:** about N minutes to read; about N s to run' line; "
                               "measure the run time with scripts/notebook_times.py")
    assert not re.search(r"__RUN__|RUNTIME|TODO", text), f"{path.name}: a placeholder is left in the header"
