"""Find-the-bug labs: the real engine with one realistic bug planted through a named seam.

    minikv bugs list [--json]                 the labs: symptom, seam
    minikv bugs start NAME                    writes bug_NAME.py here: the buggy code and the symptom; starts the clock
    minikv bugs hint NAME [--level 2]         a hint: the tools to localize it, then where to look
    minikv bugs check NAME [FILE] [--seed S]  runs the lab's scenario on FILE (default bug_NAME.py here)
    minikv bugs check NAME --buggy | --fixed  on the shipped buggy or fixed code
    minikv bugs status                        the labs' clocks: time used, checks, fixed or not

Each lab file defines `engine_options()`: the seam it plugs into `LLM(...)` (prefix_caching,
copy_on_write, decode_step, slot_mapping, block_allocator, causal_attention; see SEAMS in
minikv/engine/config.py) with the team's code in it. Nothing edits the engine: the bug lives in the
code the seam carries, as it would in a team's own extension of a serving engine.

A check first makes sure the fix is a fix of the team's code (guard.py): the seam carries code
defined in the lab file (not None, not the engine's built-in design, not the engine's class), the
functions and methods of the shipped file are still defined there, and nothing new is imported from
minikv. Then it runs a scenario on tiny-random (about a second) against the engine's own code on the
same seam, with random prompts drawn from a printed seed (`--seed` replays them), pushed past the
boundaries a partial fix could dodge; and it shows the feature still working (a returning prompt
hits its cached blocks, copy-on-write copies what it must). After FIXED it prints the root cause,
the regression test an engineer would add, and where the bug was seen in real engines.
"""
from __future__ import annotations

import ast
import contextlib
import io
import random
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable

from minikv.checks.report import CheckFailed, fail
from minikv.interview import clock, guard
from minikv.interview.bug_notes import NOTES, Notes
from minikv.interview.drills import CHECK_SECONDS, CheckTimeout, load_module, time_limit

FILES = Path(__file__).resolve().parent / "bug_files"
MODEL = "tiny-random"
VOCAB = (3, 480)  # random prompt ids are drawn from this range (tiny-random's vocabulary is larger)


@dataclass(frozen=True)
class Lab:
    name: str
    seam: str
    symptom: str  # what a user reports
    field_note: str  # what the bug is, in one line
    scenario: Callable[[ModuleType, random.Random], None]  # raises CheckFailed when the bug shows
    minutes: int = 30
    extra_check: Callable[[ModuleType, Path], str | None] | None = None  # a lab's own rule on the fix

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

    @property
    def notes(self) -> Notes:
        return NOTES[self.name]

    @property
    def clock_name(self) -> str:
        return f"bugs:{self.name}"


# ---- scenario helpers --------------------------------------------------------------------------------

def _engines(module: ModuleType, kv_backend: str, **options):
    """(the engine on the lab's code, the same engine on minikv's own code): same weights, same options."""
    from minikv import LLM

    ref = LLM(MODEL, kv_backend=kv_backend, **options)
    planted = module.engine_options()
    return ref.derive(**planted), ref


def _toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


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


def _hits(what: str, got, want) -> None:
    """The feature still works: the lab's cache reuses as many tokens as the engine's own cache."""
    g, w = [o.num_cached_tokens for o in got], [o.num_cached_tokens for o in want]
    if g != w:
        fail(f"scenario: {what}", f"the cache reused {g} tokens where the engine's own cache, on the same pool and "
             f"the same requests, reuses {w}",
             "a fix must keep the cache useful: a prompt whose blocks are still cached hits them",
             "the tokens were right; what does your cache no longer find, or what does it find that it should not?")


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

def _stale_prefix(m, rng):
    """A, A again (a hit), B, C (evicting A's blocks), A again, A extended: on a 10-block pool. Prompt
    lengths make every block of a finished request full (len + 4 - 1 a multiple of 4), so the block a
    stale key names is cached under another prompt's key: the hit serves that prompt's K/V."""
    mine, ref = _engines(m, "paged", num_blocks=10, **PAGED)
    own = ref.derive(prefix_caching="hash")
    a, b, c = (_toks(rng, rng.choice([13, 17, 21])) for _ in range(3))
    steps = [("A", a), ("A again", a), ("B", b), ("C", c), ("A a third time", a),
             ("A with more", a + _toks(rng, rng.randrange(2, 9)))]
    what = (f"prompts of {len(a)}, {len(a)}, {len(b)}, {len(c)}, {len(a)} and {len(steps[-1][1])} tokens, one after "
            "another, on a 10-block pool (block_size 4): A, A again, B, C (evicting A's blocks), A, A extended")
    for label, p in steps:
        want = ref.generate([p], _sp(max_tokens=4))
        got = _run(what, mine, [p], _sp(max_tokens=4))
        _compare(f"{what}; at {label}", got, want,
                 "a prefix hit served K/V that are not this prompt's: which block did the hit return, and what "
                 "does that block hold now?")
        _hits(f"{what}; at {label}", got, own.generate([p], _sp(max_tokens=4)))
    _invariants(what + ", at the end", mine)


