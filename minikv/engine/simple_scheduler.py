"""The scheduler of rungs 1 and 2: first come, first served, at most `max_num_seqs` at once.

naive:       every step feeds each running sequence's WHOLE token list again (no cache)
contiguous:  a sequence gets a preallocated cache row when admitted; its first step is the
             prefill (the whole prompt), every later step one decode token; the row is freed when
             it finishes and the next waiting request takes it.
"""
from __future__ import annotations

from collections import deque

from minikv.cache.blocks.pool import RowPool
from minikv.engine.batch import ScheduledBatch
from minikv.engine.sequence import Sequence, SequenceStatus


class SimpleScheduler:
    def __init__(self, rows: RowPool | None, max_num_seqs: int):
        """rows: the contiguous cache rows (minikv/cache/blocks/pool.py), None for rung 1 (no cache)."""
        self.rows = rows
        self.cached = rows is not None
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting.popleft()
            if self.cached:
                seq.cache_row = self.rows.allocate_row()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        batch = ScheduledBatch()
        for seq in self.running:
            start = seq.num_computed_tokens if self.cached else 0
            batch.add(seq, start, seq.num_tokens - start)
        return batch

    def update(self, batch: ScheduledBatch) -> None:
        """Called after the model ran `batch` and new tokens were appended."""
        for seq, start, n in zip(batch.seqs, batch.starts, batch.num_new_tokens):
            seq.num_computed_tokens = start + n if self.cached else 0
        for seq in [s for s in self.running if s.is_finished]:
            self.finish(seq)

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        if self.cached and seq.cache_row is not None:
            self.rows.free_row(seq.cache_row)
            seq.cache_row = None

    def abort(self, seq: Sequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.finish(seq)

    def all_sequences(self) -> list[Sequence]:
        return list(self.waiting) + self.running

    def restart(self, seqs: list[Sequence]) -> None:
        """Start over after a fault: every row free, these sequences waiting to be computed again from
        their tokens (prompt and output so far), in the order given."""
        if self.cached:
            self.rows.reset()
        for seq in seqs:
            seq.cache_row = None
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
        self.running = []
        self.waiting = deque(seqs)
