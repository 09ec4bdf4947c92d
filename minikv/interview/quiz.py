"""`minikv quiz`: random questions from the bank, the model answer on a key press, a running score.

    minikv quiz                              10 random questions
    minikv quiz --topic prefix-caching -n 5  only one topic (--topics lists them)
    minikv quiz --difficulty hard            only one difficulty
    minikv quiz --export json                the whole bank (after the filters) as JSON, then exit
    minikv quiz --scores                     what the score file holds, per topic
    minikv quiz --notebook 05                the questions notebook 05 asks, with their model answers
                                             (minikv/interview/asked.py)
    minikv quiz --due                        the questions spaced repetition says are due today
    minikv quiz --id ID --grep WORD --missed one question, a word anywhere, those missed before
    minikv quiz --seed 7                     the same questions in the same order (the score file is ignored)
    minikv quiz --export md | anki | json    a study sheet, Anki cards (tab-separated), or JSON

For each question: read it, answer aloud or on paper, press Enter (or any key) for the model answer
and the follow-ups, then say how it went: y (got it), p (partly), n (missed), q (stop). Scores go to
$MINIKV_HOME/quiz_scores.json (default ~/.minikv): per question, how often seen, got, partly, missed;
questions missed before come first in later sessions.

Spaced repetition (SM-2, as in SuperMemo and Anki): each grade sets when the question is due again:
y (5) doubles and more the interval (1 day, 6 days, then interval x ease), p (3) keeps it growing
slowly and lowers the ease, n (1) starts over at 1 day. `--due` asks what is due.
"""
from __future__ import annotations

import json
import re
import textwrap
import time
from pathlib import Path
from typing import Callable, TextIO

from minikv.interview import bank
from minikv.interview.clock import home

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


QUALITY = {"y": 5, "p": 3, "n": 1}  # SM-2's 0-5 quality of recall


def today() -> int:
    """Days since the epoch, local time: the unit of SM-2's intervals."""
    return int((time.time() - time.timezone) // 86400)


def record(data: dict, qid: str, grade: str, day: int | None = None) -> None:
    entry = data["questions"].setdefault(qid, {"seen": 0, "got": 0, "partly": 0, "missed": 0})
    entry["seen"] += 1
    entry[GRADES[grade]] += 1
    entry["last"] = GRADES[grade]
    schedule(entry, QUALITY[grade], today() if day is None else day)


def schedule(entry: dict, quality: int, day: int) -> None:
    """SM-2: the next interval from the repetitions so far, the ease and this recall's quality."""
    ease, reps, interval = entry.get("ease", 2.5), entry.get("reps", 0), entry.get("interval", 0)
    if quality < 3:
        reps, interval = 0, 1
    else:
        reps += 1
        interval = 1 if reps == 1 else 6 if reps == 2 else round(interval * ease)
    ease = max(1.3, ease + 0.1 - (5 - quality) * (0.08 + (5 - quality) * 0.02))
    entry.update(ease=round(ease, 3), reps=reps, interval=interval, due=day + interval)


def due(questions: list[bank.Question], data: dict, day: int | None = None) -> list[bank.Question]:
    """Questions seen before whose interval has passed, most overdue first."""
    day = today() if day is None else day
    seen = [(data["questions"][q.id].get("due", day), i, q) for i, q in enumerate(questions)
            if q.id in data["questions"]]
    return [q for d, _, q in sorted(seen) if d <= day]


def missed(questions: list[bank.Question], data: dict) -> list[bank.Question]:
    """Questions whose last grade was partly or missed (or, in an older score file, missed more than got)."""
    out = []
    for q in questions:
        s = data["questions"].get(q.id)
        if s and (s.get("last") in ("partly", "missed") if "last" in s else s["missed"] + s["partly"] > s["got"]):
            out.append(q)
    return out


def order(questions: list[bank.Question], data: dict, n: int, seed: int | None) -> list[bank.Question]:
    """n questions: those missed last time first, then never seen, then the rest; random within each.
    With a seed, the draw depends on the seed alone (the score file is ignored): the same list again."""
    if seed is not None:
        return bank.draw(questions, n, seed)
    shuffled = bank.draw(questions, len(questions), None)

    def rank(q: bank.Question) -> int:
        s = data["questions"].get(q.id)
        if s is None:
            return 1
        return 0 if s["missed"] + s["partly"] > s["got"] else 2

    return bank.one_per_group(sorted(shuffled, key=rank))[:n]


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
        say(f"\n[{i}/{len(questions)}] {q.id} · {q.topic} · {q.difficulty} · {q.where}")
        say("Q: " + textwrap.fill(q.question, 96, subsequent_indent="   "))
        say("   (press Enter for the model answer, q to stop)")
        k = key(stdin)
        if k in ("q", ""):
            break
        say("A:")
        say(_wrap(q.answer))
        if q.follow_ups:
            say("Follow-ups:")
            for j, f in enumerate(q.follow_ups):
                say(_wrap(f, "  - "))
                if j < len(q.follow_up_answers):
                    say("    (Enter: its answer)")
                    if key(stdin) in ("q", ""):
                        break
                    say(_wrap(q.follow_up_answers[j], "    "))
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