def _full_hit(m, rng):
    mine, ref = _engines(m, "paged", num_blocks=32, **PAGED)
    n = rng.choice([12, 16, 20])
    p = _toks(rng, n)
    what = f"the same {n}-token prompt ({n // 4} full blocks of 4) twice"
    for _ in range(2):
        want = ref.generate([p], _sp(max_tokens=5))
        got = _run(what, mine, [p], _sp(max_tokens=5))
        _compare(what, got, want)
    if got[0].num_cached_tokens != n - 4:
        fail(f"scenario: {what}", f"the second request reused {got[0].num_cached_tokens} tokens from the cache",
             f"expected {n - 4}: all blocks but the last; the last holds the last prompt token, which must be "
             "computed", "a hit covers at most num_tokens - 1 tokens, in whole blocks")


def _salt(m, rng):
    mine, ref = _engines(m, "paged", num_blocks=32, **PAGED)
    own = ref.derive(prefix_caching="hash")
    p = _toks(rng, rng.randrange(17, 23))
    what = f"a {len(p)}-token prompt sent by alice, then by bob, then by alice again (each with its cache_salt)"
    got_cached = []
    for salt in ("alice", "bob", "alice"):
        req = {"prompt_token_ids": p, "cache_salt": salt}
        want = ref.generate([req], _sp(max_tokens=4))
        got = _run(what, mine, [req], _sp(max_tokens=4))
        _compare(what, got, want)
        got_cached.append(got[0].num_cached_tokens)
        if salt == "bob" and got_cached[1] != 0:
            fail(f"scenario: {what}", f"bob's request reused {got_cached[1]} tokens cached by alice",
                 "requests with different cache_salt must never share a block: bob's time to first token tells "
                 "him which prefix alice sent", "which blocks' keys does the salt enter, and which do they inherit "
                 "it from?")
        _hits(what + f"; {salt}'s request", got, own.generate([req], _sp(max_tokens=4)))
        _invariants(what, mine)


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
            self.problem = (f"after step {llm.view.step_index}, the requests hold the shared prefix "
                            f"in different blocks: {tables}; KV in use {llm.view.used_blocks} blocks")


def _duplicate(m, rng):
    mine, ref = _engines(m, "paged", num_blocks=40, **PAGED)
    own = ref.derive(prefix_caching="hash")
    prefix = _toks(rng, rng.choice([12, 16]))
    prompts = [prefix + _toks(rng, rng.randrange(1, 4)) for _ in range(3)]
    what = f"three requests that share a new {len(prefix)}-token prefix, arriving together, then one more"
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
    _hits(what, got, own.generate(prompts, _sp(max_tokens=4)))
    later = [prefix + _toks(rng, 3)]
    _hits(what + "; the later request", _run(what, mine, later, _sp(max_tokens=4)),
          own.generate(later, _sp(max_tokens=4)))
    _invariants(what, mine)


def _cow(m, rng):
    mine, ref = _engines(m, "paged", num_blocks=40, **PAGED)
    n, seed, length = rng.choice([2, 3]), rng.randrange(1, 1000), rng.choice([5, 6, 7, 9, 10, 11])
    what = (f"a {length}-token prompt with SamplingParams(n={n}, temperature=1.0, seed={seed}, ignore_eos=True): "
            f"{n} samples fork its blocks")
    p = _toks(rng, length)
    # ignore_eos: a sample that drew EOS as its first token would share nothing, and with n=2 neither rule
    # would copy (the bug hid in 3 seeds of 150 before; with it, in none of 400)
    params = _sp(n=n, temperature=1.0, seed=seed, max_tokens=8, ignore_eos=True)
    want = ref.generate([p], params)
    got = _run(what, mine, [p], params)
    _compare(what, got, want, "the samples share the prompt's partial last block; who copies it, and when?")
    _invariants(what, mine)
    mine_copies, own_copies = mine.stats()["cow_copies"], ref.stats()["cow_copies"]
    if mine_copies != own_copies:
        fail(f"scenario: {what}", f"the rule made {mine_copies} copies where the engine's own rule makes {own_copies}",
             "copy-on-write copies a block only when someone else still reads it: the last sharer writes in place",
             "the tokens were right; count the sharers of each block at the moment the rule runs")


