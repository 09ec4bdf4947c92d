"""The scheduling seam (rung 5, exercise 05a): a function decides which sequences run this step.

    schedule_step(running, waiting, budget, max_num_seqs, free_blocks, block_size)
        -> [(request_id, num_tokens), ...]        in batch order; a pair with 0 tokens is skipped

    running   list[SeqInfo], oldest first        budget        max_num_batched_tokens
    waiting   list[SeqInfo], first come first    free_blocks   blocks free in the pool now

`Scheduler(..., schedule_step=fn)` asks it every step in place of its own policy. Its answer is
checked here against the limits the built-in policy keeps (known requests, tokens left to run,
the token budget, the seats, the free blocks) before the scheduler applies it: a wrong answer is a
ValueError that names the limit, never a batch the engine cannot run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from minikv.cache.block_manager import BlockManager
from minikv.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SeqInfo:
    """What the scheduler knows about a sequence when it decides a step.

    [0, num_computed_tokens)           K/V already in its blocks
    [num_computed_tokens, num_tokens)  still to run (a prompt, a chunk's rest, or 1 token to decode)
    num_blocks                         blocks it holds now (ceil(num_computed_tokens / block_size))
    """

    request_id: str
    num_tokens: int
    num_computed_tokens: int = 0
    num_blocks: int = 0

    @classmethod
    def of(cls, seq: Sequence) -> "SeqInfo":
        return cls(seq.request_id, seq.num_tokens, seq.num_computed_tokens, len(seq.block_table))


ScheduleStep = Callable[[list[SeqInfo], list[SeqInfo], int, int, int, int], list[tuple[str, int]]]


def checked_decision(schedule_step: ScheduleStep, running: list[Sequence], waiting: list[Sequence], budget: int,
                     max_num_seqs: int, bm: BlockManager, when: str = "") -> list[tuple[Sequence, int]]:
    """Ask `schedule_step` about this state; return its answer as (sequence, tokens) pairs in its order,
    or raise a ValueError that names the broken limit. Changes nothing."""
    free, bs = bm.num_free_blocks, bm.block_size
    raw = schedule_step([SeqInfo.of(s) for s in running], [SeqInfo.of(s) for s in waiting], budget, max_num_seqs,
                        free, bs)
    name = f"{getattr(schedule_step, '__name__', 'schedule_step')}{' ' + when if when else ''}"
    if raw is None:
        raise ValueError(f"{name} returned None; return a list of (request_id, num_tokens) pairs "
                         "(did it forget to `return`?)")
    try:
        pairs = [(str(rid), int(n)) for rid, n in raw]
    except (TypeError, ValueError):
        raise ValueError(f"{name} returned {raw!r}; expected a list of (request_id, num_tokens) pairs") from None
    by_id = {s.request_id: s for s in list(running) + list(waiting)}
    chosen: list[tuple[Sequence, int]] = []
    seats, left_budget = max_num_seqs - len(running), budget
    for rid, n in pairs:
        if n == 0:
            continue
        seq = by_id.get(rid)
        if seq is None:
            raise ValueError(f"{name} chose request {rid!r}, which is neither running "
                             f"{[s.request_id for s in running]} nor waiting {[s.request_id for s in waiting]}")
        if any(s is seq for s, _ in chosen):
            raise ValueError(f"{name} chose request {rid!r} twice; each sequence appears once per step")
        left = seq.num_tokens - seq.num_computed_tokens
        if not 0 < n <= left:
            raise ValueError(f"{name} gave request {rid!r} {n} tokens, but it has {left} left to run "
                             f"(num_tokens {seq.num_tokens} - num_computed_tokens {seq.num_computed_tokens})")
        left_budget -= n
        if left_budget < 0:
            raise ValueError(f"{name} runs more than the budget of {budget} tokens (max_num_batched_tokens): "
                             f"request {rid!r} goes {-left_budget} over; give it min(remaining, budget left)")
        if seq.status == SequenceStatus.WAITING:
            seats -= 1
            if seats < 0:
                raise ValueError(f"{name} admits request {rid!r} but all max_num_seqs = {max_num_seqs} seats are "
                                 "taken; admit only while running + admitted < max_num_seqs")
        elif seq.status != SequenceStatus.RUNNING:
            raise ValueError(f"{name} chose request {rid!r}, which is {seq.status.value}")
        free -= bm.num_new_blocks(seq, seq.num_computed_tokens + n)
        if free < 0:
            raise ValueError(f"{name} gives request {rid!r} {n} tokens, but the blocks that needs are not free "
                             f"({bm.num_free_blocks} free at the start of the step, block_size {bs}); a sequence "
                             "takes ceil((num_computed_tokens + n) / block_size) - num_blocks new blocks: stop "
                             "admitting when they do not fit")
        chosen.append((seq, n))
    return chosen
