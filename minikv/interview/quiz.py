"""`minikv quiz`: random questions from the bank, the model answer on a key press, a running score.

    minikv quiz                              10 random questions
    minikv quiz --topic prefix-caching -n 5  only one topic (--topics lists them)
    minikv quiz --difficulty hard            only one difficulty
    minikv quiz --export json                the whole bank (after the filters) as JSON, then exit
    minikv quiz --scores                     what the score file holds, per topic
    minikv quiz --notebook 05                the questions notebook 05 asks, with their model answers
                                             (minikv/interview/asked.py)

For each question: read it, answer aloud or on paper, press Enter (or any key) for the model answer
and the follow-ups, then say how it went: y (got it), p (partly), n (missed), q (stop). Scores go to
$MINIKV_HOME/quiz_scores.json (default ~/.minikv): per question, how often seen, got, partly, missed;
questions missed before come first in later sessions.
"""
from __future__ import annotations

import json
import re
import textwrap
import time
from pathlib import Path
from typing import Callable, TextIO

from minikv.interview import bank
from minikv.interview.drills import home

GRADES = {"y": "got", "p": "partly", "n": "missed"}


def scores_file() -> Path:
    return home() / "quiz_scores.json"


def load_scores(path: Path | None = None) -> dict:
    path = path or scores_file()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"questions": {}, "sessions": []}
    data.setdefault("questions", {})
    data.setdefault("sessions", [])
    return data


def save_scores(data: dict, path: Path | None = None) -> None:
    path = path or scores_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def record(data: dict, qid: str, grade: str) -> None:
    entry = data["questions"].setdefault(qid, {"seen": 0, "got": 0, "partly": 0, "missed": 0})
    entry["seen"] += 1
    entry[GRADES[grade]] += 1


def order(questions: list[bank.Question], data: dict, n: int, seed: int | None) -> list[bank.Question]:
    """n questions: those missed last time first, then never seen, then the rest; random within each."""
    shuffled = bank.draw(questions, len(questions), seed)

    def rank(q: bank.Question) -> int:
        s = data["questions"].get(q.id)
        if s is None:
            return 1
        return 0 if s["missed"] + s["partly"] > s["got"] else 2

    return sorted(shuffled, key=rank)[:n]


def read_key(stream: TextIO) -> str:
    """One key press on a terminal; one line (its first character) otherwise. '' at the end of input."""
    if stream.isatty():
        try:
            import termios
            import tty

            fd = stream.fileno()
            old = termios.tcgetattr(fd)
            try:
                tty.setcbreak(fd)
                return stream.read(1)
            finally:
                termios.tcsetattr(fd, termios.TCSADRAIN, old)
        except (ImportError, OSError):
            pass
    line = stream.readline()
    if not line:
        return ""
    return line.strip()[:1] or "\n"


def _wrap(text: str, indent: str = "  ") -> str:
    """Re-flow the answer's paragraphs (the key wraps its lines at its own width) to the terminal's."""
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip()]
    pad = " " * len(indent)
    return "\n".join(textwrap.fill(p, 96, initial_indent=indent if i == 0 else pad, subsequent_indent=pad)
                     for i, p in enumerate(paragraphs))


def run(questions: list[bank.Question], stdin: TextIO, stdout: TextIO, scores: Path | None = None,
        key: Callable[[TextIO], str] = read_key) -> dict:
    """Ask the questions; return {"asked", "got", "partly", "missed"} and save the score file."""
    data = load_scores(scores)
    tally = {"asked": 0, "got": 0, "partly": 0, "missed": 0}
    say = lambda text="": print(text, file=stdout, flush=True)  # noqa: E731
    for i, q in enumerate(questions, 1):
        say(f"\n[{i}/{len(questions)}] {q.topic} · {q.difficulty} · {q.where}")
        say("Q: " + textwrap.fill(q.question, 96, subsequent_indent="   "))
        say("   (press Enter for the model answer, q to stop)")
        k = key(stdin)
        if k in ("q", ""):
            break
        say("A:")
        say(_wrap(q.answer))
        if q.follow_ups:
            say("Follow-ups:")
            for f in q.follow_ups:
                say(_wrap(f, "  - "))
        say("How did it go? y got it / p partly / n missed / q stop")
        grade = key(stdin).lower()
        while grade not in ("y", "p", "n", "q", ""):
            say("   y, p, n or q")
            grade = key(stdin).lower()
        if grade in ("q", ""):
            break
        record(data, q.id, grade)
        tally["asked"] += 1
        tally[GRADES[grade]] += 1
    if tally["asked"]:
        data["sessions"].append({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), **tally})
        save_scores(data, scores)
        say(f"\nscore: {tally['got']} got, {tally['partly']} partly, {tally['missed']} missed of {tally['asked']} "
            f"(saved to {scores or scores_file()})")
    return tally


def summary(data: dict, questions: list[bank.Question]) -> str:
    by_topic: dict[str, list[int]] = {}
    for q in questions:
        s = data["questions"].get(q.id)
        row = by_topic.setdefault(q.topic, [0, 0, 0, 0])  # questions, seen, got, missed
        row[0] += 1
        if s:
            row[1] += 1
            row[2] += s["got"] > s["missed"] + s["partly"]
            row[3] += s["missed"] + s["partly"] >= s["got"]
    lines = [f"{'topic':22s} {'questions':>9s} {'seen':>5s} {'mostly got':>10s} {'to review':>9s}"]
    for topic, (n, seen, got, missed) in sorted(by_topic.items()):
        lines.append(f"{topic:22s} {n:9d} {seen:5d} {got:10d} {missed:9d}")
    lines.append(f"{len(data['sessions'])} sessions")
    return "\n".join(lines)
