"""The question bank, one topic at a time: each question with its answer folded under it (notebook 12).

`question_html` renders questions as HTML, each answer and its follow-ups in a <details> block;
`question_browser` is the widget: a dropdown of topics and the questions of the chosen one. It takes
the questions when it is built and reads nothing else.
"""
from __future__ import annotations

import html

from minikv.viz.view import view


def question_html(questions) -> str:
    """The questions as HTML, each answer folded in a <details> block."""
    items = []
    for q in questions:
        follow = "".join(f"<li>{html.escape(f)}</li>" for f in q.follow_ups)
        items.append(
            f"<details><summary><b>{html.escape(q.question)}</b> <i>({q.difficulty}; {html.escape(q.where)})</i>"
            f"</summary><p>{html.escape(q.answer)}</p><p>Follow-ups:</p><ul>{follow}</ul></details>")
    return "".join(items)


def question_browser(questions, topic: str | None = None):
    """A dropdown of the bank's topics (most questions first) over the questions of the chosen topic.
    `topic` is the one shown first (default: system-design when there is one, else the largest)."""
    import ipywidgets as w

    questions = list(questions)  # the view's own copy
    topics = sorted({q.topic for q in questions}, key=lambda t: -sum(q.topic == t for q in questions))
    if not topics:
        raise ValueError("no questions to show")
    if topic is None:
        topic = "system-design" if "system-design" in topics else topics[0]
    if topic not in topics:
        raise ValueError(f"no question of topic {topic!r}; topics: {', '.join(topics)}")
    pick = w.Dropdown(options=[(f"{t} ({sum(q.topic == t for q in questions)})", t) for t in topics],
                      value=topic, description="topic")
    shown = w.HTML()

    def chosen():
        return [q for q in questions if q.topic == pick.value]

    def update(_=None):
        shown.value = (f"<p>{len(chosen())} question(s) on <b>{html.escape(pick.value)}</b>: "
                       "click one to see its answer.</p>" + question_html(chosen()))

    pick.observe(update, names="value")
    update()

    def details() -> str:
        return f"topic {pick.value}:\n" + "\n".join(f"  - {q.question} ({q.difficulty})" for q in chosen())

    return view([pick, shown], "the question bank, one topic at a time", details=details)
