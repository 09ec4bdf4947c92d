"""`minikv` on the command line.

    minikv prepare                                   fetch + convert the offline model (once)
    minikv generate --model smollm2-135m --prompt "Why is the sky blue?"
    minikv bench <name> [options]                    run minikv/bench/<name>.py (e.g. cache_speedup)
    minikv serve --model smollm2-135m --port 8000    an OpenAI-compatible server (see minikv/serve)
    minikv route --backend URL --backend URL --port 8000   one front over several servers (cache-aware)

For the classroom:
    minikv check exercises/04a_slot_mapping.ipynb [--json]   grade an exercise you saved (exit 0: all checks pass)
    minikv grade FOLDER --out grades.csv [--junit grades.xml] grade a class, one sub-folder per student
    minikv release --student OUT                             the course without solutions/ or the instructor key

For interview preparation:
    minikv quiz [--topic T] [--difficulty D] [--export json]  questions with model answers, a score kept locally
    minikv drill list | start NAME | check NAME [FILE]        timed coding drills on hidden random cases
    minikv bugs list | start NAME | check NAME [--buggy|--fixed]  find a bug planted in the engine
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="minikv", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prepare", help="download and convert the offline SmolLM2-135M-Instruct (once)")
    g = sub.add_parser("generate", help="stream an answer to a prompt")
    g.add_argument("--model", default="smollm2-135m")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--kv-backend", default="contiguous")
    g.add_argument("--device", default=None)
    g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    b = sub.add_parser("bench", help="run a benchmark from minikv/bench (its own --help lists options)")
    b.add_argument("name", help="benchmark module, e.g. cache_speedup, throughput, prefix_ttft, decode_attention")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    _classroom_parsers(sub)
    _interview_parsers(sub)
    _serve_parsers(sub)
    args = ap.parse_args(argv)
    if args.cmd == "serve" and args.data_parallel_size != 1:
        return _serve_data_parallel(args, sys.argv[1:] if argv is None else argv)
    if args.cmd == "serve":
        return _serve(args)
    if args.cmd == "route":
        return _route(args)

    if args.cmd in ("check", "grade", "release"):
        return {"check": _check, "grade": _grade, "release": _release}[args.cmd](args)
    if args.cmd in ("quiz", "drill", "bugs", "mock", "progress", "design"):
        return _interview(args)

    if args.cmd == "bench":
        import importlib.util
        import runpy

        module = f"minikv.bench.{args.name}"
        if importlib.util.find_spec(module) is None:
            import pkgutil

            import minikv.bench

            names = sorted(m.name for m in pkgutil.iter_modules(minikv.bench.__path__))
            print(f"error: no benchmark {args.name!r}; available: {', '.join(names)}", file=sys.stderr)
            return 2
        sys.argv = [module] + args.rest
        runpy.run_module(module, run_name="__main__")
        return 0

    if args.cmd == "prepare":
        from minikv.model.named import prepare_smollm2

        try:
            print(prepare_smollm2())
        except _user_errors() as e:
            return _error(e)
        return 0

    from minikv import LLM, SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed)
        llm = LLM(args.model, device=args.device, kv_backend=args.kv_backend)
        prompt = args.prompt if args.no_chat else llm.chat_prompt(args.prompt)
        for ev in llm.stream(prompt, params):
            print(ev.text_delta if llm.tokenizer else f"{ev.token_id} ", end="", flush=True)
    except _user_errors() as e:
        return _error(e)
    print()
    return 0


# ---- a user's mistake is one line, never a traceback ------------------------------------------------
def _user_errors() -> tuple[type[BaseException], ...]:
    """What a user can cause: ValueError (a bad option, model or file; the message names the cause and
    the fix), OSError (a path missing, not a directory, not permitted), DownloadError (offline before
    the model is in place). Anything else is a bug and keeps its traceback."""
    from minikv.model.named import DownloadError

    return ValueError, OSError, DownloadError


def _error(e: BaseException) -> int:
    """Print `error: <cause>; <fix>` on one line of stderr; the exit status is 2."""
    if isinstance(e, OSError) and e.strerror and e.filename is not None:  # raw, from the OS: no fix in it
        message = f"{e.strerror}: {e.filename}; check the path and its permissions"
    else:
        message = str(e)
    print("error: " + " ".join(message.split()), file=sys.stderr)
    return 2


# ---- for interview preparation ----------------------------------------------------------------------

def _interview_parsers(sub) -> None:
    from minikv.interview.cli import add_parsers

    add_parsers(sub)


def _interview(args) -> int:
    from minikv.interview.cli import dispatch

    return dispatch(args)
# ---- serving many users ---------------------------------------------------------------------------

def _serve_parsers(sub) -> None:
    s = sub.add_parser("serve", help="serve a model with the OpenAI API (completions, chat, streaming, /metrics)")
    s.add_argument("--model", default="smollm2-135m", help="tiny-random, smollm2-135m, a checkpoint directory")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None, help="the name clients send as `model` (default: --model)")
    s.add_argument("--device", default=None)
    s.add_argument("--dtype", default=None)
    s.add_argument("--max-model-len", type=int, default=None)
    s.add_argument("--max-num-seqs", type=int, default=None, help="requests running at once (seats)")
    s.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one engine step")
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--num-blocks", type=int, default=None, help="KV blocks in the pool")
    s.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="processes (GPUs) that share every layer, over torch.distributed (gloo on CPUs)")
    s.add_argument("--prefix-caching", choices=("hash", "radix", "none"), default="hash")
    s.add_argument("--schedule-policy", choices=("fcfs", "vtc", "lpm"), default="fcfs",
                   help="fcfs: first come first served; vtc: fair between tenants (virtual token counter); "
                        "lpm: longest cached prefix first")
    s.add_argument("--speculative", choices=("ngram", "draft"), default=None,
                   help="speculative decoding: drafts from the request's own tokens (ngram) or a draft model")
    s.add_argument("--num-speculative-tokens", type=int, default=None, help="draft tokens verified per step (4)")
    s.add_argument("--draft-model", default=None,
                   help="with --speculative draft: a smaller model sharing the tokenizer, or self:N (first N layers)")
    s.add_argument("--isolate-tenants", action="store_true",
                   help="salt each tenant's prefix cache: tenants never share cached blocks")
    s.add_argument("--max-waiting", type=int, default=256,
                   help="requests waiting for a seat before new ones get 503 with Retry-After")
    s.add_argument("--max-waiting-per-tenant", type=int, default=None,
                   help="requests of one tenant waiting for a seat before that tenant's new ones get 429")
    s.add_argument("--max-body-bytes", type=int, default=4 * 2**20, help="a larger request body gets 413")
    s.add_argument("--stream-interval", type=int, default=1,
                   help="tokens a streamed chunk waits for (the first token and the end go at once); above 1, "
                        "fewer, fuller chunks spare a busy server's socket writes")
    s.add_argument("--log-level", default="info")
    s.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine core in a process of its own (default), so HTTP, SSE and tokenizing never "
                        "slow a step; --no-engine-process runs it on a thread of the server's process")
    s.add_argument("--role", choices=("both", "prefill", "decode"), default="both",
                   help="both: one engine runs prompts and decodes; prefill/decode: prompts on one engine, tokens "
                        "on another, the prompt's KV blocks sent between them (give both --kv-address)")
    s.add_argument("--kv-address", default=None, metavar="HOST:PORT",
                   help="with --role prefill|decode: where the pair meets (the prefill server listens there)")
    s.add_argument("--data-parallel-size", type=int, default=1,
                   help="start N replicas (one GPU each when there are N) behind a cache-aware router on --port")
    r = sub.add_parser("route", help="one OpenAI-compatible front over several `minikv serve` replicas")
    r.add_argument("--backend", dest="backends", action="append", default=[], metavar="URL",
                   help="a replica's base URL, e.g. http://127.0.0.1:8001 (once per replica)")
    r.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="a decode server (minikv serve --role decode), paired in order with a --prefill")
    r.add_argument("--prefill", action="append", default=[], metavar="URL",
                   help="the prefill server (minikv serve --role prefill) of the --decode at the same position")
    r.add_argument("--policy", choices=("cache_aware", "round_robin", "least_loaded"), default="cache_aware",
                   help="cache_aware: longest cached prefix unless that replica is overloaded; round_robin; "
                        "least_loaded: fewest requests in flight")
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, default=8000)
    r.add_argument("--balance-threshold", type=int, default=4,
                   help="requests in flight beyond the least loaded replica before load beats a cached prefix")
    r.add_argument("--block-size", type=int, default=16, help="tokens per hashed block (the replicas' block size)")
    r.add_argument("--isolate-tenants", action="store_true",
                   help="the replicas isolate tenants: a prefix is only shared under the same API key")
    r.add_argument("--log-level", default="info")


def _serve(args) -> int:
    from minikv import LLM
    from minikv.serve import run
    from minikv.serve.core_process import CoreProcess

    for flag, value in (("--max-waiting", args.max_waiting), ("--max-waiting-per-tenant", args.max_waiting_per_tenant),
                        ("--stream-interval", args.stream_interval)):
        if value is not None and value < 1:
            print(f"error: {flag} must be at least 1, got {value}", file=sys.stderr)
            return 2
    try:
        _check_listen(args.host, args.port)  # before the model loads: a bad port fails at once
        options = dict(device=args.device, dtype=args.dtype, kv_backend="paged",
                       max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                       num_blocks=args.num_blocks, schedule_policy=args.schedule_policy,
                       prefix_caching=None if args.prefix_caching == "none" else args.prefix_caching,
                       speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
                       draft_model=args.draft_model, tensor_parallel_size=args.tensor_parallel_size)
        if args.role != "both":
            return _serve_role(args, options)
        llm = CoreProcess(args.model, **options) if args.engine_process else LLM(args.model, **options)
    except _user_errors() as e:
        return _error(e)
    name = args.served_model_name or args.model
    print(f"minikv: serving {name!r} at http://{args.host}:{args.port}/v1 (policy {args.schedule_policy}"
          f"{', tenants isolated' if args.isolate_tenants else ''})", flush=True)
    run(llm, args.host, args.port, name, args.isolate_tenants, args.max_waiting, args.max_waiting_per_tenant,
        args.log_level, max_body_bytes=args.max_body_bytes, stream_interval=args.stream_interval)
    return 0


def _serve_role(args, options: dict) -> int:
    """A prefill or a decode server: the engine in this process (the KV blocks go to and from its pool)."""
    from minikv import LLM
    from minikv.serve.disagg import Inbox, serve_role

    if not args.kv_address:
        raise ValueError(f"--role {args.role} needs --kv-address HOST:PORT, the same on the prefill and the decode "
                         "server (the prefill server listens there)")
    if args.role == "decode":
        options = {**options, "kv_offload_store": Inbox()}
    llm = LLM(args.model, **options)
    serve_role(args.role, llm, args.kv_address, args.host, args.port, args.served_model_name or args.model,
               args.log_level, isolate_tenants=args.isolate_tenants, max_waiting=args.max_waiting,
               max_waiting_per_tenant=args.max_waiting_per_tenant, max_body_bytes=args.max_body_bytes,
               stream_interval=args.stream_interval)
    return 0


def _serve_data_parallel(args, argv: list[str]) -> int:
    from minikv.serve.router import serve_data_parallel

    try:
        if args.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be at least 1, got {args.data_parallel_size}")
        _check_listen(args.host, args.port)
        return serve_data_parallel(argv, args.data_parallel_size, args.host, args.port, log_level=args.log_level)
    except _user_errors() as e:
        return _error(e)


def _route(args) -> int:
    from minikv.serve.router import RouterState, run_router

    backends = args.backends + args.decode
    try:
        if args.prefill and args.backends:
            raise ValueError("--prefill pairs with --decode servers, not with --backend replicas; give --decode URLs")
        _check_listen(args.host, args.port)
        RouterState(backends, args.policy, args.block_size, args.balance_threshold, prefill=args.prefill)  # checks
    except _user_errors() as e:
        return _error(e)
    print(f"minikv: routing ({args.policy}) at http://{args.host}:{args.port}/v1 over {', '.join(backends)}",
          flush=True)
    run_router(backends, args.host, args.port, args.policy, args.block_size, args.balance_threshold,
               args.isolate_tenants, args.log_level, prefill=args.prefill)
    return 0


def _check_listen(host: str, port: int) -> None:
    """A ValueError naming the cause and the fix if the server could not listen on host:port (a port out
    of range, a host that does not resolve, a port in use or not permitted)."""
    import socket

    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {port}; pick a free port such as 8000 (0: any free port)")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError as e:
        raise ValueError(f"--host {host!r} does not resolve ({e.strerror or e}); give an address such as "
                         "127.0.0.1 or 0.0.0.0") from None
    if port == 0:
        return
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server sets it
        try:
            probe.bind(address)
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port} ({e.strerror or e}); pick another --port, or stop "
                             "what listens there") from None


# ---- for the classroom ---------------------------------------------------------------------------

CHECK_HELP = """Grade exercise notebooks you saved: run each alone in a fresh process (your code cells in order,
as a kernel runs them, never your check cells), then the course's checks of that exercise on what
your cells defined, and print every check's diagnosis. Stored outputs count for nothing. A check is
worth 1 point unless its cell's metadata says {"minikv": {"points": N}}.

