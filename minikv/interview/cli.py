"""The `quiz`, `drill` and `bugs` verbs of the `minikv` command (minikv/cli.py hands them over here)."""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

QUIZ_HELP = """Interview questions with model answers: the course's own (with the notebook and section that teach
each) and questions beyond the course (MLA, speculative decoding, disaggregation, ...). Press a key for
the answer and the follow-ups, then grade yourself (y / p / n); scores are kept in
$MINIKV_HOME/quiz_scores.json (default ~/.minikv), and questions you missed come back first.
`--notebook 05` prints the questions notebook 05 asks, each with its model answer (8b, 06a, or a
notebook's file name work too)."""

DRILL_HELP = """Timed coding drills, the exercises interviews give (KV cache, block manager, radix tree, ...).
`start NAME` writes drill_NAME.py into the current folder, prints the statement and starts the clock;
`start NAME` again keeps the clock running (`--restart` resets it); `check NAME [FILE]` runs the
course's checker on fresh random cases and prints the diagnosis and the time taken against the
limit; the first pass stops the clock and records the time and the number of checks; `status` shows
the time left. A drill file that imports the engine's answer from minikv fails.
Exit status of check: 0 passed, 1 failed."""

BUGS_HELP = """Find-the-bug labs: the real engine with one realistic bug planted through a named seam (a prefix
cache, copy-on-write, a decode step, the slot mapping, an allocator, causal attention). `start NAME`
writes bug_NAME.py (the buggy code, the symptom, the tools to localize it) into the current folder;
fix it there and `check NAME` runs the lab's scenario against the engine's own code, on random prompts
from a printed seed. A fix must keep the team's code plugged in and the feature working. `hint NAME`
when stuck; `start` starts a clock as the drills do (`status` shows it). Exit status of check: 0 the
scenario runs as on the engine's own code, 1 the bug shows."""


