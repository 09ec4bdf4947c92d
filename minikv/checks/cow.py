"""Checker for the copy-on-write exercise (07a): give a writer its own copy of a shared block.

    copy_on_write(block_table, ref_count, start, end, block_size, allocate) -> [(src, dst), ...]

    the step writes positions [start, end) of one sequence; its block_table already covers end - 1
    block_table  [4, 9, 2]          changed in place: a copied block is replaced by its copy
    ref_count    [.., 3, .., 3, ..] how many block tables hold each physical block, changed in place
    allocate()   a free block id (ref_count 0)
    returns      the copies the model runner makes before the forward: K/V of src into dst

The checker runs hand-picked cases (each teaches one rule, and its failure names that rule), then
random ones, against the engine's `BlockManager.copy_on_write`; then it plugs the function into a
running engine: parallel samples and beams on shared blocks must give the engine's own tokens.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

from minikv.cache.block_manager import copy_on_write_rule
from minikv.checks.report import fail, passed

reference_copy_on_write = copy_on_write_rule  # the engine's own rule, on plain lists


@dataclass
class CowCase:
    block_table: list[int]
    ref_count: list[int]  # over the whole pool
    start: int
    end: int
    block_size: int
    lesson: str
    free: list[int] = field(default_factory=list)  # what allocate() hands out, in order

    def describe(self) -> str:
        refs = [self.ref_count[b] for b in self.block_table]
        return (f"block_table={self.block_table} (their ref_counts {refs}), block_size={self.block_size}, "
                f"the step writes positions {self.start}..{self.end - 1}")


def _pool(num_blocks: int, held: dict[int, int]) -> list[int]:
    refs = [0] * num_blocks
    for b, r in held.items():
        refs[b] = r
    return refs


def _free_blocks(refs: list[int]) -> list[int]:
    return [b for b, r in enumerate(refs) if r == 0]


# prompt of 10 tokens, block_size 4: [0-3][4-7][8-9 + 2 free slots], as in notebook 07
COW_CASES = [
    CowCase([4, 9, 2], _pool(16, {4: 1, 9: 1, 2: 1}), 10, 11, 4,
            "nobody shares the block: write in place, no copy"),
    CowCase([4, 9, 2], _pool(16, {4: 3, 9: 3, 2: 3}), 10, 11, 4,
            "the partial last block is shared by 3 samples: copy it before writing position 10"),
    CowCase([4, 9, 2], _pool(16, {4: 3, 9: 3, 2: 1}), 10, 11, 4,
            "the other samples already copied block 2: its last owner (ref_count 1) writes in place"),
    CowCase([4, 9, 2, 7], _pool(16, {4: 3, 9: 3, 2: 3, 7: 1}), 12, 13, 4,
            "position 12 opens a fresh block (7): the full shared blocks before it are only read, never copied"),
    CowCase([4, 9, 2], _pool(16, {4: 2, 9: 2, 2: 2}), 9, 11, 4,
            "only blocks the step writes into are copied: blocks 4 and 9 stay shared"),
    CowCase([4, 9, 2, 11], _pool(16, {4: 2, 9: 2, 2: 2, 11: 2}), 6, 14, 4,
            "a chunk that spans three shared blocks copies each of them, in logical order"),
    CowCase([5, 1], _pool(8, {5: 4, 1: 2}), 20, 21, 16,
            "block_size 16: position 20 is in logical block 1"),
]


def random_cow_cases(num: int, seed: int = 0) -> list[CowCase]:
    rng = random.Random(seed)
    cases = []
    while len(cases) < num:
        bs = rng.choice([4, 8, 16])
        n_pool = rng.randint(6, 24)
        table = rng.sample(range(n_pool), rng.randint(1, min(5, n_pool - 2)))
        refs = _pool(n_pool, {b: rng.choice([1, 1, 2, 3]) for b in table})
        end = rng.randint((len(table) - 1) * bs + 1, len(table) * bs)
        start = rng.randint(max(0, end - 2 * bs), end - 1)
        shared = sum(1 for i in range(start // bs, -(-end // bs)) if refs[table[i]] > 1)
        if shared > len(_free_blocks(refs)):
            continue  # more copies than free blocks: the engine would preempt before this step
        cases.append(CowCase(table, refs, start, end, bs, "random"))
    return cases


def _hint(case: CowCase, got: list[tuple[int, int]], expected: list[tuple[int, int]], table, refs,
          want_table, want_refs) -> str | None:
    written = set(range(case.start // case.block_size, min(len(case.block_table), -(-case.end // case.block_size))))
    copied_src = {s for s, _ in got}
    if any(case.ref_count[s] == 1 for s in copied_src):
        return "a block with ref_count 1 belongs to this sequence alone (the last owner): write in place"
    if any(case.block_table.index(s) not in written for s in copied_src if s in case.block_table):
        return ("only the blocks that positions [start, end) fall in are written: blocks start // block_size .. "
                "(end - 1) // block_size; the full blocks before them stay shared")
    if got == expected and table != want_table:
        return "put the copy in block_table[i] (in place): the next step must find this sequence's copy there"
    if got == expected and refs != want_refs:
        for b, (w, g) in enumerate(zip(want_refs, refs)):
            if w != g:
                if any(b == d for _, d in expected):
                    return f"the new block {b} is held by this one block table: its ref_count is 1"
                return (f"the source block {b} lost one holder (this sequence now uses its copy): "
                        "decrement its ref_count")
    if not got and expected:
        return "ref_count > 1 means another sequence reads this block: copy it, never write into it"
    return None


def _run_case(fn: Callable, case: CowCase, label: str) -> None:
    want_table, want_refs = list(case.block_table), list(case.ref_count)
    free = _free_blocks(case.ref_count)
    want_free = iter(free)
    expected = reference_copy_on_write(want_table, want_refs, case.start, case.end, case.block_size,
                                       lambda: next(want_free))
    table, refs = list(case.block_table), list(case.ref_count)
    handed: list[int] = []
    pool = iter(free)

    def allocate() -> int:
        b = next(pool, None)
        if b is None:
            fail(label, "allocate() called too often", f"the pool had {len(free)} free blocks; a write needs at "
                 "most one copy per block it touches")
        handed.append(b)
        return b

    raw = fn(table, refs, case.start, case.end, case.block_size, allocate)
    if raw is None:
        fail(label, "got None", f"expected the list of copies {expected}", "did the function forget to `return`?")
    try:
        got = [(int(s), int(d)) for s, d in raw]
    except (TypeError, ValueError):
        fail(label, "wrong return type", f"got {raw!r}; expected a list of (src, dst) pairs like {expected}")
    hint = _hint(case, got, expected, table, refs, want_table, want_refs)
    if got != expected:
        src_of = {case.block_table[i]: i for i in range(len(case.block_table))}
        why = []
        for s, d in expected:
            why.append(f"logical block {src_of[s]} = physical block {s} is written this step and "
                       f"{case.ref_count[s]} block tables hold it: expected a copy {s} -> {d}")
        first, last = case.start // case.block_size, (case.end - 1) // case.block_size
        for s, d in got:
            if any(s == e for e, _ in expected):
                continue
            if s not in src_of:
                why.append(f"you copied {s} -> {d}, but block {s} is not in this sequence's block_table")
            elif not first <= src_of[s] <= last:
                why.append(f"you copied {s} -> {d}, but logical block {src_of[s]} = physical block {s} is not "
                           f"written this step (it writes logical blocks {first}..{last})")
            else:
                why.append(f"you copied {s} -> {d}, but block {s} has ref_count {case.ref_count[s]}: "
                           "this sequence alone holds it")
        fail(label, f"copies: expected {expected}, got {got}", "\n".join(why) or "(no detail)", hint)
    if table != want_table:
        if len(table) != len(want_table):
            fail(label, f"block_table: expected {want_table}, got {table}",
                 "copy-on-write replaces entries of the table, it never adds or removes one", hint)
        i = next(i for i, (a, b) in enumerate(zip(want_table, table)) if a != b)
        fail(label, f"block_table: expected {want_table}, got {table}",
             f"first difference at logical block {i}: expected physical block {want_table[i]}, got {table[i]}", hint)
    if refs != want_refs:
        b = next(b for b, (w, g) in enumerate(zip(want_refs, refs)) if w != g)
        involved = sorted(set(want_table) | set(case.block_table))
        fail(label, f"ref_count[{b}]: expected {want_refs[b]}, got {refs[b]}",
             f"ref_count of the blocks involved: expected { {x: want_refs[x] for x in involved} }, "
             f"got { {x: refs[x] for x in involved} }", hint)


def check_copy_on_write(fn: Callable, num_random: int = 300, seed: int = 0) -> None:
    """Hand-picked cases, then random tables and refcounts, against the engine's rule."""
    cases = list(COW_CASES) + random_cow_cases(num_random, seed)
    for i, case in enumerate(cases):
        _run_case(fn, case, f"case {i} ({case.lesson}): {case.describe()}")
    passed(len(cases), "copy_on_write copies exactly the shared blocks a step writes into, "
                       "and keeps block tables and ref_counts exact")


