"""Rung 8: a sliding window with sink tokens gives blocks back while a request runs (StreamingLLM).

With a window of W tokens and S sink tokens, the query at position p sees

    [0, S)         the sinks: the first tokens, which soak up attention whatever the text
    (p - W, p]     its window: the last W positions, itself included

Queries only move forward, so once the next query is at position c = num_computed_tokens, a key
before c - W + 1 that is not a sink is never seen again. A block wholly in that dead range goes
back to the pool; its entry in the block table becomes NO_BLOCK (-1), so the table keeps its shape
(position p still lives in block_table[p // block_size]) and the kernels never read it:

    block_size 4, W = 6, S = 2, c = 17 (the next query, at position 17, sees 0-1 and 12-17)
    positions  0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 14 15 | 16 .
    table        [ 7   ,    3    ,     9     ,      2      ,  5  ]
    after        [ 7   ,   -1    ,    -1     ,      2      ,  5  ]   block 0 holds sinks: kept

A sequence then holds at most ceil(S / block_size) + ceil((W - 1 + chunk) / block_size) + 1
blocks, whatever its length (chunk: the tokens a step adds). `window_free_rule` is the engine's
rule on plain lists; exercise 09b's version plugs in with `LLM(..., window_free_rule=fn)`, and
`checked_frees` refuses an answer that would free a block some later query still sees.
"""
from __future__ import annotations

from typing import Callable

NO_BLOCK = -1  # a block table entry whose block was given back (outside every window)

# window_free_rule(block_table, num_computed_tokens, block_size, sliding_window, sink_tokens) -> [logical index]
WindowFreeRule = Callable[[list[int], int, int, int, int], list[int]]


def first_seen(num_computed_tokens: int, sliding_window: int) -> int:
    """The earliest non-sink position any later query sees: the next query is at num_computed_tokens."""
    return num_computed_tokens - sliding_window + 1


def window_free_rule(block_table: list[int], num_computed_tokens: int, block_size: int, sliding_window: int,
                     sink_tokens: int) -> list[int]:
    """Logical indexes of the blocks that may go back now: still held (not NO_BLOCK), holding no sink,
    and ending before the window of the next query.

        block i holds [i * block_size, (i + 1) * block_size)
        no sink       i * block_size >= sink_tokens
        dead          (i + 1) * block_size <= num_computed_tokens - sliding_window + 1
    """
    first = -(-sink_tokens // block_size)  # the first block with no sink in it
    end = first_seen(num_computed_tokens, sliding_window) // block_size  # blocks [0, end) end before it
    return [i for i in range(first, min(end, len(block_table))) if block_table[i] != NO_BLOCK]


def checked_frees(rule: WindowFreeRule, block_table: list[int], num_computed_tokens: int, block_size: int,
                  sliding_window: int, sink_tokens: int, request_id: str = "?") -> list[int]:
    """Ask `rule` which blocks to free; return its answer as sorted logical indexes, or raise a
    ValueError naming the fault. A block some later query still sees is never given back: the
    kernels would read a block that another request may own by then."""
    name = getattr(rule, "__name__", "window_free_rule")
    raw = rule(list(block_table), num_computed_tokens, block_size, sliding_window, sink_tokens)
    where = (f"{name} for request {request_id} (block_table {block_table}, num_computed_tokens "
             f"{num_computed_tokens}, block_size {block_size}, sliding_window {sliding_window}, "
             f"sink_tokens {sink_tokens})")
    if raw is None:
        raise ValueError(f"{where} returned None; return the list of logical block indexes to free, [] for none "
                         "(did it forget to `return`?)")
    try:
        idx = [int(i) for i in raw]
    except (TypeError, ValueError):
        raise ValueError(f"{where} returned {raw!r}; expected a list of logical block indexes") from None
    if len(set(idx)) != len(idx):
        raise ValueError(f"{where} returned {idx}: an index appears twice; free each block once")
    seen_from = first_seen(num_computed_tokens, sliding_window)
    for i in idx:
        if not 0 <= i < len(block_table):
            raise ValueError(f"{where} returned index {i}; the table has {len(block_table)} entries "
                             "(return logical indexes i, not the physical block ids block_table[i])")
        if block_table[i] == NO_BLOCK:
            raise ValueError(f"{where} returned index {i}, whose block was given back already (entry -1)")
        lo, hi = i * block_size, (i + 1) * block_size
        if lo < sink_tokens or hi > seen_from:
            sinks = f" and the sinks 0-{sink_tokens - 1}" if sink_tokens else ""
            raise ValueError(
                f"{where} frees block {i} (positions {lo}-{hi - 1}), but the next query (position "
                f"{num_computed_tokens}) still sees positions {max(seen_from, 0)}-{num_computed_tokens}{sinks}: "
                "free a block only when it holds no sink and ends before the window")
    return sorted(idx)
