"""Timed drills: the coding exercises interviews give, each checked on hidden random cases.

    minikv drill list [--json]            name, time limit, what to write
    minikv drill start NAME               writes drill_NAME.py here, prints the statement, starts the clock
    minikv drill check NAME [FILE]        runs the checker on FILE (default drill_NAME.py here); prints
                                          the diagnosis and the time taken against the limit
    minikv drill check NAME --reference   the shipped reference (must pass)
    minikv drill check NAME --starter     the untouched starter (must fail)

A drill's statement is its starter file's docstring (drill_files/<name>_starter.py). Checkers are
the course's (minikv.checks); each check draws a fresh seed, so the random cases differ on every run
and cannot be matched by hand; the seed is printed with a failure (`--seed` reruns it).

The clock (clock.py): `start` records the time in $MINIKV_HOME/drill_clock.json (default ~/.minikv);
`start` again keeps it running (`--restart` resets it); the first passing check stops it and records
the time and the number of checks; `minikv drill status` shows the time left.

The answer must be the learner's own code (guard.py): a drill file that imports the engine's answer
from minikv, or names a function it does not define, fails before any case runs.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import random
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable

from minikv.checks.report import CheckFailed
from minikv.interview import clock, drill_cases, guard
from minikv.interview.clock import home  # noqa: F401  (quiz and mock import it from here)

FILES = Path(__file__).resolve().parent / "drill_files"


@dataclass(frozen=True)
class Drill:
    name: str
    minutes: int
    title: str
    functions: tuple[str, ...]
    check: Callable[[ModuleType, int], None]

    @property
    def stem(self) -> str:
        return self.name.replace("-", "_")

    @property
    def starter(self) -> Path:
        return FILES / f"{self.stem}_starter.py"

    @property
    def reference(self) -> Path:
        return FILES / f"{self.stem}_reference.py"

    @property
    def statement(self) -> str:
        return (ast_docstring(self.starter) or "").strip()

    @property
    def filename(self) -> str:
        return f"drill_{self.stem}.py"


def ast_docstring(path: Path) -> str | None:
    import ast

    return ast.get_docstring(ast.parse(path.read_text()))


# ---- the checks: the course's checkers, with a seed for their random cases ----------------------------

def _gqa(m, seed):
    from minikv.checks.attention import check_causal_attention

    check_causal_attention(m.causal_attention, num_cases=25, seed=seed)
    drill_cases.check_scaled_attention(m.causal_attention, seed)


def _decode(m, seed):
    from minikv.checks.attention import check_decode_step

    check_decode_step(m.decode_step, num_cases=25, seed=seed)
    drill_cases.check_scaled_decode(m.decode_step, seed)


def _slots(m, seed):
    from minikv.checks.paged import check_block_allocator, check_slot_mapping

    check_slot_mapping(m.slot_mapping, num_random=200, seed=seed)
    check_block_allocator(m.BlockAllocator, num_random=1000, seed=seed)


def _hashes(m, seed):
    from minikv.checks.prefix import check_block_hashes, check_hash_block

    check_hash_block(m.hash_block)
    check_block_hashes(m.block_hashes, m.hash_block, num_random=200, seed=seed)


def _cow(m, seed):
    from minikv.checks.cow import check_copy_on_write

    check_copy_on_write(m.copy_on_write, num_random=300, seed=seed)


def _lru(m, seed):
    from minikv.checks.lru import check_free_queue, check_release

    check_free_queue(m.FreeBlockQueue, num_random=300, seed=seed)
    drill_cases.check_popleft_timing(m.FreeBlockQueue)
    check_release(m.release, m.FreeBlockQueue)


def _preempt(m, seed):
    from minikv.checks.preemption import check_pick_victim, check_schedule_running

    check_pick_victim(m.pick_victim)
    check_schedule_running(m.schedule_running, num_random=300, seed=seed)


def _radix(m, seed):
    from minikv.checks.prefix import check_radix_match
    from minikv.checks.radix import check_evict_leaf, check_radix_insert, check_split

    check_radix_match(m.match_prefix, num_random=200, seed=seed)
    check_split(m.split)
    check_evict_leaf(m.evict_leaf)
    drill_cases.check_radix_evict_random(m.evict_leaf, seed)
    drill_cases.check_radix_root(m.insert)
    check_radix_insert(m.insert, m.split, num_random=200, seed=seed)
    drill_cases.check_radix_lookup(m.match_prefix, m.insert)


def _softmax(m, seed):
    from minikv.checks.online_softmax import check_online_step
    from minikv.checks.split_k import check_merge_splits

    check_online_step(m.online_step, num_random=40, seed=seed)
    check_merge_splits(m.merge_splits, num_random=100, seed=seed)


def _spec(m, seed):
    from minikv.checks.speculative import check_num_accepted, check_residual, check_rollback

    check_num_accepted(m.num_accepted, seed=seed)
    check_residual(m.residual, seed=seed)
    check_rollback(m.rollback, seed=seed)


DRILLS: dict[str, Drill] = {d.name: d for d in [
    Drill("gqa-attention", 10, "causal grouped-query attention over one sequence", ("causal_attention",), _gqa),
    Drill("kv-decode-step", 15, "append to a KV cache row and attend over it for one decode step",
          ("decode_step",), _decode),
    Drill("slot-mapping-allocator", 15, "slot mapping of a block table, and an O(1) block allocator",
          ("slot_mapping", "BlockAllocator"), _slots),
    Drill("block-hash-chain", 15, "chained block keys of a prefix cache, with a tenant salt",
          ("hash_block", "block_hashes"), _hashes),
    Drill("copy-on-write", 20, "private copies of the shared blocks a step writes into", ("copy_on_write",), _cow),
    Drill("lru-block-budget", 30, "an O(1) LRU queue of cached blocks, and releasing a request tail first",
          ("FreeBlockQueue", "release"), _lru),
    Drill("scheduler-preemption", 30, "one scheduler step over running sequences, preempting when blocks run out",
          ("pick_victim", "schedule_running"), _preempt),
    Drill("radix-tree", 45, "a radix prefix tree: match, split, insert with edge split, evict a leaf",
          ("match_prefix", "split", "insert", "evict_leaf"), _radix),
    Drill("online-softmax-split-k", 30, "the online softmax over tiles, and the exact merge of split-K partials",
          ("online_step", "merge_splits"), _softmax),
    Drill("speculative-rollback", 30, "speculative verification (rejection rule, residual) and KV rollback",
          ("num_accepted", "residual", "rollback"), _spec),
]}


def get(name: str) -> Drill:
    if name not in DRILLS:
        import difflib

        near = difflib.get_close_matches(name, list(DRILLS), n=1)
        raise KeyError(f"no drill {name!r}" + (f"; did you mean {near[0]!r}?" if near else "")
                       + f" (drills: {', '.join(DRILLS)})")
    return DRILLS[name]


def load_module(path: Path, name: str = "learner_drill") -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- the clock (clock.py) -------------------------------------------------------------------------

def start_clock(name: str, now: float | None = None, restart: bool = False) -> bool:
    """Start the drill's clock; True when a running clock was kept."""
    return clock.start(name, now, restart)[1]


