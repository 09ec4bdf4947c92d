"""Checker for exercise 09b: which blocks a sliding window with sink tokens may give back.

    window_free_rule(block_table, num_computed_tokens, block_size, sliding_window, sink_tokens)
        -> [logical index, ...]    the blocks that may go back to the pool now

    the next query is at position c = num_computed_tokens; it and every later one see
        [0, sink_tokens)                  the sinks
        [c - sliding_window + 1, ...)     their windows
    block i holds positions [i * block_size, (i + 1) * block_size); -1 in block_table: already given back

Two stages, each stopping at the first problem with a message that says where:
  1. check_window_rule: hand-picked cases (each teaches one edge: a short sequence, sinks that end
     mid-block, the window's first position, entries already given back, no sinks) and 300 random
     ones, against the engine's rule (minikv/cache/blocks/window.py)
  2. check_window_in_engine: the engine runs a long generation with the learner's rule plugged in
     (`llm.derive(window_free_rule=fn)`, built when the check runs): the same tokens, the same blocks
     given back and the same peak as with the engine's own rule
"""
from __future__ import annotations

import random
from typing import Callable

from minikv.cache.blocks.window import NO_BLOCK, first_seen
from minikv.cache.blocks.window import window_free_rule as reference_rule
from minikv.checks.report import fail, passed

# (block_table, num_computed_tokens, block_size, sliding_window, sink_tokens, what the case teaches)
CASES = [
    ([3, 8, 1], 9, 4, 8, 0, "a sequence shorter than its window frees nothing"),
    ([7, 3, 9, 2, 5], 17, 4, 6, 2, "the docstring's picture: blocks 1 and 2 go, block 0 holds the sinks"),
    ([7, 3, 9, 2, 5], 17, 4, 6, 0, "without sinks, block 0 may go too"),
    ([4, 0, 6, 2, 5, 1], 21, 4, 8, 5, "sinks that end inside block 1 keep blocks 0 and 1"),
    ([4, 0, 6, 2, 5, 1], 20, 4, 8, 0, "the next query at 20 sees 13-20: block 2 (8-11) goes, block 3 (12-15) stays"),
    ([4, 0, 6, 2, 5, 1], 19, 4, 8, 0, "the next query at 19 sees 12-19: block 2 (8-11) ends right before it, goes"),
    ([4, 0, 6, 2, 5, 1], 18, 4, 8, 0, "the next query at 18 sees 11-18: block 2 (8-11) still holds position 11"),
    ([4, -1, -1, 2, 5, 1, 9], 26, 4, 8, 4, "entries already given back (-1) are not given back twice"),
    ([10, 11, 12, 13, 14, 15, 16, 17], 64, 8, 8, 1, "a window of one block: only the last block and the sinks stay"),
    ([5, 6, 7, 8], 13, 4, 40, 4, "a window longer than the sequence frees nothing"),
]


def _positions(i: int, bs: int) -> str:
    return f"block {i} (positions {i * bs}-{(i + 1) * bs - 1})"


def _as_indexes(got) -> list[int] | None:
    try:
        return sorted(int(i) for i in got)
    except (TypeError, ValueError):
        return None


