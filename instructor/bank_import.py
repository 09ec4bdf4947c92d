"""Copy the instructor key's questions and model answers into the interview question bank.

    python instructor/bank_import.py          rewrites minikv/interview/data/notebooks.json (the notebooks'
                                              questions, shipped to students) and course.json (the
                                              exercises' questions, held back from a student copy)

The bank (minikv/interview/data/) ships with the package, so `minikv quiz` works without this
folder. Every question the course asks and the key answers becomes one entry, with the notebook that
asks it and the heading of the section that teaches it (the section whose words best match the
question and its answer). What the key does not hold (difficulty, topic, follow-ups and their answers) is kept from
the entry already in the bank for the same notebook and question text (or for the same text in
another notebook: a question moved into an appendix keeps them); a question new to the bank
gets the notebook's topic, "standard", and no follow-up yet: the script lists them, and
tests/test_interview.py fails until each has one.
"""
from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BANK = ROOT / "minikv" / "interview" / "data" / "course.json"  # exercises/: graded work, held back
SHIPPED = ROOT / "minikv" / "interview" / "data" / "notebooks.json"  # notebooks/: in every copy

sys.path.insert(0, str(ROOT))
from minikv.interview.bank import unwrap  # noqa: E402

_spec = importlib.util.spec_from_file_location("instructor_questions", ROOT / "instructor" / "questions.py")
questions = importlib.util.module_from_spec(_spec)
sys.modules["instructor_questions"] = questions
_spec.loader.exec_module(questions)

# notebook or exercise prefix -> the topic its questions get by default
TOPICS = {
    "00_": "kv-size", "00b": "attention", "01": "attention", "02": "prefill-decode", "03": "batching",
    "04": "paged-kv", "05": "scheduling", "06": "prefix-caching", "07": "sharing", "08": "kernels",
    "09": "kv-compression", "10": "disaggregation", "11": "serving-metrics", "12": "system-design",
    "14": "parallelism",
}
_SKIP = re.compile(r"recap|question|hint|what you proved|your turn|^exercise|^\d\d\w? ·", re.I)
_WORD = re.compile(r"[a-z][a-z0-9_]{2,}")


def default_topic(source: str) -> str:
    name = Path(source).stem
    for prefix in sorted(TOPICS, key=len, reverse=True):
        if name.startswith(prefix):
            return TOPICS[prefix]
    return "general"


def sections(path: Path) -> list[tuple[str, str]]:
    """(heading, the text under it up to the next heading) for every markdown heading of a notebook;
    code cells count as text of their section; the answer cells under written questions (the learner's
    text, tagged written-answer) do not."""
    out: list[tuple[str, list[str]]] = []
    for cell in json.loads(path.read_text())["cells"]:
        if "written-answer" in cell.get("metadata", {}).get("tags", []):
            continue
        src = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
        for line in src.splitlines():
            if cell["cell_type"] == "markdown" and re.match(r"^#{1,4} ", line):
                out.append((line.lstrip("#").strip(), []))
            elif out:
                out[-1][1].append(line)
    return [(h, "\n".join(body)) for h, body in out]


def words(text: str) -> Counter:
    return Counter(_WORD.findall(text.lower()))


def teaching_heading(path: Path, text: str) -> str:
    """The heading of the section whose words match `text` best (tf-idf cosine); the title if none."""
    secs = sections(path)
    title = secs[0][0] if secs else path.stem
    candidates = [(h, words(h + " " + h + " " + body)) for h, body in secs if not _SKIP.search(h)]
    if not candidates:
        return title
    df = Counter(w for _, c in candidates for w in c)
    n = len(candidates)

    def vec(c: Counter) -> dict[str, float]:
        return {w: (1 + math.log(k)) * math.log(1 + n / df[w]) for w, k in c.items() if w in df}

    q = vec(words(text))
    qn = math.sqrt(sum(v * v for v in q.values())) or 1.0
    best, score = title, 0.0
    for h, c in candidates:
        d = vec(c)
        dn = math.sqrt(sum(v * v for v in d.values())) or 1.0
        s = sum(q[w] * d.get(w, 0.0) for w in q) / (qn * dn)
        if s > score:
            best, score = h, s
    return best


def build(old: list[dict]) -> tuple[list[dict], list[str]]:
    kept = {(e["notebook"], questions.normalise(e["question"])): e for e in old}
    moved = {questions.normalise(e["question"]): e for e in old if e["notebook"]}  # a question that changed notebook
    entries, new = [], []
    for q in questions.all_questions(ROOT):
        answers = questions.key_entries(q.key_file)
        text = questions.normalise(q.text)
        if text not in answers:
            raise SystemExit(f"{q.source} Q{q.number} has no answer in {q.key_file}; answer it there first")
        prev = kept.get((q.source, text)) or moved.get(text, {})
        entry = {
            "id": f"{Path(q.source).stem}-q{q.number}",
            "question": text,
            "answer": unwrap(answers[text]),  # one line per paragraph: the key wraps at its own width
            "follow_ups": prev.get("follow_ups", []),
            **({"follow_up_answers": prev["follow_up_answers"]} if prev.get("follow_up_answers") else {}),
            "difficulty": prev.get("difficulty", "standard"),
            "topic": prev.get("topic", default_topic(q.source)),
            "notebook": q.source,
            "heading": teaching_heading(ROOT / q.source, text + " " + answers[text]),
        }
        if not prev:
            new.append(entry["id"])
        entries.append(entry)
    return entries, new


def main() -> int:
    old = [e for path in (SHIPPED, BANK) if path.exists() for e in json.loads(path.read_text())]
    entries, new = build(old)
    for path, part in ((SHIPPED, [e for e in entries if not e["notebook"].startswith("exercises/")]),
                       (BANK, [e for e in entries if e["notebook"].startswith("exercises/")])):
        path.write_text(json.dumps(part, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {len(part)} questions to {path.relative_to(ROOT)}")
    if new:
        print(f"{len(new)} new: give each a difficulty, a topic and follow-ups: {', '.join(new)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