def check_copy_on_write_in_engine(llm, fn: Callable, prompt, n: int = 4, max_tokens: int = 12,
                                  beam_width: int = 3) -> None:
    """Parallel samples (seeded) and a beam search on `llm` with the engine's copy-on-write, then on the
    same weights with `fn` in the rung-6 seam, `LLM(..., kv_backend="paged", copy_on_write=fn)`: same
    tokens, same number of copies, block tables and ref_counts exact after every step."""
    from minikv import SamplingParams

    if llm.block_size is None:
        raise ValueError(f"this LLM uses kv_backend={llm.kv_backend!r}; build it with kv_backend='paged'")
    params = SamplingParams(max_tokens=max_tokens, n=n, temperature=1.0, seed=0, ignore_eos=True)
    want_samples = [c.token_ids for c in llm.generate(prompt, params)[0].outputs]
    want_copies = llm.stats()["cow_copies"]
    want_beams = [c.token_ids for c in llm.beam_search(prompt, beam_width, max_tokens)[0].outputs]

    mine = llm.derive(copy_on_write=fn)  # the rung-6 seam: LLM(..., copy_on_write=fn)

    class InvariantCheck:  # an observer: after every step, block tables and ref_counts must agree
        def on_step(self, engine, batch, events) -> None:
            try:
                engine.view.check()
            except AssertionError as e:
                fail("the engine with your copy_on_write",
                     f"bookkeeping broke at engine step {engine.view.step_index}", str(e),
                     "every copy takes one block (ref_count 1) and gives back one reference to the source")

    mine.add_observer(InvariantCheck())
    got_samples = [c.token_ids for c in mine.generate(prompt, params)[0].outputs]
    got_copies = mine.stats()["cow_copies"]
    got_beams = [c.token_ids for c in mine.beam_search(prompt, beam_width, max_tokens)[0].outputs]
    _compare("parallel sample", want_samples, got_samples, _decode(llm))
    if got_copies != want_copies:
        fail(f"{n} parallel samples", f"copies: expected {want_copies}, got {got_copies}",
             "the samples share the prompt's partial last block: each sample but the last owner copies it once")
    _compare("beam", want_beams, got_beams, _decode(llm))
    passed(2, f"the engine ran {n} parallel samples and a beam search of width {beam_width} on your copy_on_write "
              f"({got_copies} copies) and generated the engine's own tokens")


def _decode(llm) -> Callable[[list[int]], str]:
    return (lambda ids: repr(llm.tokenizer.decode(ids))) if llm.tokenizer is not None else str


def _compare(what: str, want: list[list[int]], got: list[list[int]], show: Callable) -> None:
    for i, (w, g) in enumerate(zip(want, got)):
        if w != g:
            j = next((k for k, (a, b) in enumerate(zip(w, g)) if a != b), min(len(w), len(g)))
            fail(f"{what} {i} of {len(want)}", f"tokens differ from token {j} on",
                 f"engine: {show(w)}\nyours:  {show(g)}",
                 "a sample that wrote into a block its siblings still read changed their past: their later "
                 "tokens attend to a key that is not theirs")
