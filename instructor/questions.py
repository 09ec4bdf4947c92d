"""Find every question the course asks, so the instructor key can be checked against them.

What counts as a question: in a markdown cell of a notebook (notebooks/) or an exercise (exercises/),
a line that mentions "question" and introduces a list (a heading such as "## Interview questions", a
bold line such as "**Questions an interviewer might ask**", or a line ending in ":" such as
"Questions to answer before moving on:") starts a question list. Each item of the list that follows
in the same cell (numbered "1." or bulleted "-" / "*"; indented lines continue an item) is one
question. The list ends at a heading or at a line that is none of these (blank lines are skipped).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from minikv.interview.asked import normalise, questions_in_markdown  # the parser `minikv quiz --notebook` uses

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("notebooks", "exercises")


@dataclass(frozen=True)
class Question:
    source: str  # "notebooks/04_paged_kv.ipynb"
    number: int  # 1, 2, ... in the order the notebook asks them
    text: str  # the item's text, lines joined by single spaces

    @property
    def key_file(self) -> Path:
        folder, name = self.source.split("/")
        return ROOT / "instructor" / folder / (Path(name).stem + ".md")


def questions_in(path: Path) -> list[Question]:
    nb = json.loads(path.read_text())
    texts: list[str] = []
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            texts += questions_in_markdown(source)
    rel = f"{path.parent.name}/{path.name}"
    return [Question(rel, n + 1, t) for n, t in enumerate(texts)]


def all_questions(root: Path = ROOT) -> list[Question]:
    out: list[Question] = []
    for folder in FOLDERS:
        for path in sorted((root / folder).glob("*.ipynb")):
            out += questions_in(path)
    return out


RUBRIC = "**Rubric**"  # a line starting so ends an answer and starts its rubric (exercises' keys)


def _key_blocks(path: Path) -> dict[str, str]:
    """{normalised question: everything under its '## Q<n>. <question>' heading}."""
    entries: dict[str, str] = {}
    if not path.exists():
        return entries
    question, body = None, []
    for line in path.read_text().splitlines() + ["## end"]:
        heading = re.match(r"^## Q\d+\.\s+(.*)$", line)
        if heading or line.startswith("## "):
            if question is not None:
                entries[question] = "\n".join(body).strip()
            question, body = (normalise(heading.group(1)), []) if heading else (None, [])
        elif question is not None:
            body.append(line)
    return entries


def _rubric_at(body: str) -> int:
    """Where the rubric starts: a line starting with '**Rubric**' (-1: none)."""
    m = re.search(r"^" + re.escape(RUBRIC), body, re.M)
    return m.start() if m else -1


def key_entries(path: Path) -> dict[str, str]:
    """{normalised question: answer} from a key file: each entry is a '## Q<n>. <question>' heading
    followed by its answer (and, in an exercise's key, its rubric, which is not part of the answer)."""
    return {q: body[:_rubric_at(body)].strip() if _rubric_at(body) >= 0 else body
            for q, body in _key_blocks(path).items()}


def key_rubrics(path: Path) -> dict[str, str]:
    """{normalised question: rubric} for each answer followed by a '**Rubric**' paragraph: how a teacher
    grades the written answer (the points expected, the levels)."""
    return {q: body[_rubric_at(body):].strip() for q, body in _key_blocks(path).items() if _rubric_at(body) >= 0}


if __name__ == "__main__":
    qs = all_questions()
    for q in qs:
        print(f"{q.source} Q{q.number}: {q.text}")
    print(len(qs), "questions")