def add_parsers(sub) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    from minikv.interview.bank import DIFFICULTIES

    q = sub.add_parser("quiz", help="interview questions with model answers; a score kept locally",
                       description=QUIZ_HELP, formatter_class=fmt)
    q.add_argument("--topic", help="only this topic (--topics lists them; aliases such as tp, spec, fp8 work)")
    q.add_argument("--difficulty", choices=DIFFICULTIES, help="only this difficulty")
    q.add_argument("--beyond", action="store_true", help="only questions beyond the course")
    q.add_argument("-n", "--num", type=int, default=10, help="how many questions (default 10)")
    q.add_argument("--seed", type=int, default=None, help="the same questions in the same order again")
    q.add_argument("--export", choices=["json", "md", "anki"],
                   help="print the questions (after the filters) as JSON, a Markdown study sheet or Anki cards "
                        "(tab-separated: File > Import in Anki), and exit")
    q.add_argument("--id", action="append", metavar="ID", help="this question (repeat for more)")
    q.add_argument("--grep", metavar="TEXT", help="only questions whose question or answer contains TEXT")
    q.add_argument("--missed", action="store_true", help="only questions graded partly or missed last time")
    q.add_argument("--due", action="store_true", help="only questions spaced repetition says are due today")
    q.add_argument("--topics", action="store_true", help="list the topics with their number of questions")
    q.add_argument("--scores", action="store_true", help="print your scores per topic")
    q.add_argument("--notebook", metavar="ID", help="print the questions one notebook asks, with their model "
                   "answers, and exit: 05, 8b, 05_continuous_batching, 06a (an exercise)")

    d = sub.add_parser("drill", help="timed coding drills checked on hidden random cases",
                       description=DRILL_HELP, formatter_class=fmt)
    dsub = d.add_subparsers(dest="drill_cmd", required=True)
    dl = dsub.add_parser("list", help="the drills and their time limits")
    dl.add_argument("--json", action="store_true", help="one JSON list: name, minutes, title, functions")
    ds = dsub.add_parser("start", help="write drill_NAME.py here, print the statement, start the clock")
    ds.add_argument("name")
    ds.add_argument("--force", action="store_true", help="overwrite an existing drill file")
    ds.add_argument("--restart", action="store_true", help="reset a running clock (default: keep it running)")
    dsub.add_parser("status", help="the drills' clocks: time used and left, checks, passed or not")
    dc = dsub.add_parser("check", help="check your drill file; prints the diagnosis and the time taken")
    dc.add_argument("name")
    dc.add_argument("file", nargs="?", type=Path, help="default: drill_NAME.py in the current folder")
    which = dc.add_mutually_exclusive_group()
    which.add_argument("--reference", action="store_true", help="check the shipped reference (passes)")
    which.add_argument("--starter", action="store_true", help="check the untouched starter (fails)")
    dc.add_argument("--seed", type=int, default=None, help="rerun the random cases of an earlier check")
    dc.add_argument("--json", action="store_true", help="print the result as one JSON object")
    dc.add_argument("--timeout", type=float, default=120.0, help="seconds before a check that has not returned fails")

    b = sub.add_parser("bugs", help="find-the-bug labs on the real engine",
                       description=BUGS_HELP, formatter_class=fmt)
    bsub = b.add_subparsers(dest="bugs_cmd", required=True)
    bl = bsub.add_parser("list", help="the labs, their symptom and seam")
    bl.add_argument("--json", action="store_true", help="one JSON list: name, seam, symptom")
    bs = bsub.add_parser("start", help="write bug_NAME.py here and print the symptom and the tools")
    bs.add_argument("name")
    bs.add_argument("--force", action="store_true", help="overwrite an existing lab file")
    bs.add_argument("--restart", action="store_true", help="reset a running clock (default: keep it running)")
    bh = bsub.add_parser("hint", help="a hint for a lab: the tools first, then where to look")
    bh.add_argument("name")
    bh.add_argument("--level", type=int, default=1, help="1: the tools to localize it; 2: where to look")
    bsub.add_parser("status", help="the labs' clocks: time used, checks, fixed or not")
    bc = bsub.add_parser("check", help="run the lab's scenario on your fixed file")
    bc.add_argument("name")
    bc.add_argument("file", nargs="?", type=Path, help="default: bug_NAME.py in the current folder")
    which = bc.add_mutually_exclusive_group()
    which.add_argument("--buggy", action="store_true", help="run the shipped buggy code (the bug shows)")
    which.add_argument("--fixed", action="store_true", help="run the shipped fixed code (passes)")
    bc.add_argument("--seed", type=int, default=None, help="replay the random prompts of an earlier check")
    bc.add_argument("--json", action="store_true", help="print the result as one JSON object")
    bc.add_argument("--timeout", type=float, default=120.0, help="seconds before a check that has not returned fails")


    m = sub.add_parser("mock", help="a mock interview: rapid-fire questions, a timed drill, a staged design prompt",
                       description=MOCK_HELP, formatter_class=fmt)
    m.add_argument("--minutes", type=int, default=45, help="length of the interview (default 45)")
    m.add_argument("--track", default="inference-engineer", choices=["inference-engineer", "ml-systems"])
    m.add_argument("--seed", type=int, default=None, help="the same questions, drill and design again")
    sub.add_parser("progress", help="what you did: quiz by topic, drills and labs with their clocks, mock reports")
    g = sub.add_parser("design", help="the system-design calculators: KV, pool, batch and step-time bounds",
                       description=DESIGN_HELP, formatter_class=fmt)
    g.add_argument("--model", default="Llama-3-70B", help="a model of minikv/model/shapes.py (default Llama-3-70B)")
    g.add_argument("--gpu", default="H100-SXM", help="H100-SXM, H200 or A100-80GB")
    g.add_argument("--gpus", type=int, default=8, help="GPUs in all (default 8)")
    g.add_argument("--tp", type=int, nargs="+", default=[8], help="tensor-parallel degree(s) to compare (default 8)")
    g.add_argument("--weight-bytes", type=int, default=2, choices=[1, 2], help="2 bf16, 1 fp8")
    g.add_argument("--kv-bytes", type=int, default=2, choices=[1, 2], help="2 bf16, 1 fp8 / int8")
    g.add_argument("--context", type=int, default=8192, help="tokens per sequence (default 8192)")
    g.add_argument("--batch", type=int, default=64, help="sequences per decode step (default 64)")


MOCK_HELP = """A mock interview on the course's bank, drills and design prompts: rapid-fire questions with
follow-up chains (each answer hidden until you answer, then you grade yourself y / p / n), one timed
drill (run it in another terminal with `minikv drill start/check`), and one staged design question
with a rubric to score yourself. Keys come from stdin, so it can be scripted. The report is written
to $MINIKV_HOME/mocks/ (default ~/.minikv)."""

DESIGN_HELP = """The back-of-the-envelope calculators of notebook 12 (minikv/interview/design.py): for each TP
degree, the KV bytes per token per GPU (with replication past the KV heads), the weights and the KV
pool per GPU, the tokens and sequences that fit, and the decode step's lower bound by bytes and by
FLOPs. Example: minikv design --tp 8 4 (one replica at TP 8 against two at TP 4)."""