def _contiguous(len_ranges: list[tuple[int, int]], max_tokens: int, hint: str):
    def scenario(m, rng):
        mine, ref = _engines(m, "contiguous", max_num_seqs=2)
        lens = [rng.randrange(lo, hi + 1) for lo, hi in len_ranges]
        what = f"greedy answers of {max_tokens} tokens to prompts of {', '.join(map(str, lens))} tokens"
        prompts = [_toks(rng, n) for n in lens]
        for round_ in range(2):  # the second round reuses cache rows an earlier request wrote
            _compare(what + (", again" if round_ else ""), _run(what, mine, prompts, _sp(max_tokens=max_tokens)),
                     ref.generate(prompts, _sp(max_tokens=max_tokens)), hint)
    return scenario


def _reference_decode(q, k_cache, v_cache, pos, scale):
    import torch

    group = q.shape[0] // k_cache.shape[1]
    k = k_cache[:pos + 1].repeat_interleave(group, dim=1).double()
    v = v_cache[:pos + 1].repeat_interleave(group, dim=1).double()
    scores = torch.einsum("hd,jhd->hj", q.double(), k) * scale
    return torch.einsum("hj,jhd->hd", scores.softmax(dim=-1), v)


def _rescale(m, rng):
    """The engine on a short and a long chat, then decode_step by hand: rows of many tiles, and scores
    about 60 times larger than tiny-random's (a real model's), where exp overflows without a running max."""
    import torch

    _contiguous([(2, 3), (37, 70)], 6, "a short chat stays within one tile of 8 and is right: what changes when a "
                "second tile raises the max?")(m, rng)
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    for _ in range(6):
        kv_heads, group, d = rng.choice([1, 2]), rng.choice([1, 2, 4]), 16
        pos = rng.randrange(40, 300)
        big = rng.choice([1.0, 60.0])
        q = torch.randn(kv_heads * group, d, generator=gen) * big
        k_cache = torch.randn(pos + 20, kv_heads, d, generator=gen) * 4
        v_cache = torch.randn(pos + 20, kv_heads, d, generator=gen)
        k_new, v_new = torch.randn(kv_heads, d, generator=gen) * 4, torch.randn(kv_heads, d, generator=gen)
        scale = d ** -0.5
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        k_ref[pos], v_ref[pos] = k_new, v_new
        want = _reference_decode(q, k_ref, v_ref, pos, scale)
        got = m.decode_step(q, k_new, v_new, k_cache, v_cache, pos, scale)
        what = (f"decode_step by hand: a cache row of {pos + 1} positions ({-(-(pos + 1) // 8)} tiles), "
                f"{kv_heads * group} heads over {kv_heads} KV heads, scores scaled by {big:g}")
        if not torch.isfinite(got).all():
            fail(f"scenario: {what}", "the output holds inf or NaN",
                 "exp(score) overflows float32 past about 88: the scores must be shifted by a running max",
                 "what does the code subtract before exp, and is it the max so far?")
        err = (got.double() - want).abs().max().item()
        if err > 1e-3 * max(1.0, want.abs().max().item()):
            fail(f"scenario: {what}", f"the output differs from softmax(scores) @ values by up to {err:.3g}",
                 hint="when a tile raises the running max, what happens to what was summed before it?")


def _keeps_tiles(m, path: Path) -> str | None:
    if getattr(m, "TILE", None) != 8:
        return (f"TILE is {getattr(m, 'TILE', None)!r}: it is the kernel's tile (what fits in its fast memory); "
                "keep TILE = 8 and fix the arithmetic")
    fn = next((n for n in ast.walk(ast.parse(path.read_text()))
               if isinstance(n, ast.FunctionDef) and n.name == "decode_step"), None)
    loops = fn is not None and any(isinstance(n, ast.For) for n in ast.walk(fn))
    uses = fn is not None and any(isinstance(n, ast.Name) and n.id == "TILE" for n in ast.walk(fn))
    if not (loops and uses):
        return "decode_step must still read the row tile by tile (a loop over tiles of TILE): fix the online softmax"
    return None


def _slot_offset(m, rng):
    mine, ref = _engines(m, "paged", num_blocks=32, **PAGED)
    prompts = [_toks(rng, rng.randrange(3, 10)), _toks(rng, rng.randrange(10, 18))]
    what = f"greedy answers of 8 tokens to prompts of {len(prompts[0])} and {len(prompts[1])} tokens (block_size 4)"
    _compare(what, _run(what, mine, prompts, _sp(max_tokens=8)), ref.generate(prompts, _sp(max_tokens=8)),
             "the first token comes from the prefill; the second from a decode step: which slot did it write?")


