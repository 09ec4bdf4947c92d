"""What the classroom tools read in a notebook: its check cells, their points, and the course's own copy.

An exercise notebook (exercises/NN_name.ipynb) tags its cells:

    exercise   the learner's code (a stub until written)
    check      a cell that runs a checker; worth 1 point, or what its metadata says:
               "metadata": {"tags": ["check"], "minikv": {"points": 2}}
    solution, instructor
               never run by the grader and never shipped in a student copy
    written-answer
               a markdown cell under a written (prose) question, the learner's answer to it: the question
               quoted, then "**Your answer:**" and the learner's text (cell id "written-q<n>"); the
               solution's twin holds the model answer. Never auto-scored: the grader collects the text for
               the teacher, who reads it against the instructor key's rubric.

Every other code cell (imports, building an LLM) runs as written, in order, as a kernel runs them.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import minikv

NEVER_RUN = {"solution", "instructor"}
WRITTEN = "written-answer"
ANSWER_PROMPT = "**Your answer:**"  # the exercise's cell; the solution's says "**Model answer:**"
_PROMPT = re.compile(r"^\*\*(?:Your|Model) answer:\*\*\s*")


class NotGradable(Exception):
    """The notebook cannot be graded at all: missing, not a notebook, or not an exercise."""


@dataclass
class Cell:
    index: int          # its place among all the notebook's cells
    source: str
    tags: frozenset[str]
    points: float = 0.0  # check cells only
    id: str = ""        # the notebook's cell id (nbformat 4.5), kept when a learner edits the cell

    @property
    def role(self) -> str:
        return "check" if "check" in self.tags else "exercise" if "exercise" in self.tags else "code"


def tags_of(cell: dict) -> frozenset[str]:
    return frozenset(cell.get("metadata", {}).get("tags", []) or [])


def points_of(cell: dict) -> float:
    """1 point per check cell unless its metadata says {"minikv": {"points": N}} (N >= 0)."""
    value = (cell.get("metadata", {}).get("minikv") or {}).get("points", 1)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise NotGradable(f"a check cell's metadata minikv.points must be a number >= 0, not {value!r}")
    return float(value)


def source_of(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def read_notebook(path: Path) -> dict:
    """The notebook's JSON, or NotGradable saying what is wrong with the file."""
    if not path.exists():
        raise NotGradable(f"{path}: no such file")
    if path.is_dir():
        raise NotGradable(f"{path} is a folder; give the notebook file (.ipynb)")
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise NotGradable(f"{path} is not a notebook (not JSON: {e})") from None
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        raise NotGradable(f"{path} is not a notebook (no list of cells)")
    return nb


def code_cells(nb: dict) -> list[Cell]:
    """The cells the grader runs, in order: code cells, less those tagged solution or instructor."""
    cells = []
    for i, c in enumerate(nb["cells"]):
        tags = tags_of(c)
        if c.get("cell_type") != "code" or tags & NEVER_RUN:
            continue
        cells.append(Cell(i, source_of(c), tags, points_of(c) if "check" in tags else 0.0, str(c.get("id") or "")))
    return cells


def normalised(source: str) -> str:
    """A cell's code as the grader compares it: blank lines and trailing spaces do not count."""
    return "\n".join(line.rstrip() for line in source.strip().splitlines() if line.strip())


def course_root() -> Path | None:
    """The course checkout minikv runs from (it holds exercises/ and pyproject.toml), if it does."""
    root = Path(minikv.__file__).resolve().parents[1]
    return root if (root / "exercises").is_dir() and (root / "pyproject.toml").is_file() else None


def course_exercises() -> list[Path]:
    """The course's exercise notebooks (found by name, so a new or renumbered exercise is seen)."""
    root = course_root()
    return sorted((root / "exercises").glob("*.ipynb")) if root else []


def is_exercise(nb: dict) -> bool:
    return any("check" in tags_of(c) for c in nb["cells"] if c.get("cell_type") == "code")


def max_points(path: Path) -> float:
    return sum(c.points for c in code_cells(read_notebook(path)) if c.role == "check")


def find_reference(path: Path, reference: Path | None = None) -> Path | None:
    """The teacher's copy of this exercise named by `reference`: a notebook, or a folder holding one of the
    same name (None when there is none). Without it the grader trusts the package's copy of the course."""
    if reference is None:
        return None
    found = reference / path.name if reference.is_dir() else reference
    return found if found.is_file() else None


@dataclass
class Written:
    """One written answer: the question it answers and the text under its prompt ("" when left blank)."""
    id: str        # "written-q2", the cell's id
    number: int    # the question's number in the exercise's list of questions
    question: str
    answer: str


def written_cell(number: int, question: str, answer: str = "", prompt: str = ANSWER_PROMPT) -> str:
    """The source of an answer cell: the question quoted, then the prompt and the answer (empty in an exercise).

        > **Q2.** What breaks if a key hashes only the block's own tokens?

        **Your answer:**
    """
    return f"> **Q{number}.** {question}\n\n{prompt}" + (f" {answer}" if answer else "")


def split_written(source: str) -> tuple[str, str]:
    """(the quoted question, the answer): the answer is whatever is not the quote, less the prompt."""
    quote, rest = [], []
    for line in source.strip().splitlines():
        (quote if line.startswith(">") and not rest else rest).append(line)
    answer = _PROMPT.sub("", "\n".join(rest).strip(), count=1).strip()
    question = re.sub(r"^\*\*Q\d+\.\*\*\s*", "", " ".join(q.lstrip("> ").strip() for q in quote).strip())
    return question, answer


def written_answers(nb: dict) -> list[Written]:
    """The notebook's answer cells (tagged written-answer), in order, with what each holds."""
    out = []
    for c in nb["cells"]:
        if c.get("cell_type") != "markdown" or WRITTEN not in tags_of(c):
            continue
        question, answer = split_written(source_of(c))
        number = (c.get("metadata", {}).get("minikv") or {}).get("question", len(out) + 1)
        out.append(Written(str(c.get("id") or f"written-q{number}"), int(number), question, answer))
    return out


def blank_written(source: str) -> str:
    """An answer cell as the student receives it: the question quoted and the prompt, nothing under it."""
    quote = []
    for line in source.strip().splitlines():
        if not line.startswith(">"):
            break
        quote.append(line)
    return "\n".join(quote) + f"\n\n{ANSWER_PROMPT}" if quote else ANSWER_PROMPT