def started(name: str) -> float | None:
    entry = clock.get(name)
    return None if entry is None else entry["started"]


# ---- running a check -----------------------------------------------------------------------------

CHECK_SECONDS = 120.0  # a check of a correct file takes a few seconds; an endless loop must not hang the terminal


class CheckTimeout(Exception):
    """The learner's code did not return within the check's time limit."""


@contextlib.contextmanager
def time_limit(seconds: float | None):
    """Raise CheckTimeout in the code run inside once `seconds` have passed (SIGALRM; main thread only,
    elsewhere no limit). Code stuck inside one long native call is interrupted when the call returns."""
    if not seconds or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum, frame):
        raise CheckTimeout(f"the check did not finish in {seconds:.0f} s: an endless loop, or a loop over far more "
                           "than the inputs? (--timeout raises the limit)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclass
class Result:
    drill: str
    passed: bool
    diagnosis: str
    seed: int
    seconds_taken: float | None  # since `drill start` (until the first pass), None if never started
    limit_minutes: int
    check_seconds: float
    clock: dict | None = None  # the clock's entry after this check: attempts, passed_after

    def report(self) -> str:
        verdict = "PASSED" if self.passed else "FAILED"
        lines = [f"{self.drill}: {verdict}", self.diagnosis.rstrip()]
        if not self.passed:
            lines.append(f"(random cases drawn with seed {self.seed}; `--seed {self.seed}` reruns the same ones)")
        lines.append(clock.describe(self.clock, self.limit_minutes, "drill", self.drill))
        return "\n".join(lines)


def run_check(drill: Drill, path: Path, seed: int | None = None, timed: bool = True,
              timeout: float | None = CHECK_SECONDS) -> Result:
    """Import the file at `path` and run the drill's checks on it; never raises for the learner's faults."""
    seed = random.SystemRandom().randrange(1, 2**31) if seed is None else seed
    out = io.StringIO()
    t0 = time.perf_counter()
    passed = False
    try:
        with contextlib.redirect_stdout(out), time_limit(timeout):
            module = load_module(path)
            missing = [f for f in drill.functions if not hasattr(module, f)]
            if missing:
                raise CheckFailed(f"{path.name} defines no {', '.join(missing)}; the drill asks for "
                                  f"{', '.join(drill.functions)}")
            foreign = guard.foreign_imports(path, drill.starter)
            if foreign:
                raise CheckFailed(foreign)
            borrowed = guard.missing_definitions(module, path, list(drill.functions))
            if borrowed:
                raise CheckFailed(f"{', '.join(borrowed)} must be defined in {path.name} (not imported or assigned "
                                  "from elsewhere): the drill checks your own code")
            drill.check(module, seed)
        passed = True
        diagnosis = out.getvalue()
    except (CheckFailed, CheckTimeout) as e:
        diagnosis = out.getvalue() + str(e)
    except NotImplementedError as e:
        diagnosis = out.getvalue() + f"not written yet: {e}"
    except Exception as e:  # noqa: BLE001  the learner's code raised: show where
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == str(path)]
        where = f" (line {frames[-1].lineno} of {path.name}: {(frames[-1].line or '').strip()})" if frames else ""
        diagnosis = out.getvalue() + f"{type(e).__name__}: {e}{where}"
    entry = clock.record(drill.name, passed) if timed else None
    return Result(drill.name, passed, diagnosis, seed, None if entry is None else clock.elapsed(entry),
                  drill.minutes, time.perf_counter() - t0, entry)