def dispatch(args) -> int:
    return {"quiz": _quiz, "drill": _drill, "bugs": _bugs, "mock": _mock, "progress": _progress,
            "design": _design}[args.cmd](args)


def _mock(args) -> int:
    from minikv.interview import mock

    try:
        mock.run(args.minutes, args.track, sys.stdin, sys.stdout, seed=args.seed)
    except ValueError as e:
        return _err(str(e))
    return 0


def _progress(args) -> int:
    from minikv.interview import mock

    print(mock.progress())
    return 0


def _design(args) -> int:
    from minikv.interview.design import GPUS, MODELS, Deployment, worksheet_lines

    if args.model not in MODELS:
        return _err(f"no model {args.model!r}; models: {', '.join(sorted(MODELS))}")
    if args.gpu not in GPUS:
        return _err(f"no GPU {args.gpu!r}; GPUs: {', '.join(GPUS)}")
    for tp in args.tp:
        try:
            d = Deployment(MODELS[args.model], GPUS[args.gpu], num_gpus=args.gpus, tp=tp,
                           weight_bytes=args.weight_bytes, kv_bytes=args.kv_bytes)
        except ValueError as e:
            return _err(str(e))
        print("\n".join(worksheet_lines(d, args.context, args.batch)))
        print(f"pool of all replicas: {d.pool_tokens_per_replica * d.replicas:,} tokens\n")
    return 0


