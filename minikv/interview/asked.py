"""The questions one notebook asks, with the bank's model answers: `minikv quiz --notebook 05`.

    minikv quiz --notebook 05                      notebooks/05_continuous_batching.ipynb
    minikv quiz --notebook 05_continuous_batching  the same, by its name
    minikv quiz --notebook 8b                      notebooks/08b_triton_performance_appendix.ipynb
    minikv quiz --notebook 06a                     exercises/06a_block_hash_chain.ipynb (no notebook 06a)

The questions are read from the notebook when the command runs, never from a list kept here, so a
reworded, moved or new question shows as the notebook now asks it. What counts as a question is the
instructor key's rule (instructor/questions.py): in a markdown cell, a line that mentions "question"
and introduces a list (`## Questions an interviewer might ask`, `**Interview questions**`, a line
ending in `:`) starts it; each item of the list that follows (`1.`, `-`, `*`; indented lines continue
an item) is one question.

The answers come from the bank (minikv/interview/data/course.json: the instructor key's model answers,
imported by instructor/bank_import.py), matched by the question's text: first among the entries of
this notebook, then anywhere in the bank (a question that moved to an appendix keeps its answer).
The bank's other entries filed under this notebook (the questions beyond the course that beyond.json
ties to it) follow its own questions.

An id names a notebook of notebooks/ first, then an exercise of exercises/:

    its file name without .ipynb         05_continuous_batching, 06a_block_hash_chain
    the part before the first "_"        05, 08b, 06a     (leading zero optional: 5, 8b)
"""
from __future__ import annotations

import json
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

from minikv.interview import bank

FOLDERS = ("notebooks", "exercises")  # an id names a notebook before an exercise
_ITEM = re.compile(r"^\s{0,3}(?:\d+[.)]|[-*])\s+(.*)$")


def normalise(text: str) -> str:
    return " ".join(text.split())


def _loose(text: str) -> str:
    """The words alone: a question that lost a backtick or changed case still finds its answer."""
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def _starts_list(line: str) -> bool:
    s = line.strip()
    if "question" not in s.lower() or _ITEM.match(line):
        return False
    return s.startswith("#") or (s.startswith("**") and s.endswith("**")) or s.endswith(":")


def questions_in_markdown(text: str) -> list[str]:
    """Every question of one markdown cell, in order, its lines joined by single spaces."""
    found: list[str] = []
    lines, i = text.splitlines(), 0
    while i < len(lines):
        if not _starts_list(lines[i]):
            i += 1
            continue
        i += 1
        current: list[str] | None = None
        while i < len(lines):
            line = lines[i]
            item = _ITEM.match(line)
            if item:
                if current:
                    found.append(normalise(" ".join(current)))
                current = [item.group(1)]
            elif not line.strip():
                pass
            elif current is not None and line.startswith((" ", "\t")) and not line.strip().startswith("#"):
                current.append(line.strip())
            else:
                break
            i += 1
        if current:
            found.append(normalise(" ".join(current)))
    return found


def questions_in(path: Path) -> list[str]:
    """Every question a notebook asks, in the order it asks them."""
    out: list[str] = []
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        if cell.get("cell_type") == "markdown":
            src = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            out += questions_in_markdown(src)
    return out


# ---- which notebook an id names -------------------------------------------------------------------

def course_root() -> Path | None:
    """The checkout minikv runs from, else the current folder, whichever holds notebooks/."""
    from minikv.classroom.notebooks import course_root as checkout

    for root in (checkout(), Path.cwd()):
        if root is not None and (root / "notebooks").is_dir():
            return root
    return None


def short_id(path: Path) -> str:
    """'05' for 05_continuous_batching.ipynb, '08b' for 08b_triton_performance_appendix.ipynb."""
    return path.stem.split("_", 1)[0].lower()


def notebooks(root: Path) -> dict[str, Path]:
    """{id: path} for every notebook and exercise, each under its short id where no notebook (or earlier
    exercise) took it, and under its full name always."""
    ids: dict[str, Path] = {}
    for folder in FOLDERS:
        for path in sorted((root / folder).glob("*.ipynb")):
            ids.setdefault(short_id(path), path)
            ids.setdefault(path.stem.lower(), path)
    return ids


def valid_ids(root: Path) -> dict[str, list[str]]:
    """{folder: the shortest id of each of its notebooks}: what an error lists."""
    ids = notebooks(root)
    return {folder: [short_id(p) if ids[short_id(p)] == p else p.stem
                     for p in sorted((root / folder).glob("*.ipynb"))] for folder in FOLDERS}


def resolve(name: str, root: Path) -> Path:
    """The notebook an id names; KeyError with the valid ids if none."""
    key = Path(name.strip()).name.lower().removesuffix(".ipynb")
    if re.fullmatch(r"\d[a-z]?", key):
        key = "0" + key  # 5 -> 05, 8b -> 08b
    ids = notebooks(root)
    if key in ids:
        return ids[key]
    listed = "; ".join(f"{folder}: {', '.join(names)}" for folder, names in valid_ids(root).items() if names)
    raise KeyError(f"no notebook {name!r}; valid ids are {listed} (or a notebook's file name, such as "
                   "05_continuous_batching)")