def _allocator(m, rng):
    mine, ref = _engines(m, "paged", num_blocks=10, **PAGED)
    prompts = [_toks(rng, rng.randrange(6, 9)) for _ in range(6)]
    what = (f"six prompts of {', '.join(str(len(p)) for p in prompts)} tokens with 12-token answers on a 10-block "
            "pool (requests finish and get preempted)")
    want = ref.generate(prompts, _sp(max_tokens=12))
    got = _run(what, mine, prompts, _sp(max_tokens=12))
    _compare(what, got, want, "two requests wrote into the same block: which one did the allocator hand out twice?")
    _invariants(what, mine)


def _weight_update(m, rng):
    import torch

    mine, ref = _engines(m, "paged", num_blocks=32, **PAGED)  # one set of weights, shared by both engines
    p = _toks(rng, rng.randrange(17, 23))
    what = f"a {len(p)}-token prompt, then a weight update in place and reset_prefix_cache(), then the prompt again"
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
    again = _run(what, mine, [p], _sp(max_tokens=4))
    if again[0].num_cached_tokens < 4:
        fail(f"scenario: {what}, and once more", f"the third request reused {again[0].num_cached_tokens} tokens",
             "after the reset the cache must fill again: the prompt computed on the new weights is a hit",
             "a fix must clear the cache on reset, not turn caching off")


def _mask(m, rng):
    mine, ref = _engines(m, "naive")
    # three longer prompts: on the tiny random model one peek now and then leaves a greedy answer unchanged
    # (4 seeds in 200 with one prompt; with three, none in 300)
    one, longer = [_toks(rng, 1)], [_toks(rng, rng.randrange(4, 10)) for _ in range(3)]
    what = "the first token of a 1-token prompt (naive engine, no cache)"
    _compare(what, _run(what, mine, one, _sp(max_tokens=1)), ref.generate(one, _sp(max_tokens=1)))
    what = (f"greedy answers of 6 tokens to prompts of {', '.join(str(len(p)) for p in longer)} tokens "
            "(naive engine, no cache)")
    _compare(what, _run(what, mine, longer, _sp(max_tokens=6)), ref.generate(longer, _sp(max_tokens=6)),
             "a 1-token prompt has no future to see; a longer one does")


LABS: dict[str, Lab] = {lab.name: lab for lab in [
    Lab("stale-prefix-entry", "prefix_caching", "a returning user gets a wrong answer on a busy server",
        "a prefix-cache entry left behind after its block was evicted and reused", _stale_prefix),
    Lab("full-prompt-hit", "prefix_caching", "the server stalls when the same prompt comes twice",
        "a full-prompt cache hit leaves nothing to prefill, so no logits for the first token", _full_hit, 20),
    Lab("salt-last-block", "prefix_caching", "one tenant's prompt speeds up another tenant's requests",
        "the cache salt mixed into the last block only: the prefix blocks are shared across tenants", _salt, 20),
    Lab("duplicate-prefix-blocks", "prefix_caching", "a burst of requests with a new shared prefix uses too much KV",
        "two requests sharing a new prefix in the same step keep duplicate blocks", _duplicate),
    Lab("cow-decrement-first", "copy_on_write", "parallel samples come out garbled; each alone is fine",
        "ref_count decremented before the copy-on-write check: the last two sharers write in place", _cow, 20),
    Lab("decode-reads-past-len", "decode_step", "answers drift from the second token on",
        "a decode step that reads one slot past seq_len (stale or zero K/V)",
        _contiguous([(2, 5), (8, 14)], 8, "which cache positions does the step attend over, and which hold this "
                                          "request's K/V?"), 15),
    Lab("missing-rescale", "decode_step", "short chats are right, long ones drift",
        "an online softmax that forgets to rescale the running sums when the max grows", _rescale, 20, _keeps_tiles),
    Lab("slot-offset", "slot_mapping", "the paged engine's first token is right, the rest are not",
        "a slot offset taken relative to the chunk instead of the absolute position", _slot_offset, 15),
    Lab("allocator-double-hand", "block_allocator", "crashes under memory pressure: a block is still in use",
        "a freed block returned to two free lists, then handed to two requests", _allocator),
    Lab("stale-after-weight-update", "prefix_caching", "after a weight update some prompts get the old answers",
        "a prefix cache that survives reset_prefix_cache(): K/V of the old weights served after an update",
        _weight_update, 20),
    Lab("causal-mask-peek", "causal_attention", "every prompt longer than one token gets another answer",
        "a causal mask off by one: each token sees the next one", _mask, 15),
]}


