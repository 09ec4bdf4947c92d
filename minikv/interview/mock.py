"""`minikv mock`: a mock interview, and `minikv progress`: what the quiz, drills, labs and mocks recorded.

    minikv mock --minutes 45 --track inference-engineer     rapid-fire questions with follow-up chains,
                                                            one timed drill, one staged design prompt,
                                                            a rubric to score yourself, a written report
    minikv progress                                         quiz by topic, drills, labs, mock reports

A mock reads the candidate's keys from stdin (Enter to reveal, y / p / n to grade), so it can be
scripted. The report goes to $MINIKV_HOME/mocks/mock-<time>.md (default ~/.minikv).
"""
from __future__ import annotations

import random
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TextIO

from minikv.interview import bank, clock, quiz

TRACKS = {
    "inference-engineer": dict(
        topics=("paged-kv", "prefix-caching", "scheduling", "kernels", "speculative-decoding", "quantization",
                "serving-metrics", "preemption", "kv-size"),
        drills=("kv-decode-step", "slot-mapping-allocator", "copy-on-write", "lru-block-budget", "radix-tree"),
        designs=("chat-slo", "tp-degree")),
    "ml-systems": dict(
        topics=("parallelism", "moe", "quantization", "serving-metrics", "system-design", "disaggregation",
                "production", "kernels"),
        drills=("online-softmax-split-k", "speculative-rollback", "gqa-attention", "scheduler-preemption"),
        designs=("pd-sizing", "tp-degree")),
}
POINTS = {"y": 2, "p": 1, "n": 0}


@dataclass(frozen=True)
class Design:
    name: str
    prompt: str
    stages: tuple[tuple[str, str], ...]  # (what the interviewer asks at this stage, what a strong answer covers)


DESIGNS = {d.name: d for d in [
    Design("chat-slo", "A chat product: 50 requests/s, each with a 2,000-token system prompt shared by all, 1,000 "
           "tokens of conversation and a 300-token answer. SLO: TTFT under 1 s, TPOT under 50 ms. Llama-3.1-8B on "
           "H100s. How many GPUs?",
           (("Requirements: what do you assume, and what do you ask?",
             "traffic shape (mean and peak rate, prompt and answer lengths), SLO percentiles, model and dtype, "
             "multi-turn or not, how much of the prompt is shared"),
            ("Estimate: concurrency, prefill compute, KV memory.",
             "Little's law 50/s x 9.5 s = about 475 in flight; 150k prefill tokens/s without caching (about five "
             "GPUs at 50% MFU); 3,300 tokens of KV each; with the system prompt cached, 50k tokens/s and 1,300 "
             "tokens: 2 GPUs at the limit, 3 with headroom"),
            ("Architecture and trade-offs.",
             "prefix caching with cache-aware routing, chunked prefill to protect TPOT, fp8 as a lever with its "
             "quality cost, disaggregation only at larger scale, a load test at the target rate to confirm"))),
    Design("tp-degree", "Llama-3-70B on one node of 8 H100s: one replica at TP 8, or two at TP 4? Decide for a "
           "product with 8k-token chats and a 30 ms TPOT target.",
           (("What decides it?", "KV capacity (weights stored once or twice), step latency (weight bytes per GPU), "
             "all-reduce cost, failure domains, request mix"),
            ("Numbers.", "TP 8: about 1.35M tokens of KV (164 sequences of 8k); 2 x TP 4: about 0.92M tokens; TP 8 "
             "reads half the weight bytes per GPU per step"),
            ("Recommendation and how to verify.", "TP 8 for long chats and a tight TPOT; 2 x TP 4 for many short "
             "requests; confirm with an open-loop load test at the target rate (p99 TTFT, TPOT, preemptions)"))),
    Design("pd-sizing", "20 requests/s with 4,000-token prompts and 500-token answers on Llama-3-70B, TTFT under "
           "1 s and TPOT under 40 ms. Size a disaggregated deployment.",
           (("Prefill side.", "80k prompt tokens/s; about 150 ms per 4k prefill at TP 8 and 50% MFU, so about 6.6 "
             "requests/s per instance: 3 to 4 TP-8 instances"),
            ("Decode side.", "Little's law: 400 in flight holding up to 4,500 tokens (1.4 GiB each); a TP-8 node "
             "holds about 300 such requests; 2 nodes at the limit, 3 with headroom"),
            ("Transfer and the alternative.", "1.2 GiB of KV per request over eight 400 Gb/s NICs is about 3 ms, "
             "layer by layer; compare with one pool and chunked prefill, which is simpler if TPOT p99 holds"))),
]}
RUBRIC = (
    "stated assumptions (traffic, SLOs, dtypes) before computing",
    "computed weights, then KV per token (GQA, TP replication), then the pool and the batch",
    "bounded decode by bytes and prefill by FLOPs",
    "used Little's law to turn a rate into concurrency",
    "named the levers and their price, and how to measure the estimate",
)