exit status: 0 every check passed; 1 a check failed (or the notebook hung past --timeout, or ended
its process); 2 a notebook could not be graded (missing, not a notebook, not one of the course's
exercises: give --reference for one of your own)."""

GRADE_HELP = """Grade a class. FOLDER holds one sub-folder per student with their exercise notebooks (at
any depth: a clone of their repository works); folders starting with _ or . are skipped. The
exercises are the course's (or --exercises); a student missing one gets 0 for it. Every notebook runs
in a process of its own, --jobs at a time. Writes a CSV as each student finishes (student, one column
per exercise, points, max_points, a status per exercise, flags, review, commit, late, written answers
to review; a last row with the class's means) and, with --junit, JUnit XML (a testsuite per student, a
testcase per exercise with its diagnosis); --feedback DIR a report per student, with their written
answers (never auto-scored: grade them with the instructor key's rubric)."""

RELEASE_HELP = """Write the student copy of the course: notebooks/ (with their outputs), exercises/ (the stubs,
every output cleared), README, the package (pyproject.toml, Makefile, minikv/), the
recorded benchmarks the notebooks read, and a GitHub Classroom workflow (.github/workflows/classroom.yml,
one `minikv check` per exercise). Never solutions/, instructor/, tests/ (but a module a notebook
imports), nor any cell tagged `solution` or `instructor`."""


def _classroom_parsers(sub) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    c = sub.add_parser("check", help="grade exercise notebooks you saved (exit 0 when every check passes)",
                       description=CHECK_HELP, formatter_class=fmt)
    c.add_argument("notebooks", nargs="+", type=Path, metavar="NOTEBOOK", help="an exercise notebook (.ipynb)")
    c.add_argument("--json", action="store_true",
                   help='print one line per notebook: {"exercise", "passed", "points", "max_points", "message"}')
    c.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a notebook may run before its process is killed (default 600)")
    c.add_argument("--jobs", type=int, default=1, help="notebooks graded at once, one process each (default 1)")
    c.add_argument("--reference", type=Path, default=None,
                   help="the teacher's copy of the exercise (a notebook or its folder) whose checks count; "
                        "default: the course's own, inside the package")
    c.add_argument("--memory-gb", type=float, default=8.0, help="address space per notebook in GiB (default 8)")
    c.add_argument("--check", type=int, default=None, metavar="K",
                   help="report check K alone (1..): exit 0 when it passes (one test per check in GitHub Classroom)")
    c.add_argument("--results", type=Path, default=None, metavar="DIR",
                   help="keep each notebook's grade in DIR/<exercise>.json and reuse it: a notebook runs once "
                        "for all its --check K")
    g = sub.add_parser("grade", help="grade a class: one sub-folder per student -> a CSV (and JUnit XML)",
                       description=GRADE_HELP, formatter_class=fmt)
    g.add_argument("folder", type=Path, metavar="FOLDER")
    g.add_argument("--out", type=Path, required=True, help="the CSV to write, e.g. grades.csv")
    g.add_argument("--junit", type=Path, default=None, help="also write JUnit XML here, e.g. grades.xml")
    g.add_argument("--exercises", type=Path, default=None,
                   help="the folder of the course's exercise notebooks (default: exercises/ of this checkout)")
    g.add_argument("--jobs", type=int, default=2, help="notebooks graded at once, one process each (default 2)")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds per notebook (default 600)")
    g.add_argument("--student", default=None, metavar="NAME",
                   help="grade this student's folder alone and merge the row into the CSV already at --out")
    g.add_argument("--deadline", default=None, help="a `late` column: the last commit of each student's clone "
                   "against this date (2026-03-01 or 2026-03-01T23:59+01:00)")
    g.add_argument("--feedback", type=Path, default=None, metavar="DIR",
                   help="write DIR/<student>.md: every exercise's report, for the student")
    g.add_argument("--memory-gb", type=float, default=8.0, help="address space per notebook in GiB (default 8)")
    r = sub.add_parser("release", help="write the student copy of the course (no solutions, no instructor key)",
                       description=RELEASE_HELP, formatter_class=fmt)
    r.add_argument("--student", type=Path, metavar="OUT", help="the folder to write the student copy into (new)")
    r.add_argument("--force", action="store_true", help="replace OUT when it holds a previous student copy")
    r.add_argument("--workflow", type=Path, metavar="FILE",
                   help="(also) write the GitHub Classroom workflow for this course's exercises to FILE")
    r.add_argument("--week", type=int, default=None, metavar="N",
                   help="release week N's exercises alone (4: 04a_*, 04b_*), with their own workflow")
    r.add_argument("--exercises", default=None, metavar="LIST",
                   help="release these exercises alone, comma-separated (04a,06b_radix_match)")
    r.add_argument("--hints", type=int, default=None, metavar="N",
                   help="ship hint levels 1..N only (hint 3 is close to the answer: --hints 2 withholds it)")
    r.add_argument("--registry", action="store_true",
                   help="(also) rewrite minikv/classroom/course.json, the checks the grader trusts, from exercises/")


def _check(args) -> int:
    import json as _json

    from minikv.classroom.check import Grade, grade_notebooks

    def show(g) -> None:
        g = g.only(args.check) if args.check is not None else g
        print(g.to_json() if args.json else g.report(), flush=True)

    cached: dict = {}
    if args.results is not None:
        for p in args.notebooks:
            f = args.results / f"{p.stem}.json"
            if f.is_file():
                cached[p] = Grade.from_dict(_json.loads(f.read_text(encoding="utf-8")))
    todo = [p for p in args.notebooks if p not in cached]
    live = args.jobs == 1 and not cached  # each report as its notebook finishes
    graded = grade_notebooks(todo, timeout=args.timeout, reference=args.reference, jobs=args.jobs,
                             on_done=show if live else None, memory_gb=args.memory_gb)
    if args.results is not None:
        args.results.mkdir(parents=True, exist_ok=True)
        for p, g in zip(todo, graded):
            (args.results / f"{p.stem}.json").write_text(_json.dumps(g.to_dict()), encoding="utf-8")
    cached.update(zip(todo, graded))
    grades = [cached[p] for p in args.notebooks]
    if not live:
        for g in grades:
            show(g)
    grades = [g.only(args.check) if args.check is not None else g for g in grades]
    if any(g.error is not None for g in grades):
        return 2
    return 0 if all(g.passed for g in grades) else 1


def _grade(args) -> int:
    from minikv.classroom.check import number
    from minikv.classroom.grade import (
        check_writable,
        grade_class,
        parse_deadline,
        write_csv,
        write_feedback,
        write_junit,
    )

    try:
        check_writable(args.out)
        if args.junit is not None:
            check_writable(args.junit)
        deadline = parse_deadline(args.deadline) if args.deadline else None
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finished = []

    def save(row) -> None:  # the CSV as each student finishes: an interrupted run keeps what it graded
        finished.append(row)
        write_csv(args.out, exercises[0], finished, merge=args.student is not None)
        if args.feedback is not None:
            write_feedback(args.feedback, exercises[0], row)

    exercises: list = []
    try:
        from minikv.classroom.grade import exercise_names

        exercises.append([p.rsplit(".", 1)[0] for p in exercise_names(args.exercises)[0]])
        names, rows = grade_class(args.folder, exercises=args.exercises, jobs=args.jobs, timeout=args.timeout,
                                  log=lambda line: print(line, file=sys.stderr, flush=True), only=args.student,
                                  deadline=deadline, on_student=save, memory_gb=args.memory_gb)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_csv(args.out, names, rows, merge=args.student is not None)
    if args.junit is not None:
        write_junit(args.junit, names, rows)
    for r in rows:
        print(f"{r.student}: {number(r.points)} of {number(r.max_points)} points"
              + (f"  FLAGGED: {'; '.join(r.flags)}" if r.flags else ""))
    print(f"wrote {args.out}" + (f" and {args.junit}" if args.junit else "")
          + (f"; feedback in {args.feedback}/" if args.feedback else ""))
    return 0


def _release(args) -> int:
    from minikv.classroom.notebooks import course_root
    from minikv.classroom.release import ReleaseError, release_student, render_workflow, select_exercises

    def chosen(root):
        if root is None:
            raise ReleaseError("minikv release needs the course checkout (with exercises/ and pyproject.toml); "
                               "run it from a clone of the repository")
        names = [n.strip() for n in args.exercises.split(",") if n.strip()] if args.exercises else None
        return select_exercises(root, week=args.week, names=names)

    if args.student is None and args.workflow is None and not args.registry:
        print("error: say what to write: --student OUT (the student copy), --workflow FILE and/or --registry",
              file=sys.stderr)
        return 2
    try:
        if args.registry:
            from minikv.classroom.registry import COURSE_FILE, render

            root = course_root()
            if root is None:
                raise ReleaseError("--registry needs the course checkout (its exercises/)")
            COURSE_FILE.write_text(render(root / "exercises"), encoding="utf-8")
            print(f"wrote {COURSE_FILE}")
        if args.workflow is not None:
            root = course_root()
            if root is None:
                raise ReleaseError("--workflow needs the course checkout (its exercises/)")
            args.workflow.parent.mkdir(parents=True, exist_ok=True)
            args.workflow.write_text(render_workflow(chosen(root)))
            print(f"wrote {args.workflow}")
        if args.student is not None:
            written = release_student(args.student, force=args.force, exercises=chosen(course_root()),
                                      hints=args.hints)
            print(f"wrote the student copy to {args.student} ({len(written)} files)")
    except ReleaseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