def _err(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def _quiz(args) -> int:
    from minikv.interview import bank, quiz

    questions = bank.load()
    if args.notebook is not None:
        return _quiz_notebook(args.notebook, questions, as_json=args.export == "json")
    try:
        chosen = bank.select(questions, args.topic, args.difficulty, True if args.beyond else None)
    except ValueError as e:
        return _err(str(e))
    if args.id:
        ids = {q.id: q for q in questions}
        unknown = [i for i in args.id if i not in ids]
        if unknown:
            import difflib

            near = [m for i in unknown for m in difflib.get_close_matches(i, list(ids), n=1)]
            return _err(f"no question {', '.join(unknown)}" + (f"; did you mean {', '.join(near)}?" if near else ""))
        chosen = [q for q in chosen if q.id in set(args.id)]
    if args.grep:
        needle = args.grep.lower()
        chosen = [q for q in chosen if needle in (q.question + " " + q.answer + " " + " ".join(q.follow_ups)).lower()]
    scores = quiz.load_scores()
    if args.missed:
        chosen = quiz.missed(chosen, scores)
    if args.due:
        chosen = quiz.due(chosen, scores)
        if not chosen:
            print("nothing is due today: come back tomorrow, or run `minikv quiz` for new questions")
            return 0
    if args.export:
        print({"json": bank.export_json, "md": bank.export_markdown, "anki": bank.export_anki}[args.export](chosen))
        return 0
    if args.topics:
        for topic, what in bank.TOPICS.items():
            print(f"{topic:22s} {sum(q.topic == topic for q in questions):4d}  {what}")
        return 0
    if args.scores:
        print(quiz.summary(quiz.load_scores(), questions))
        return 0
    if not chosen:
        return _err("no question matches these filters")
    if args.num < 1:
        return _err(f"-n must be at least 1, got {args.num}")
    if args.num > len(chosen):
        print(f"only {len(chosen)} question{'s' * (len(chosen) != 1)} match; asking all of them")
    picked = chosen if args.due else quiz.order(chosen, scores, args.num, args.seed)
    quiz.run(picked[:args.num], sys.stdin, sys.stdout)
    return 0


def _quiz_notebook(name: str, questions, as_json: bool) -> int:
    from minikv.interview import asked

    root = asked.course_root()
    if root is None:
        return _err("no notebooks/ folder here: run it in the course's checkout")
    try:
        path = asked.resolve(name, root)
    except KeyError as e:
        return _err(e.args[0])
    print(asked.export(path, root, questions) if as_json else asked.render(path, root, questions))
    return 0


def _write_file(src: Path, dst: Path, force: bool) -> bool:
    if dst.exists() and not force:
        print(f"{dst} exists: keeping your work (--force overwrites it)")
        return False
    shutil.copyfile(src, dst)
    return True


def _drill(args) -> int:
    from minikv.interview import drills

    if args.drill_cmd == "list":
        rows = list(drills.DRILLS.values())
        if args.json:
            print(json.dumps([{"name": d.name, "minutes": d.minutes, "title": d.title,
                               "functions": list(d.functions), "file": d.filename} for d in rows], indent=1))
        else:
            for d in rows:
                print(f"{d.name:24s} {d.minutes:3d} min  {d.title}")
        return 0
    if args.drill_cmd == "status":
        return _status({d.name: d.minutes for d in drills.DRILLS.values()}, "drill", "")
    try:
        drill = drills.get(args.name)
    except KeyError as e:
        return _err(e.args[0])
    if args.drill_cmd == "start":
        dst = Path.cwd() / drill.filename
        wrote = _write_file(drill.starter, dst, args.force)
        print(drill.statement)
        kept = drills.start_clock(drill.name, restart=args.restart)
        print(f"\n{'wrote' if wrote else 'kept'} {dst}; time limit {drill.minutes} min, " + _clock_words(
            kept, drill.name, drill.minutes, "drill"))
        print(f"check it with: minikv drill check {drill.name}")
        return 0
    if args.reference:
        path, timed = drill.reference, False
    elif args.starter:
        path, timed = drill.starter, False
    else:
        path, timed = args.file or Path.cwd() / drill.filename, True
        if not path.exists():
            return _err(f"{path} does not exist; `minikv drill start {drill.name}` writes it, or name your file")
    if args.reference and not path.is_file():
        return _err(f"{drill.name}: the reference is not part of a student copy; ask your instructor for it")
    result = drills.run_check(drill, path, seed=args.seed, timed=timed, timeout=args.timeout)
    if args.json:
        print(json.dumps({"drill": result.drill, "passed": result.passed, "diagnosis": result.diagnosis,
                          "seed": result.seed, "seconds_taken": result.seconds_taken,
                          "limit_minutes": result.limit_minutes, "clock": result.clock}))
    else:
        print(result.report())
    return 0 if result.passed else 1


def _clock_words(kept: bool, key: str, minutes: int, verb: str) -> str:
    from minikv.interview import clock

    if not kept:
        return "the clock starts now."
    name = key.split(":", 1)[-1]
    return ("the clock keeps running (`--restart` resets it): "
            + clock.describe(clock.get(key), minutes, verb, name).removeprefix("time: "))


def _status(limits: dict[str, int], verb: str, prefix: str) -> int:
    from minikv.interview import clock

    clocks = clock.load()
    rows = [(name, clocks[prefix + name]) for name in limits if prefix + name in clocks]
    if not rows:
        print(f"no {verb} started yet (`minikv {verb} start NAME` starts one)")
        return 0
    for name, entry in rows:
        print(f"{name:26s} {clock.describe(entry, limits[name], verb, name).removeprefix('time: ')}")
    return 0


def _bugs(args) -> int:
    from minikv.interview import bugs

    if args.bugs_cmd == "list":
        rows = list(bugs.LABS.values())
        if args.json:
            print(json.dumps([{"name": lab.name, "seam": lab.seam, "symptom": lab.symptom, "file": lab.filename}
                              for lab in rows], indent=1))
        else:
            for lab in rows:
                print(f"{lab.name:24s} seam {lab.seam:17s} {lab.symptom}")
        return 0
    if args.bugs_cmd == "status":
        return _status({lab.name: lab.minutes for lab in bugs.LABS.values()}, "bugs", "bugs:")
    try:
        lab = bugs.get(args.name)
    except KeyError as e:
        return _err(e.args[0])
    if args.bugs_cmd == "hint":
        print(bugs.hint(lab, args.level))
        return 0
    if args.bugs_cmd == "start":
        from minikv.interview import clock

        dst = Path.cwd() / lab.filename
        wrote = _write_file(lab.buggy, dst, args.force)
        print(lab.statement)
        kept = clock.start(lab.clock_name, restart=args.restart)[1]
        print(f"\n{'wrote' if wrote else 'kept'} {dst}: fix the code there, then `minikv bugs check {lab.name}`; "
              f"about {lab.minutes} min, " + _clock_words(kept, lab.clock_name, lab.minutes, "bugs"))
        return 0
    if args.buggy:
        path = lab.buggy
    elif args.fixed:
        path = lab.fixed
    else:
        path = args.file or Path.cwd() / lab.filename
        if not path.exists():
            return _err(f"{path} does not exist; `minikv bugs start {lab.name}` writes it, or name your file")
    if args.fixed and not path.is_file():
        return _err(f"{lab.name}: the fixed code is not part of a student copy; ask your instructor for it")
    timed = not (args.buggy or args.fixed)
    result = bugs.run_check(lab, path, seed=args.seed, timeout=args.timeout, timed=timed)
    if args.json:
        print(json.dumps({"lab": result.lab, "passed": result.passed, "diagnosis": result.diagnosis,
                          "seed": result.seed, "clock": result.clock}))
    else:
        print(result.report())
    return 0 if result.passed else 1
