"""Find-the-bug labs: the real engine with one realistic bug planted through a named seam.

    minikv bugs list [--json]                 the labs: symptom, seam
    minikv bugs start NAME                    writes bug_NAME.py here: the buggy code, the symptom, the tools
    minikv bugs check NAME [FILE]             runs the lab's scenario on FILE (default bug_NAME.py here)
    minikv bugs check NAME --buggy | --fixed  on the shipped buggy or fixed code

Each lab file defines `engine_options()`: the seam it plugs into `LLM(...)` (prefix_caching,
copy_on_write, decode_step, slot_mapping, block_allocator, causal_attention; see SEAMS in
minikv/engine/config.py) with the team's code in it. Nothing edits the engine: the bug lives in the
code the seam carries, as it would in a team's own extension of a serving engine. The check runs a
short scenario on tiny-random (about a second) against the engine's own code on the same seam, and
explains the first thing that differs: tokens, cache hits, an invariant, or a crash.
"""
from __future__ import annotations

import contextlib
import io
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable

from minikv.checks.report import CheckFailed, fail
from minikv.interview.drills import CHECK_SECONDS, CheckTimeout, load_module, time_limit

FILES = Path(__file__).resolve().parent / "bug_files"
MODEL = "tiny-random"


@dataclass(frozen=True)
class Lab:
    name: str
    seam: str
    symptom: str  # what a user reports
    field_note: str  # where this bug is seen in real engines
    scenario: Callable[[ModuleType], None]  # raises CheckFailed when the bug shows

    @property
    def stem(self) -> str:
        return self.name.replace("-", "_")

    @property
    def buggy(self) -> Path:
        return FILES / f"{self.stem}_buggy.py"

    @property
    def fixed(self) -> Path:
        return FILES / f"{self.stem}_fixed.py"

    @property
    def filename(self) -> str:
        return f"bug_{self.stem}.py"

    @property
    def statement(self) -> str:
        from minikv.interview.drills import ast_docstring

        return (ast_docstring(self.buggy) or "").strip()


# ---- scenario helpers --------------------------------------------------------------------------------

def _engines(module: ModuleType, kv_backend: str, **options):
    """(the engine on the lab's code, the same engine on minikv's own code): same weights, same options."""
    from minikv import LLM

    ref = LLM(MODEL, kv_backend=kv_backend, **options)
    planted = module.engine_options()
    return ref.derive(**planted), ref


def _run(what: str, llm, prompts, params):
    try:
        return llm.generate(prompts, params)
    except Exception as e:  # noqa: BLE001  the crash is the symptom
        fail(f"scenario: {what}", f"the engine raised {type(e).__name__}", _short(str(e)),
             "read the message: which limit or invariant broke, and which seam's code was running")


def _short(text: str, limit: int = 400) -> str:
    return text if len(text) <= limit else text[:limit] + " ..."


def _compare(what: str, got, want, hint: str | None = None) -> None:
    for r, (g, w) in enumerate(zip(got, want)):
        for s, (gs, ws) in enumerate(zip(g.outputs, w.outputs)):
            if gs.token_ids != ws.token_ids:
                pos = next((i for i, (a, b) in enumerate(zip(gs.token_ids, ws.token_ids)) if a != b),
                           min(len(gs.token_ids), len(ws.token_ids)))
                label = f"request {r}" + (f", sample {s}" if len(g.outputs) > 1 else "")
                fail(f"scenario: {what}", f"{label} differs from the engine's own code at output token {pos}",
                     f"expected {ws.token_ids}\ngot      {gs.token_ids}", hint)


def _invariants(what: str, llm, seqs=()) -> None:
    try:
        llm.view.check(list(seqs))
    except AssertionError as e:
        fail(f"scenario: {what}", "the pool's invariant check failed (llm.view.check)", str(e))


def _sp(**kw):
    from minikv import SamplingParams

    return SamplingParams(**kw)


PAGED = dict(block_size=4)


# ---- the labs' scenarios ----------------------------------------------------------------------------