def mocks_dir() -> Path:
    return clock.home() / "mocks"


def run(minutes: int, track: str, stdin: TextIO, stdout: TextIO, seed: int | None = None,
        key: Callable[[TextIO], str] = quiz.read_key, now: float | None = None) -> Path:
    """Run one mock interview; return the path of its written report."""
    if track not in TRACKS:
        raise ValueError(f"unknown track {track!r}; choose one of {', '.join(TRACKS)}")
    if minutes < 15:
        raise ValueError(f"--minutes {minutes} leaves no time for a drill and a design; give it at least 15")
    rng = random.Random(seed)
    t = TRACKS[track]
    say = lambda text="": print(text, file=stdout, flush=True)  # noqa: E731
    began = time.time() if now is None else now
    questions = [q for q in bank.load() if q.topic in t["topics"] and q.follow_ups]
    n_rapid = max(3, minutes // 8)
    answered = [q for q in questions if len(q.follow_up_answers) == len(q.follow_ups)]  # whole chains first
    questions = answered if len(answered) >= n_rapid else questions
    picked = bank.one_per_group(rng.sample(questions, len(questions)))[:n_rapid]
    drill_name = rng.choice(t["drills"])
    design = DESIGNS[rng.choice(t["designs"])]
    from minikv.interview.drills import DRILLS

    drill = DRILLS[drill_name]
    say(f"Mock interview, {track} track, {minutes} minutes: {len(picked)} rapid-fire questions (about "
        f"{max(1, (minutes - drill.minutes) // 2 // max(1, len(picked)))} min each), the {drill.name} drill "
        f"({drill.minutes} min), one design question. Answer aloud or on paper; Enter reveals, y / p / n grades.")
    report = [f"# Mock interview: {track}, {minutes} minutes", "",
              f"started {time.strftime('%Y-%m-%d %H:%M', time.localtime(began))}", "", "## Rapid-fire", ""]
    score, most = 0, 0
    stopped = False
    for i, q in enumerate(picked, 1):
        say(f"\n[{i}/{len(picked)}] {q.id} · {q.topic}\nQ: " + textwrap.fill(q.question, 96, subsequent_indent="   "))
        grades = []
        for j, text in enumerate([q.question, *q.follow_ups]):
            if j:
                say("Follow-up: " + textwrap.fill(text, 96, subsequent_indent="   "))
            if key(stdin) in ("q", ""):
                stopped = True
                break
            answer = q.answer if j == 0 else (q.follow_up_answers[j - 1] if j - 1 < len(q.follow_up_answers)
                                              else "(no model answer yet: compare with the notebook that teaches it)")
            say("A: " + textwrap.fill(answer, 96, subsequent_indent="   "))
            say("   y / p / n")
            grade = key(stdin).lower()
            while grade not in POINTS and grade not in ("q", ""):
                grade = key(stdin).lower()
            if grade in ("q", ""):
                stopped = True
                break
            grades.append(grade)
        if grades:
            got = sum(POINTS[g] for g in grades)
            score, most = score + got, most + 2 * len(grades)
            report.append(f"- `{q.id}` ({q.topic}): {got} / {2 * len(grades)}"
                          + ("" if all(g == "y" for g in grades) else f" — review: `minikv quiz --id {q.id}`"))
        if stopped:
            break
    report += ["", f"rapid-fire score: {score} / {most}", "", "## Drill", ""]
    if not stopped:
        clock.start(drill.name, restart=True, now=now)
        say(f"\nDrill: {drill.name} ({drill.minutes} min). In another terminal: `minikv drill start {drill.name}` "
            f"then `minikv drill check {drill.name}` until it passes. The clock runs now. Enter when done.")
        stopped = key(stdin) in ("q", "")
    entry = clock.get(drill.name) or {}
    passed = entry.get("passed_after") is not None
    report.append(f"- {drill.name}: " + (clock.describe(entry, drill.minutes, "drill", drill.name).removeprefix(
        "time: ") if entry else "not started"))
    report += ["", "## Design", "", f"> {design.prompt}", ""]
    rubric_score = 0
    if not stopped:
        say(f"\nDesign: {design.prompt}")
        for stage, (ask, covers) in enumerate(design.stages, 1):
            say(f"\nStage {stage}: {ask} (Enter when you have answered)")
            if key(stdin) in ("q", ""):
                stopped = True
                break
            say("A strong answer covers: " + textwrap.fill(covers, 96, subsequent_indent="   "))
            report.append(f"{stage}. {ask} — a strong answer covers: {covers}")
        if not stopped:
            say("\nScore yourself on the rubric: y (did it), p (partly), n (did not)")
            report += ["", "Rubric:", ""]
            for item in RUBRIC:
                say(f"- {item}?")
                grade = key(stdin).lower()
                while grade not in POINTS and grade not in ("q", ""):
                    grade = key(stdin).lower()
                if grade in ("q", ""):
                    break
                rubric_score += POINTS[grade]
                report.append(f"- {item}: {POINTS[grade]} / 2")
    report += ["", f"design rubric: {rubric_score} / {2 * len(RUBRIC)}", "",
               f"minutes used: {((time.time() if now is None else now) - began) / 60:.0f} of {minutes}", ""]
    folder = mocks_dir()
    folder.mkdir(parents=True, exist_ok=True)
    base = f"mock-{time.strftime('%Y%m%d-%H%M%S', time.localtime(began))}-{track}"
    path, n = folder / f"{base}.md", 1
    while path.exists():
        n += 1
        path = folder / f"{base}-{n}.md"
    path.write_text("\n".join(report))
    say(f"\nrapid-fire {score}/{most}, drill {'passed' if passed else 'not passed'}, design rubric "
        f"{rubric_score}/{2 * len(RUBRIC)}; report written to {path}")
    return path


def progress() -> str:
    """Quiz by topic, drills and labs with their clocks, mock reports."""
    from minikv.interview.bugs import LABS
    from minikv.interview.drills import DRILLS

    questions = bank.load()
    scores = quiz.load_scores()
    lines = ["quiz", quiz.summary(scores, questions),
             f"due today: {len(quiz.due(questions, scores))}, missed last time: {len(quiz.missed(questions, scores))}",
             "", "drills"]
    clocks = clock.load()
    for d in DRILLS.values():
        entry = clocks.get(d.name)
        lines.append(f"  {d.name:26s} " + (clock.describe(entry, d.minutes, "drill", d.name).removeprefix("time: ")
                                          if entry else "not started"))
    lines += ["", "bug labs"]
    for lab in LABS.values():
        entry = clocks.get(lab.clock_name)
        state = "not started" if not entry else "fixed" if entry.get("passed_after") is not None else "not fixed"
        lines.append(f"  {lab.name:26s} {state}" + (f", {entry.get('attempts', 0)} checks" if entry else ""))
    reports = sorted(mocks_dir().glob("mock-*.md")) if mocks_dir().is_dir() else []
    lines += ["", f"mock interviews: {len(reports)}" + (f", last {reports[-1]}" if reports else "")]
    return "\n".join(lines)