# ---- questions with their answers -----------------------------------------------------------------

@dataclass(frozen=True)
class Asked:
    number: int  # 1, 2, ... in the order the notebook asks them
    text: str
    entry: bank.Question | None  # the bank's entry with the model answer; None: the bank has none


def asked(path: Path, root: Path,
          questions: list[bank.Question] | None = None) -> tuple[list[Asked], list[bank.Question]]:
    """(the notebook's questions with their bank entries, the bank's other questions filed under this
    notebook)."""
    questions = bank.load() if questions is None else questions
    rel = path.relative_to(root).as_posix()
    course = [q for q in questions if not q.beyond_course]
    mine = [q for q in course if q.notebook == rel]
    used: set[str] = set()
    out = []
    for n, text in enumerate(questions_in(path), 1):
        entry = None
        for pool, key in ((mine, normalise), (course, normalise), (mine, _loose), (course, _loose)):
            hits = [q for q in pool if key(q.question) == key(text) and q.id not in used]
            if hits:
                entry = hits[0]
                break
        if entry is not None:
            used.add(entry.id)
        out.append(Asked(n, text, entry))
    stale = f"{path.stem}-q"  # an imported question this notebook no longer asks: the next import drops it
    return out, [q for q in mine if q.id not in used and not q.id.startswith(stale)]


def _imported(q: bank.Question) -> bool:
    """An entry of course.json: the instructor key's answer to a question a notebook asks ('05_...-q3')."""
    return q.notebook is not None and q.id.startswith(Path(q.notebook).stem + "-q")


def _wrap(text: str, indent: str) -> str:
    """Re-flow each paragraph to 96 columns under `indent`; words keep their hyphens whole."""
    pad = " " * len(indent)
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip()]
    return "\n".join(textwrap.fill(p, 96, initial_indent=indent if i == 0 else pad, subsequent_indent=pad,
                                   break_on_hyphens=False, break_long_words=False)
                     for i, p in enumerate(paragraphs))


def render(path: Path, root: Path, questions: list[bank.Question] | None = None) -> str:
    """What `minikv quiz --notebook ID` prints: each question, then its model answer and follow-ups."""
    questions = bank.load() if questions is None else questions
    found, extra = asked(path, root, questions)
    rel = path.relative_to(root).as_posix()
    folder = rel.split("/")[0]  # a student copy holds back the exercises' answers (course.json), not the notebooks'
    has_course = any(_imported(q) and q.notebook.startswith(folder + "/") for q in questions)
    lines = [f"{rel}: {len(found)} question{'s' * (len(found) != 1)}"]
    if not has_course:
        lines.append("(the model answers are the instructor's and not part of a student copy: ask your instructor)")
    for a in found:
        lines += ["", _wrap(a.text, f"Q{a.number}. ")]
        if a.entry is not None:
            heading = a.entry.heading if a.entry.heading.startswith('"') else f'"{a.entry.heading}"'  # never ""quoted""
            lines.append(f"    ({a.entry.topic} · {a.entry.difficulty} · taught in {heading})")
            lines.append(_wrap(a.entry.answer, "A:  "))
            for i, f in enumerate(a.entry.follow_ups):
                lines.append(_wrap(f, "    next: "))
                if i < len(a.entry.follow_up_answers):
                    lines.append(_wrap(a.entry.follow_up_answers[i], "          "))
        elif has_course:
            lines.append("A:  (no model answer in the bank yet: add one under this question in the instructor key, "
                         "then run python instructor/bank_import.py)")
    if extra:
        lines += ["", f"More questions on what {rel} teaches, from the bank:"]
        for q in extra:
            lines += ["", _wrap(q.question, "Q.  "), f"    ({q.topic} · {q.difficulty})", _wrap(q.answer, "A:  ")]
            lines += [_wrap(f, "    next: ") for f in q.follow_ups]
    if path.parent.name == "notebooks" and re.fullmatch(r"\d\d", short_id(path)):
        ids = notebooks(root)
        ex = [p for p in sorted((root / "exercises").glob(f"{short_id(path)}*.ipynb"))]
        if ex:
            lines += ["", "Its exercises ask more: " + ", ".join(
                f"minikv quiz --notebook {short_id(p) if ids[short_id(p)] == p else p.stem}" for p in ex)]
    return "\n".join(lines)


def export(path: Path, root: Path, questions: list[bank.Question] | None = None) -> str:
    """The same as JSON: one object per question (number, question, and the bank entry or null)."""
    found, extra = asked(path, root, questions)
    return json.dumps({"notebook": path.relative_to(root).as_posix(),
                       "questions": [{"number": a.number, "question": a.text,
                                      "entry": a.entry.to_dict() if a.entry else None} for a in found],
                       "also_in_bank": [q.to_dict() for q in extra]}, indent=1, ensure_ascii=False)