def _stale_prefix(m):
    mine, ref = _engines(m, "paged", num_blocks=12, **PAGED)
    mine = mine.derive()  # a fresh cache instance per engine
    prompts = [list(range(10, 26)), list(range(100, 116)), list(range(200, 216)), list(range(10, 26))]
    what = "four 16-token prompts one after another on a 12-block pool: A, B, C (evicting A's blocks), A again"
    for i, p in enumerate(prompts):
        want = ref.generate([p], _sp(max_tokens=4))
        got = _run(what, mine, [p], _sp(max_tokens=4))
        _compare(what + f" (request {i})", got, want,
                 "a prefix hit served K/V that are not this prompt's: which block did the hit return, and what "
                 "does that block hold now?")
        _invariants(what + f", after request {i}", mine)


def _full_hit(m):
    mine, ref = _engines(m, "paged", num_blocks=32, **PAGED)
    p = list(range(10, 26))  # 16 tokens: exactly 4 blocks
    what = "the same 16-token prompt (4 full blocks of 4) twice"
    for _ in range(2):
        want = ref.generate([p], _sp(max_tokens=5))
        got = _run(what, mine, [p], _sp(max_tokens=5))
        _compare(what, got, want)
    if got[0].num_cached_tokens != 12:
        fail(f"scenario: {what}", f"the second request reused {got[0].num_cached_tokens} tokens from the cache",
             "expected 12: the first 3 blocks; the 4th holds the last prompt token, which must be computed",
             "a hit covers at most num_tokens - 1 tokens, in whole blocks")


def _salt(m):
    mine, ref = _engines(m, "paged", num_blocks=32, **PAGED)
    p = list(range(30, 48))  # 18 tokens: 4 full blocks and 2 tokens
    what = "an 18-token prompt sent by alice, then by bob, then by alice again (each with its cache_salt)"
    runs = [("alice", p), ("bob", p), ("alice", p)]
    got_cached = []
    for salt, ids in runs:
        req = {"prompt_token_ids": ids, "cache_salt": salt}
        want = ref.generate([req], _sp(max_tokens=4))
        got = _run(what, mine, [req], _sp(max_tokens=4))
        _compare(what, got, want)
        got_cached.append(got[0].num_cached_tokens)
        _invariants(what, mine)
    if got_cached[1] != 0:
        fail(f"scenario: {what}", f"bob's request reused {got_cached[1]} tokens cached by alice",
             "requests with different cache_salt must never share a block: bob's time to first token tells him "
             "which prefix alice sent", "which blocks' keys does the salt enter, and which do they inherit it from?")
    if got_cached[2] != 16:
        fail(f"scenario: {what}", f"alice's second request reused {got_cached[2]} tokens",
             "expected 16 (4 full blocks of her own earlier prompt): the salt must isolate tenants, not turn "
             "caching off")


class _SharedPrefixWatch:
    """After every step: requests that computed the same full blocks must hold the same physical blocks."""

    def __init__(self, prefix_len: int, block_size: int):
        self.n, self.bs, self.problem = prefix_len // block_size, block_size, None

    def on_step(self, llm, batch, events) -> None:
        if self.problem:
            return
        done = [s for s in llm.view.running if s.num_computed_tokens >= self.n * self.bs]
        tables = {s.request_id: list(s.block_table[:self.n]) for s in done}
        if len({tuple(t) for t in tables.values()}) > 1:
            self.problem = (f"after step {llm.view.step_index}, the requests hold the shared 16-token prefix "
                            f"in different blocks: {tables}; KV in use {llm.view.used_blocks} blocks")


def _duplicate(m):
    mine, ref = _engines(m, "paged", num_blocks=40, **PAGED)
    prefix = list(range(60, 76))
    prompts = [prefix + [200 + 3 * i, 201 + 3 * i, 202 + 3 * i] for i in range(3)]
    what = "three requests that share a new 16-token prefix, arriving together"
    watch = _SharedPrefixWatch(len(prefix), 4)
    remove = mine.add_observer(watch)
    want = ref.generate(prompts, _sp(max_tokens=4))
    got = _run(what, mine, prompts, _sp(max_tokens=4))
    remove()
    _compare(what, got, want)
    if watch.problem:
        fail(f"scenario: {what}", "the same prefix sits in several copies", watch.problem,
             "all three computed the prefix in the same step; when a block's key is already in the cache under "
             "another block, what should the second request do with its own copy?")
    _invariants(what, mine)