def _hint(table, c, bs, w, s, got: list[int], want: list[int]) -> str | None:
    """Name the usual mistake when `got` is exactly what it gives."""
    def rule(end: int, first_block: int, skip_freed: bool = True) -> list[int]:
        return [i for i in range(max(first_block, 0), min(end, len(table)))
                if not (skip_freed and table[i] == NO_BLOCK)]

    seen = first_seen(c, w)
    ceil_s = -(-s // bs)
    if got == sorted(table[i] for i in want) and got != want:
        return "return logical indexes i (positions i * block_size ...), not the physical blocks block_table[i]"
    guesses = {
        "the next query is at position num_computed_tokens and sees sliding_window positions ending at itself: "
        "the first one is num_computed_tokens - sliding_window + 1, not num_computed_tokens - sliding_window":
            rule((c - w) // bs, ceil_s),
        "a block is out of sight when its LAST position, (i + 1) * block_size - 1, is before the window; its "
        "first position being before the window is not enough": rule(-(-seen // bs), ceil_s),
        "a block that holds any sink stays: the first block with no sink is ceil(sink_tokens / block_size), "
        "not sink_tokens // block_size": rule(seen // bs, s // bs),
        "sink_tokens counts tokens, not blocks: the first block with no sink is ceil(sink_tokens / block_size)":
            rule(seen // bs, s),
        "skip entries that are already -1: they were given back at an earlier step": rule(seen // bs, ceil_s, False),
    }
    for words, guess in guesses.items():
        if got == sorted(guess) and guess != want:
            return words
    return None


def _check_case(fn: Callable, table: list[int], c: int, bs: int, w: int, s: int, label: str) -> None:
    want = sorted(reference_rule(list(table), c, bs, w, s))
    given = list(table)
    try:
        raw = fn(given, c, bs, w, s)
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001  the learner's code failed: say where
        fail(label, "your function raised", f"{type(e).__name__}: {e}")
    if given != list(table):
        fail(label, "block_table changed", f"before {table}, after {given}",
             "only say which blocks may go; the block manager gives them back and writes the -1 entries")
    if raw is None:
        fail(label, "returned None", "expected a list of logical block indexes ([] when none may go)",
             "did the function forget to `return`?")
    got = _as_indexes(raw)
    if got is None:
        fail(label, f"returned {raw!r}", "expected a list of logical block indexes")
    if len(set(got)) != len(got):
        fail(label, f"returned {got}", "an index appears twice: each block goes back once")
    if got == want:
        return
    seen_from = first_seen(c, w)
    sees = f"the next query (position {c}) sees positions {max(seen_from, 0)}-{c}" + (
        f" and the sinks 0-{s - 1}" if s else "")
    unsafe = [i for i in got if i not in want]
    missed = [i for i in want if i not in got]
    lines = [f"expected {want}, got {got}", sees]
    for i in unsafe[:3]:
        if not 0 <= i < len(table):
            lines.append(f"index {i} is outside the table (it has {len(table)} entries)")
        elif table[i] == NO_BLOCK:
            lines.append(f"{_positions(i, bs)} was already given back (its entry is -1)")
        else:
            lines.append(f"{_positions(i, bs)} is still in sight: freeing it would let another request overwrite "
                         "keys this one still reads")
    for i in missed[:3]:
        lines.append(f"{_positions(i, bs)} holds no sink and no later query sees it: it may go")
    fail(label, "the blocks that may go back differ", "\n".join(lines), _hint(table, c, bs, w, s, got, want))


def check_window_rule(fn: Callable) -> None:
    """Stage 1: the taught cases, then random ones, against the engine's rule."""
    for k, (table, c, bs, w, s, lesson) in enumerate(CASES):
        label = (f"case {k} ({lesson}): block_table={table}, num_computed_tokens={c}, block_size={bs}, "
                 f"sliding_window={w}, sink_tokens={s}")
        _check_case(fn, table, c, bs, w, s, label)
    rng = random.Random(9)
    for k in range(300):
        bs = rng.choice([1, 2, 4, 8, 16])
        w = rng.randint(bs, 6 * bs)
        s = rng.randint(0, w)
        c = rng.randint(0, 12 * bs)
        table = [rng.randrange(100) for _ in range(-(-(c + 1) // bs))]
        for i in reference_rule(table, c, bs, w, s):  # an earlier step already gave some back
            if rng.random() < 0.4:
                table[i] = NO_BLOCK
        label = (f"random case {k}: block_table={table}, num_computed_tokens={c}, block_size={bs}, "
                 f"sliding_window={w}, sink_tokens={s}")
        _check_case(fn, table, c, bs, w, s, label)
    passed(len(CASES) + 300, "window_free_rule frees exactly the blocks no later query sees")


def _run(llm, prompts, params) -> tuple[list[list[int]], int, int]:
    outs = llm.generate(prompts, params)
    st = llm.stats()
    return [o.token_ids for o in outs], st["window_freed_blocks"], st["peak_used_blocks"]


def check_window_in_engine(llm, window_free_rule, prompts=None, max_tokens: int = 60) -> dict:
    """Stage 2: the engine asks your rule: `llm.derive(window_free_rule=window_free_rule)`, built here from
    `llm`'s weights and options each time the check runs (so a fixed rule is checked without rebuilding
    anything). A long generation, compared with the same engine on its own rule. Returns the stats of
    the engine on your rule."""
    from minikv.engine.sampling_params import SamplingParams

    if llm.engine_config.sliding_window is None:
        fail("check 2", "the engine has no sliding window",
             "build it with LLM(..., kv_backend='paged', sliding_window=W, sink_tokens=S)")
    llm = llm.derive(window_free_rule=window_free_rule)
    cfg = llm.engine_config
    prompts = prompts or [list(range(1, 30)), list(range(40, 52))]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    label = (f"check 2: {len(prompts)} requests, {max_tokens} tokens each, block_size {cfg.block_size}, "
             f"sliding_window {cfg.sliding_window}, sink_tokens {cfg.sink_tokens}, a pool of {cfg.num_blocks} blocks")
    try:
        mine = _run(llm, prompts, params)
    except NotImplementedError:
        raise
    except ValueError as e:  # the block manager refused an answer (a block still in sight, a bad index)
        fail(label, "the engine refused your answer", str(e))
    ref = _run(llm.derive(window_free_rule=None), prompts, params)
    if mine[0] != ref[0]:
        fail(label, "the tokens differ from the engine's own rule", f"expected {ref[0]}, got {mine[0]}")
    if mine[1:] != ref[1:]:
        fail(label, "the blocks differ", f"the engine's rule gave back {ref[1]} blocks and used at most {ref[2]} at "
             f"once; yours gave back {mine[1]} and used at most {mine[2]}",
             "a rule that frees too little is safe but holds more than it must: free every block out of sight")
    print(f"the engine with your rule: the same tokens, {mine[1]} blocks given back, at most {mine[2]} of "
          f"{cfg.num_blocks} blocks in use (without a window these requests need "
          f"{sum(-(-(len(p) + max_tokens) // cfg.block_size) for p in prompts)})")
    return llm.stats()
