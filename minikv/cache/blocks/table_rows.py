"""The batch's block tables as one int64 array, kept between steps and rewritten only where they changed.

A step's kernels read every sequence's block table as a row of one padded array. Building it from the
Python lists each step costs time in proportion to every block of every sequence (~70 per sequence
at 1,100 tokens of context): most of a decode step's host time to prepare the batch. Yet a decode
step changes few tables: a sequence gains a block once every block_size tokens. So each sequence
keeps a row of `array` while it runs, beside a private copy of the list the row was written from:

    array   [rows, width]   row r = the table of the sequence holding r, -1 past its end
    copies  [rows]          the list row r was written from (a shallow copy: the same int objects)

    gather(seqs):  for each sequence, `seq.block_table != copies[row]` (a C loop over pointers, the
                   ints are the same objects while nothing changed); only a changed table is written
                   again. Then array[rows of seqs, :widest] is the batch's table.

The check is on values, so the rows are right whoever changed a table and however (growing, a
copy-on-write, a prefix hit adopted, a window's holes, a speculative rollback, a fork, a fresh block
manager after a fault): nothing has to tell this class. A sequence that does not run in a step gives
its row up (it gets one again, written afresh, when it runs next). Rows are keyed by id(seq): a new
object that happens to get the id of a dead one finds that row, and the same check rewrites it.
"""
from __future__ import annotations

import numpy as np

from minikv.cache.blocks.window import NO_BLOCK


class BlockTableRows:
    def __init__(self, num_rows: int = 64, width: int = 16):
        self.array = np.full((num_rows, width), NO_BLOCK, dtype=np.int64)
        self.lens = np.zeros(num_rows, dtype=np.int64)  # entries written in each row
        self.copies: list[list[int] | None] = [None] * num_rows
        self.row_of: dict[int, int] = {}  # id(seq) -> its row (any object with a block_table)
        self.free_rows = list(range(num_rows - 1, -1, -1))
        self.num_writes = 0  # rows written (counted: the tests check that unchanged tables are not)

    def gather(self, seqs) -> np.ndarray:
        """The block tables of `seqs` as rows [len(seqs), longest table], -1 past each table's end."""
        row_of, copies, free = self.row_of, self.copies, self.free_rows
        rows = []
        for seq in seqs:
            r = row_of.get(id(seq))
            if r is None:
                if not free:
                    self._more_rows()  # copies and free grow in place
                r = row_of[id(seq)] = free.pop()
            table = seq.block_table
            if table != copies[r]:
                self._write(r, table)
            rows.append(r)
        if len(row_of) > len(rows):  # sequences that did not run: their rows go back
            ran = {id(seq) for seq in seqs}
            for key in [key for key in row_of if key not in ran]:
                free.append(row_of.pop(key))
        index = np.fromiter(rows, dtype=np.int64, count=len(rows))
        width = int(self.lens[index].max()) if rows else 0
        return self.array[index, :width]

    def _write(self, r: int, table: list[int]) -> None:
        n = len(table)
        if n > self.array.shape[1]:
            grown = np.full((self.array.shape[0], max(n, 2 * self.array.shape[1])), NO_BLOCK, dtype=np.int64)
            grown[:, :self.array.shape[1]] = self.array
            self.array = grown
        row = self.array[r]
        row[:n] = table
        row[n:self.lens[r]] = NO_BLOCK  # a shorter table than before: its old tail goes
        self.lens[r] = n
        self.copies[r] = list(table)
        self.num_writes += 1

    def _more_rows(self) -> None:
        n = self.array.shape[0]
        self.array = np.concatenate([self.array, np.full_like(self.array, NO_BLOCK)])
        self.lens = np.concatenate([self.lens, np.zeros(n, dtype=np.int64)])
        self.copies += [None] * n  # in place: gather holds these two lists
        self.free_rows.extend(range(2 * n - 1, n - 1, -1))