def _cow(m):
    mine, ref = _engines(m, "paged", num_blocks=40, **PAGED)
    what = "a 10-token prompt with SamplingParams(n=2, temperature=1.0, seed=7): 2 samples fork its blocks"
    p = list(range(1, 11))
    params = _sp(n=2, temperature=1.0, seed=7, max_tokens=8)
    want = ref.generate([p], params)
    got = _run(what, mine, [p], params)
    _compare(what, got, want, "the samples share the prompt's partial last block; who copies it, and when?")
    _invariants(what, mine)


def _contiguous(prompts_lens: list[int], max_tokens: int, hint: str):
    def scenario(m):
        mine, ref = _engines(m, "contiguous", max_num_seqs=2)
        what = f"greedy answers of {max_tokens} tokens to prompts of {', '.join(map(str, prompts_lens))} tokens"
        prompts = [list(range(5 + 7 * i, 5 + 7 * i + n)) for i, n in enumerate(prompts_lens)]
        for round_ in range(2):  # the second round reuses cache rows an earlier request wrote
            _compare(what + (", again" if round_ else ""), _run(what, mine, prompts, _sp(max_tokens=max_tokens)),
                     ref.generate(prompts, _sp(max_tokens=max_tokens)), hint)
    return scenario


def _slot_offset(m):
    mine, ref = _engines(m, "paged", num_blocks=32, **PAGED)
    prompts = [list(range(3, 9)), list(range(40, 53))]
    what = "greedy answers of 8 tokens to prompts of 6 and 13 tokens (block_size 4)"
    _compare(what, _run(what, mine, prompts, _sp(max_tokens=8)), ref.generate(prompts, _sp(max_tokens=8)),
             "the first token comes from the prefill; the second from a decode step: which slot did it write?")


def _allocator(m):
    mine, ref = _engines(m, "paged", num_blocks=10, **PAGED)
    prompts = [list(range(10 * i + 1, 10 * i + 8)) for i in range(6)]
    what = "six 7-token prompts with 12-token answers on a 10-block pool (requests finish and get preempted)"
    want = ref.generate(prompts, _sp(max_tokens=12))
    got = _run(what, mine, prompts, _sp(max_tokens=12))
    _compare(what, got, want, "two requests wrote into the same block: which one did the allocator hand out twice?")
    _invariants(what, mine)


def _weight_update(m):
    import torch

    mine, ref = _engines(m, "paged", num_blocks=32, **PAGED)  # one set of weights, shared by both engines
    p = list(range(70, 88))
    what = "an 18-token prompt, then a weight update in place and reset_prefix_cache(), then the prompt again"
    _run(what, mine, [p], _sp(max_tokens=4))
    with torch.no_grad():
        for w in mine.model.parameters():
            w.mul_(1.25)
    try:
        mine.reset_prefix_cache()
    except Exception as e:  # noqa: BLE001
        fail(f"scenario: {what}", f"reset_prefix_cache raised {type(e).__name__}", _short(str(e)))
    got = _run(what, mine, [p], _sp(max_tokens=4))
    want = ref.generate([p], _sp(max_tokens=4))
    _compare(what, got, want, f"the request after the reset reused {got[0].num_cached_tokens} cached tokens: "
                              "K/V computed by the old weights")
    _invariants(what + ", after the reset", mine)


def _mask(m):
    mine, ref = _engines(m, "naive")
    prompts = [[7], list(range(20, 26))]
    what = "greedy answers of 6 tokens to a 1-token and a 6-token prompt (naive engine, no cache)"
    _compare(what, _run(what, mine, prompts, _sp(max_tokens=6)), ref.generate(prompts, _sp(max_tokens=6)),
             "a 1-token prompt has no future to see; a longer one does")


