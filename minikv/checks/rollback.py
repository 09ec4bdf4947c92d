"""Checker for exercise 13a: roll the paged KV back after a speculative step (the rung-11 seam).

    rollback(block_table, num_computed_tokens, block_size, free) -> None
        after verification the sequence's K/V is valid for positions [0, num_computed_tokens): the
        tokens it had, and the drafts the target accepted. Blocks past ceil(num_computed_tokens /
        block_size) hold only rejected drafts' K/V: hand each to free(block), LAST block first, and
        shorten block_table in place.

      block_table  [7, 3, 9, 12]     block_size 4, num_computed_tokens 6
                   [0-3][4-7][8-11][12-15]
                    kept  kept  free  free       -> block_table [7, 3]; free(12), then free(9)

`check_rollback(fn)` compares it with the engine's `rollback_blocks` on hand-picked and random cases;
`check_rollback_in_engine(llm, fn, ...)` runs the engine with it (`LLM(..., speculative=...,
spec_rollback=fn)`) and compares tokens and blocks, step by step, with the engine's own rollback.
"""
from __future__ import annotations

import random

from minikv.cache.block_manager import blocks_needed
from minikv.checks.report import fail, passed
from minikv.engine.speculative import rollback_blocks


def _run(fn, table: list[int], num_computed: int, block_size: int) -> tuple[list[int], list[int]]:
    table, freed = list(table), []
    fn(table, num_computed, block_size, freed.append)
    return table, freed


def check_rollback(rollback, num_random: int = 300, seed: int = 0) -> None:
    cases = [
        ("every block still needed: nothing to free", [7, 3], 6, 4),
        ("one block of rejected drafts", [7, 3, 9], 6, 4),
        ("two blocks go, the last one first", [7, 3, 9, 12], 6, 4),
        ("the accepted tokens end exactly on a block boundary", [7, 3, 9], 8, 4),
        ("one token kept", [5, 6, 2], 1, 4),
        ("block size 1", [4, 1, 8, 2], 2, 1),
        ("block ids in any order: free by position, not by id", [12, 9, 3, 7], 5, 4),
    ]
    rng = random.Random(seed)
    for _ in range(num_random):
        bs = rng.choice([1, 2, 4, 16])
        n = rng.randint(1, 40)
        extra = rng.randint(0, 3)
        ids = rng.sample(range(100), blocks_needed(n, bs) + extra)
        cases.append(("random", ids, n, bs))
    for lesson, table, n, bs in cases:
        case = f"case: {lesson}\n  block_table={table}, num_computed_tokens={n}, block_size={bs}"
        want_table, want_freed = _run(rollback_blocks, table, n, bs)
        try:
            got_table, got_freed = _run(rollback, table, n, bs)
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001
            fail(case, "rollback raised", f"{type(e).__name__}: {e}")
        if got_table != want_table:
            fail(case, "block_table afterwards is wrong", f"expected {want_table}\ngot      {got_table}",
                 f"keep ceil({n} / {bs}) = {len(want_table)} blocks; shorten the list in place (pop), do not rebind it")
        if got_freed != want_freed:
            fail(case, "the blocks handed to free are wrong", f"expected {want_freed}\ngot      {got_freed}",
                 "free every block past the kept ones exactly once, the last block first")
    passed(len(cases), "rollback keeps the blocks of the accepted tokens and frees the rest, last first")


class _Trace:
    """Per step: each running request's (tokens, blocks), and the pool's used blocks."""

    def __init__(self):
        self.steps: list = []

    def on_step(self, llm, batch, events):
        view = llm.view
        seqs = sorted(view.running, key=lambda s: s.request_id)
        self.steps.append(([(s.num_tokens, len(s.block_table)) for s in seqs], view.used_blocks))


def check_rollback_in_engine(llm, rollback, prompts: list, max_tokens: int = 24, **speculative) -> dict:
    """`llm.derive(spec_rollback=rollback, **speculative)` (default n-gram drafts, k = 4) generates
    `prompts` greedily; its tokens, and its blocks after every step, must equal those of the engine's
    own rollback, and at least one block must have been rolled back. Returns the speculative stats."""
    from minikv import SamplingParams

    if llm.block_size is None:
        raise ValueError("build the LLM with kv_backend='paged': rollback gives back blocks of the paged pool")
    speculative = speculative or {"speculative": "ngram", "num_speculative_tokens": 4}
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    runs = {}
    for who, fn in (("yours", rollback), ("engine", None)):
        engine = llm.derive(spec_rollback=fn, **speculative)
        trace = _Trace()
        engine.add_observer(trace)
        try:
            outs = engine.generate(prompts, params, use_tqdm=False)
        except ValueError as e:
            if who == "yours" and "must keep" in str(e):
                fail("the engine, speculating", "your rollback left the pool wrong", str(e),
                     "run check_rollback first: it shows the smallest case that fails")
            raise
        runs[who] = ([o.token_ids for o in outs], trace.steps, engine.stats()["speculative"])
    (toks, steps, stats), (want_toks, want_steps, _) = runs["yours"], runs["engine"]
    if toks != want_toks:
        fail("the engine, speculating", "the tokens differ from the engine's own rollback",
             f"expected {want_toks}\ngot      {toks}", "a block freed too early loses K/V the next step reads")
    for i, (got, want) in enumerate(zip(steps, want_steps)):
        if got != want:
            fail(f"the engine, speculating: after step {i}", "the blocks held differ from the engine's own rollback",
                 f"(tokens, blocks) of each request and used blocks: expected {want}\ngot      {got}",
                 "keep ceil(num_computed_tokens / block_size) blocks, no more, no fewer")
    if stats["rolled_back_blocks"] == 0:
        fail("the engine, speculating", "no block was rolled back in this run",
             "the check proves nothing unless drafts are rejected across a block boundary",
             "use a smaller block_size or longer prompts and outputs")
    passed(len(steps), f"with your rollback the engine gives its own tokens and blocks at every step "
                       f"({stats['accepted']} of {stats['drafted']} drafts accepted, "
                       f"{stats['rolled_back_blocks']} blocks rolled back)")
    return stats
