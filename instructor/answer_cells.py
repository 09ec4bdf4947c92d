"""Put an answer cell under each written question of every exercise, and its model answer in the solution.

    python instructor/answer_cells.py       rewrites exercises/*.ipynb and solutions/*.ipynb in place

An exercise ends with questions an interviewer might ask, answered in prose. Under the cell that asks
them, each question gets a markdown cell of its own, tagged `written-answer`, id `written-q<n>`:

    > **Q2.** What breaks if a key hashes only the block's own tokens?

    **Your answer:**

The learner writes under the prompt; `minikv grade` collects the text for the teacher (it is never
auto-scored) and `minikv release` ships the cell blank. The solution's twin holds the instructor key's
model answer under "**Model answer:**"; the key holds the rubric the teacher grades with. Run it again
after a question is added, reworded or answered differently: it replaces the cells it wrote before, and
nothing else of either notebook changes.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "instructor"))
from questions import key_entries, questions_in  # noqa: E402

from minikv.classroom.notebooks import WRITTEN, source_of, tags_of, written_cell  # noqa: E402
from minikv.interview.asked import questions_in_markdown  # noqa: E402


def lines(text: str) -> list[str]:
    """A cell's source as the notebooks store it: one string per line, each but the last ending in a newline."""
    parts = text.split("\n")
    return [p + "\n" for p in parts[:-1]] + [parts[-1]]


def answer_cells(questions: list[str], answers: list[str] | None = None) -> list[dict]:
    out = []
    for n, text in enumerate(questions, 1):
        source = written_cell(n, text) if answers is None else written_cell(n, text, answers[n - 1],
                                                                             prompt="**Model answer:**")
        out.append({"cell_type": "markdown", "id": f"written-q{n}",
                    "metadata": {"minikv": {"question": n}, "tags": [WRITTEN]}, "source": lines(source)})
    return out


def with_answer_cells(nb: dict, cells: list[dict]) -> dict:
    """The notebook less any answer cell it had, with `cells` after the cell that asks the questions."""
    kept = [c for c in nb["cells"] if not (c.get("cell_type") == "markdown" and WRITTEN in tags_of(c))]
    at = max(i for i, c in enumerate(kept) if c.get("cell_type") == "markdown"
             and questions_in_markdown(source_of(c)))
    return {**nb, "cells": kept[:at + 1] + cells + kept[at + 1:]}


def main() -> int:
    for exercise in sorted((ROOT / "exercises").glob("*.ipynb")):
        asked = questions_in(exercise)
        if not asked:
            continue
        key = key_entries(asked[0].key_file)
        missing = [q.number for q in asked if q.text not in key]
        if missing:
            raise SystemExit(f"{exercise.name}: Q{missing[0]} has no model answer in {asked[0].key_file}; "
                             "write it there first")
        texts = [q.text for q in asked]
        for path, answers in ((exercise, None), (ROOT / "solutions" / exercise.name, [key[t] for t in texts])):
            nb = with_answer_cells(json.loads(path.read_text()), answer_cells(texts, answers))
            path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
        print(f"{exercise.name}: {len(texts)} answer cells")
    return 0


if __name__ == "__main__":
    sys.exit(main())
