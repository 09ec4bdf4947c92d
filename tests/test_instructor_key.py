"""Every question the course asks has a model answer in the instructor key (instructor/), and the key
answers nothing the course no longer asks.

What counts as a question is defined in instructor/questions.py (items of a list that a line mentioning
"question" introduces: a heading, a bold line, or a line ending in ':'); the rule is pinned down below on
small examples, so a reformatted question section cannot silently drop out of the check.
"""
from __future__ import annotations

import difflib
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("instructor_questions", ROOT / "instructor" / "questions.py")
questions = importlib.util.module_from_spec(_spec)
sys.modules["instructor_questions"] = questions
_spec.loader.exec_module(questions)

ALL = questions.all_questions(ROOT)
SOURCES = sorted({q.source for q in ALL})
NOTEBOOKS = sorted(f"{p.parent.name}/{p.name}" for folder in questions.FOLDERS for p in (ROOT / folder).glob("*.ipynb"))


def test_every_notebook_and_exercise_asks_questions_the_finder_sees():
    silent = [nb for nb in NOTEBOOKS if nb not in SOURCES]
    assert not silent, (f"{silent}: no question found; end the notebook with '## Questions an interviewer might "
                        "ask' and a numbered list (see instructor/questions.py)")


@pytest.mark.parametrize("source", SOURCES)
def test_every_question_has_an_answer_in_the_key(source):
    asked = [q for q in ALL if q.source == source]
    key_file = asked[0].key_file
    entries = questions.key_entries(key_file)
    missing = []
    for q in asked:
        text = questions.normalise(q.text)
        if text not in entries:
            near = difflib.get_close_matches(text, list(entries), n=1, cutoff=0.6)
            missing.append(f"Q{q.number} {q.text!r}" + (f"\n    the key has a near match, reword it: {near[0]!r}"
                                                       if near else ""))
    assert not missing, (f"{source}: {len(missing)} of {len(asked)} questions have no answer in "
                         f"{key_file.relative_to(ROOT)}:\n  " + "\n  ".join(missing))
    for q in asked:
        answer = entries[questions.normalise(q.text)]
        assert 80 <= len(answer) <= 1500, (f"{source} Q{q.number}: an answer of {len(answer)} characters; keep it to "
                                           "a few sentences (2-6)")


@pytest.mark.parametrize("folder", questions.FOLDERS)
def test_the_key_answers_only_questions_the_course_asks(folder):
    asked = {(q.source, questions.normalise(q.text)) for q in ALL}
    stale = []
    for key_file in sorted((ROOT / "instructor" / folder).glob("*.md")):
        source = f"{folder}/{key_file.stem}.ipynb"
        assert (ROOT / source).exists(), f"{key_file.relative_to(ROOT)} answers {source}, which does not exist"
        stale += [f"{source}: {text!r}" for text in questions.key_entries(key_file) if (source, text) not in asked]
    assert not stale, "the key answers questions the course no longer asks:\n  " + "\n  ".join(stale)


CELL = """Some text that mentions a question in passing; the list below has no introducing line.

1. not a question

## Interview questions

1. First, on one line?
2. Second, on two
   lines?
- Third, a bullet?

A closing paragraph.

**Questions an interviewer might ask**
- Bold-introduced?

Questions to answer before moving on:

1. Colon-introduced?
Trailing text ends the list.
3. not a question (after the list ended)
"""


def test_what_counts_as_a_question():
    assert questions.questions_in_markdown(CELL) == [
        "First, on one line?", "Second, on two lines?", "Third, a bullet?", "Bold-introduced?",
        "Colon-introduced?"]


def test_key_entries_read_headings_and_answers(tmp_path):
    key = tmp_path / "k.md"
    key.write_text("# title\n\nintro\n\n## Q1. First,   on one line?\n\nThe answer.\nIts second line.\n\n"
                   "## Q2. Second?\n\nAnother.\n")
    assert questions.key_entries(key) == {"First, on one line?": "The answer.\nIts second line.",
                                          "Second?": "Another."}


EXERCISE_QUESTIONS = [q for q in ALL if q.source.startswith("exercises/")]


@pytest.mark.parametrize("source", sorted({q.source for q in EXERCISE_QUESTIONS}))
def test_every_written_question_of_an_exercise_has_a_rubric_with_points_and_levels(source):
    asked = [q for q in EXERCISE_QUESTIONS if q.source == source]
    rubrics = questions.key_rubrics(asked[0].key_file)
    for q in asked:
        rubric = rubrics.get(q.text)
        assert rubric, f"{q.key_file.name} Q{q.number}: no '**Rubric**' under the model answer"
        points = [line for line in rubric.splitlines() if line.startswith("- ")]
        assert len(points) >= 2, f"{q.key_file.name} Q{q.number}: name at least two points the answer must make"
        for level in ("2,", "1,", "0,"):
            assert f" {level}" in " ".join(rubric.split()), f"{q.key_file.name} Q{q.number}: level {level[0]} missing"


def test_a_rubric_is_not_part_of_the_model_answer(tmp_path):
    key = tmp_path / "k.md"
    key.write_text("## Q1. First?\n\nThe answer.\n\n**Rubric** (2 points). The points expected:\n\n- one\n- two\n\n"
                   "Levels: 2, both; 1, one; 0, none.\n\n## Q2. Second?\n\nAnother.\n")
    assert questions.key_entries(key) == {"First?": "The answer.", "Second?": "Another."}
    assert list(questions.key_rubrics(key)) == ["First?"]
    assert questions.key_rubrics(key)["First?"].startswith("**Rubric**")


def test_the_solutions_answer_cells_hold_the_keys_model_answers():
    import json

    from minikv.classroom.notebooks import written_answers

    for source in sorted({q.source for q in EXERCISE_QUESTIONS}):
        asked = [q for q in EXERCISE_QUESTIONS if q.source == source]
        key = questions.key_entries(asked[0].key_file)
        solved = written_answers(json.loads((ROOT / "solutions" / source.split("/")[1]).read_text()))
        assert [(w.question, " ".join(w.answer.split())) for w in solved] == [
            (q.text, " ".join(key[q.text].split())) for q in asked], (
            f"{source}: run python instructor/answer_cells.py")