LABS: dict[str, Lab] = {lab.name: lab for lab in [
    Lab("stale-prefix-entry", "prefix_caching", "a returning user gets a wrong answer on a busy server",
        "a prefix-cache entry left behind after its block was evicted and reused", _stale_prefix),
    Lab("full-prompt-hit", "prefix_caching", "the server stalls when the same prompt comes twice",
        "a full-prompt cache hit leaves nothing to prefill, so no logits for the first token", _full_hit),
    Lab("salt-last-block", "prefix_caching", "one tenant's prompt speeds up another tenant's requests",
        "the cache salt mixed into the last block only: the prefix blocks are shared across tenants", _salt),
    Lab("duplicate-prefix-blocks", "prefix_caching", "a burst of requests with a new shared prefix uses too much KV",
        "two requests sharing a new prefix in the same step keep duplicate blocks", _duplicate),
    Lab("cow-decrement-first", "copy_on_write", "parallel samples come out garbled; each alone is fine",
        "ref_count decremented before the copy-on-write check: the last two sharers write in place", _cow),
    Lab("decode-reads-past-len", "decode_step", "answers drift from the second token on",
        "a decode step that reads one slot past seq_len (stale or zero K/V)",
        _contiguous([3, 9], 8, "which cache positions does the step attend over, and which hold this request's K/V?")),
    Lab("missing-rescale", "decode_step", "short chats are right, long ones drift",
        "an online softmax that forgets to rescale the running sums when the max grows",
        _contiguous([4, 21], 8, "prompts under one tile of 8 are right: what changes when a second tile raises the "
                                "max?")),
    Lab("slot-offset", "slot_mapping", "the paged engine's first token is right, the rest are not",
        "a slot offset taken relative to the chunk instead of the absolute position", _slot_offset),
    Lab("allocator-double-hand", "block_allocator", "crashes under memory pressure: a block is still in use",
        "a freed block returned to two free lists, then handed to two requests", _allocator),
    Lab("stale-after-weight-update", "prefix_caching", "after a weight update some prompts get the old answers",
        "a prefix cache that survives reset_prefix_cache(): K/V of the old weights served after an update",
        _weight_update),
    Lab("causal-mask-peek", "causal_attention", "every prompt longer than one token gets another answer",
        "a causal mask off by one: each token sees the next one", _mask),
]}


def get(name: str) -> Lab:
    if name not in LABS:
        import difflib

        near = difflib.get_close_matches(name, list(LABS), n=1)
        raise KeyError(f"no bug lab {name!r}" + (f"; did you mean {near[0]!r}?" if near else "")
                       + f" (labs: {', '.join(LABS)})")
    return LABS[name]


@dataclass
class Result:
    lab: str
    passed: bool
    diagnosis: str
    seconds: float

    def report(self) -> str:
        head = (f"{self.lab}: FIXED (the scenario runs as on the engine's own code)" if self.passed
                else f"{self.lab}: the bug shows")
        return f"{head}\n{self.diagnosis.rstrip()}".rstrip()


def run_check(lab: Lab, path: Path, timeout: float | None = CHECK_SECONDS) -> Result:
    """Run the lab's scenario with the code of the file at `path`; never raises for the file's faults."""
    out = io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(out), time_limit(timeout):
            module = load_module(path, "bug_lab")
            if not hasattr(module, "engine_options"):
                raise CheckFailed(f"{path.name} defines no engine_options(); keep the function at the end of the "
                                  "lab file: it says which seam the code plugs into")
            planted = module.engine_options()
            if not isinstance(planted, dict) or lab.seam not in planted:
                raise CheckFailed(f"engine_options() returned {planted!r}; this lab's code plugs into the "
                                  f"{lab.seam!r} seam: fix the code, keep it in the engine")
            lab.scenario(module)
        return Result(lab.name, True, out.getvalue(), time.perf_counter() - t0)
    except (CheckFailed, CheckTimeout) as e:
        return Result(lab.name, False, out.getvalue() + str(e), time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001  an error in the lab file itself
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == str(path)]
        where = f" (line {frames[-1].lineno} of {path.name})" if frames else ""
        return Result(lab.name, False, out.getvalue() + f"{type(e).__name__}: {e}{where}", time.perf_counter() - t0)