def get(name: str) -> Lab:
    if name not in LABS:
        import difflib

        near = difflib.get_close_matches(name, list(LABS), n=1)
        raise KeyError(f"no bug lab {name!r}" + (f"; did you mean {near[0]!r}?" if near else "")
                       + f" (labs: {', '.join(LABS)})")
    return LABS[name]


def hint(lab: Lab, level: int = 1) -> str:
    hints = lab.notes.hints
    level = max(1, min(level, len(hints)))
    more = f" (`--level {level + 1}` for a closer one)" if level < len(hints) else ""
    return f"{lab.name}, hint {level} of {len(hints)}{more}:\n{hints[level - 1]}"


@dataclass
class Result:
    lab: str
    passed: bool
    diagnosis: str
    seconds: float
    seed: int = 0
    clock: dict | None = None
    timed: bool = False

    def report(self) -> str:
        lab = LABS[self.lab]
        if self.passed:
            n = lab.notes
            lines = [f"{self.lab}: FIXED (the scenario runs as on the engine's own code; seed {self.seed})",
                     self.diagnosis.rstrip(),
                     f"root cause: {n.cause}",
                     f"the regression test to add: {n.regression}",
                     f"seen in real engines: {n.field}",
                     *[f"  {url}" for url in n.links]]
        else:
            lines = [f"{self.lab}: the bug shows", self.diagnosis.rstrip(),
                     f"(random prompts drawn with seed {self.seed}; `--seed {self.seed}` replays them; "
                     f"`minikv bugs hint {self.lab}` if stuck)"]
        if self.timed:
            lines.append(clock.describe(self.clock, lab.minutes, "bugs", self.lab))
        return "\n".join(line for line in lines if line).rstrip()


def _own_code(lab: Lab, module: ModuleType, path: Path) -> None:
    """Refuse a 'fix' that is not a fix of the team's code (raises CheckFailed)."""
    if not hasattr(module, "engine_options"):
        raise CheckFailed(f"{path.name} defines no engine_options(); keep the function at the end of the "
                          "lab file: it says which seam the code plugs into")
    planted = module.engine_options()
    if not isinstance(planted, dict) or lab.seam not in planted:
        raise CheckFailed(f"engine_options() returned {planted!r}; this lab's code plugs into the "
                          f"{lab.seam!r} seam: fix the code, keep it in the engine")
    value = planted[lab.seam]
    if value is None or isinstance(value, str):
        raise CheckFailed(f"engine_options() plugs {value!r} into the {lab.seam!r} seam: that is the engine's own "
                          "design, not the team's code; fix the team's code and keep it plugged in")
    foreign = guard.foreign_imports(path, lab.buggy)
    if foreign:
        raise CheckFailed(foreign)
    gone = guard.missing_definitions(module, path, guard.shipped_names(lab.buggy))
    if gone:
        raise CheckFailed(f"{', '.join(gone)} must stay defined in {path.name}: the bug is in the team's code, and "
                          "the fix goes there (deleting it falls back on the engine's code)")
    if not guard.defined_here(value, path, module):
        what = getattr(value, "__qualname__", None) or type(value).__qualname__
        raise CheckFailed(f"engine_options() plugs {what} into the {lab.seam!r} seam, which is not defined in "
                          f"{path.name}: plug in the team's fixed code")
    if lab.extra_check is not None:
        why = lab.extra_check(module, path)
        if why:
            raise CheckFailed(why)


def run_check(lab: Lab, path: Path, seed: int | None = None, timeout: float | None = CHECK_SECONDS,
              timed: bool = False) -> Result:
    """Run the lab's scenario with the code of the file at `path`; never raises for the file's faults."""
    seed = random.SystemRandom().randrange(1, 2**31) if seed is None else seed
    out = io.StringIO()
    t0 = time.perf_counter()
    passed = False
    try:
        with contextlib.redirect_stdout(out), time_limit(timeout):
            module = load_module(path, "bug_lab")
            _own_code(lab, module, path)
            lab.scenario(module, random.Random(seed))
        passed, diagnosis = True, out.getvalue()
    except (CheckFailed, CheckTimeout) as e:
        diagnosis = out.getvalue() + str(e)
    except Exception as e:  # noqa: BLE001  an error in the lab file itself
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == str(path)]
        where = f" (line {frames[-1].lineno} of {path.name})" if frames else ""
        diagnosis = out.getvalue() + f"{type(e).__name__}: {e}{where}"
    entry = clock.record(lab.clock_name, passed) if timed else None
    return Result(lab.name, passed, diagnosis, time.perf_counter() - t0, seed, entry, timed)
