"""Block tables and reference counts over a block allocator (rung 4).

    seq.block_table = [7, 2, 9]   logical block i of the sequence lives in physical block table[i]
    ref_count[b]    = number of block tables that contain b (forks and prefix hits share blocks)

A sequence holding `n` tokens needs ceil(n / block_size) blocks. Blocks are taken on demand, one
at a time as the sequence grows, and given back when it finishes, is preempted or aborted.

Copy-on-write: `fork` lets a child share all of its parent's blocks. A shared block is read-only;
before a step writes into one, `copy_on_write` gives the writer a private copy (the model runner
copies the K/V of `(src, dst)` on the device) and drops its reference to the shared one:

    parent [0 1 2]  child [0 1 2]      block 2 = positions 8-9 of 10, ref_count 2
    parent writes position 10  ->  parent [0 1 5] (5 = copy of 2), child [0 1 2], both ref 1
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from minikv.cache.allocator import BlockAllocator, FreeListAllocator, NoFreeBlocksError

if TYPE_CHECKING:
    from minikv.engine.sequence import Sequence


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, allocator: BlockAllocator | None = None):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.allocator = allocator if allocator is not None else FreeListAllocator(num_blocks)
        self.ref_count = [0] * num_blocks
        # sharing figures: num_refs = sum(ref_count) = blocks the same tables would need without sharing
        self.num_refs = 0
        self.reset_sharing_stats()

    def reset_sharing_stats(self) -> None:
        """Restart the fork / copy counters and the peaks from the current state."""
        self.num_forks = self.num_cow_copies = 0
        self.peak_used_blocks, self.peak_refs = self.num_used_blocks, self.num_refs

    def _track_peaks(self) -> None:
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)
        self.peak_refs = max(self.peak_refs, self.num_refs)

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must still get to hold `num_tokens` tokens."""
        return max(0, blocks_needed(num_tokens, self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Room for the new blocks AND for the private copies of shared blocks the step writes into."""
        need = self.num_new_blocks(seq, num_tokens) + len(self.shared_blocks_to_write(seq, num_tokens))
        return need <= self.num_free_blocks

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Append blocks to seq.block_table until it can hold `num_tokens` tokens."""
        need = self.num_new_blocks(seq, num_tokens)
        if need > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {need} blocks, {self.num_free_blocks} free")
        for _ in range(need):
            block = self.allocator.allocate()
            if self.ref_count[block] != 0:
                raise RuntimeError(f"allocator returned block {block}, which is still in use")
            self.ref_count[block] = 1
            self.num_refs += 1
            seq.block_table.append(block)
        self._track_peaks()

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references, tail first; blocks nobody references go back."""
        for block in reversed(seq.block_table):
            self.decref(block)
        seq.block_table = []

    def incref(self, block: int) -> None:
        if self.ref_count[block] < 1:
            raise RuntimeError(f"block {block} is free; cannot share it")
        self.ref_count[block] += 1
        self.num_refs += 1

    def decref(self, block: int) -> None:
        if self.ref_count[block] < 1:
            raise RuntimeError(f"block {block} freed twice")
        self.ref_count[block] -= 1
        self.num_refs -= 1
        if self.ref_count[block] == 0:
            self.allocator.free(block)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (copy-on-write happens on the next write)."""
        for block in parent.block_table:
            self.incref(block)
        child.block_table = list(parent.block_table)
        self.num_forks += 1
        self._track_peaks()

    def shared_blocks_to_write(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Logical indexes of the blocks that writing positions [num_computed_tokens, num_tokens) touches
        while another block table still holds them (ref_count > 1)."""
        first = seq.num_computed_tokens // self.block_size
        last = min(len(seq.block_table), blocks_needed(num_tokens, self.block_size))
        return [i for i in range(first, last) if self.ref_count[seq.block_table[i]] > 1]

    def copy_on_write(self, seq: Sequence, num_tokens: int) -> list[tuple[int, int]]:
        """Before a step writes positions [seq.num_computed_tokens, num_tokens): swap every shared block
        it writes into for a private copy. Returns the (src, dst) pairs whose K/V must be copied (all
        layers) before the forward. The last owner of a block writes in place: its ref_count is 1."""
        copies = []
        for i in self.shared_blocks_to_write(seq, num_tokens):
            src, dst = seq.block_table[i], self.allocator.allocate()
            if self.ref_count[dst] != 0:
                raise RuntimeError(f"allocator returned block {dst}, which is still in use")
            self.ref_count[dst] = 1
            self.num_refs += 1
            seq.block_table[i] = dst
            self.decref(src)  # others still hold src: it stays allocated
            copies.append((src, dst))
        self.num_cow_copies += len(copies)
        self._track_peaks()
        return copies

    def check(self, seqs: list[Sequence]) -> None:
        """Invariants: refcounts equal block-table membership; used + free == total."""
        counts = [0] * self.num_blocks
        for s in seqs:
            for b in s.block_table:
                counts[b] += 1
        if counts != self.ref_count:
            bad = next(i for i, (a, b) in enumerate(zip(counts, self.ref_count)) if a != b)
            raise AssertionError(f"block {bad}: in {counts[bad]} block tables but ref_count {self.ref_count[bad]}")
        if self.num_refs != sum(counts):
            raise AssertionError(f"num_refs is {self.num_refs} but block tables hold {sum(counts)} entries; "
                                 "change ref_count only through grow / incref / decref / copy_on_write")
        in_use = sum(1 for c in counts if c)
        if in_use + self.num_free_blocks != self.num_blocks:
            raise AssertionError(f"{in_use} blocks in use + {self.num_free_blocks} free != {self.num_blocks}")
