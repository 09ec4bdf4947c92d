"""Who owns which physical block: the smallest seam of the paged cache.

A block allocator hands out free block ids and takes them back. The BlockManager builds reference
counts and block tables on top of it, so an allocator only needs three things. Plug your own in
with `LLM(..., kv_backend="paged", block_allocator=MyAllocator)`: it is called as
`MyAllocator(num_blocks)`.
"""
from __future__ import annotations

from collections import deque
from typing import Protocol


class NoFreeBlocksError(RuntimeError):
    """Raised by `allocate` when every block is in use."""


class BlockAllocator(Protocol):
    num_blocks: int

    def allocate(self) -> int:
        """Return a free block id in [0, num_blocks); raise NoFreeBlocksError if there is none."""
        ...

    def free(self, block_id: int) -> None:
        """Give a block back. Freeing a block that is already free is a bug: raise."""
        ...

    @property
    def num_free_blocks(self) -> int: ...


class FreeListAllocator:
    """A FIFO free list: O(1) allocate and free, freed blocks reused last."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = deque(range(num_blocks))
        self._is_free = [True] * num_blocks

    def allocate(self) -> int:
        if not self._free:
            raise NoFreeBlocksError(f"all {self.num_blocks} blocks are in use")
        block = self._free.popleft()
        self._is_free[block] = False
        return block

    def free(self, block_id: int) -> None:
        if self._is_free[block_id]:
            raise RuntimeError(f"block {block_id} freed twice")
        self._is_free[block_id] = True
        self._free.append(block_id)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)


class EvictableBlocks(Protocol):
    """What `CachingAllocator` needs from a prefix cache (see minikv/cache/prefix/base.py)."""

    @property
    def num_evictable(self) -> int: ...

    def keep(self, block_id: int) -> bool: ...

    def take(self, block_id: int) -> None: ...

    def evict(self, num_blocks: int) -> list[int]: ...


class CachingAllocator:
    """The free pool once a prefix cache is on. Free blocks come in two kinds:

        empty    in the inner allocator; handed out first
        cached   unused, but their K/V may still serve a hit; evicted (policy order) only when no
                 empty block is left, and taken back by a hit without any copy

    free() asks the cache whether to keep the block's content; allocate() evicts when it must.
    """

    def __init__(self, inner: BlockAllocator, cache: EvictableBlocks):
        self.inner, self.cache = inner, cache
        self.num_blocks = inner.num_blocks

    def allocate(self) -> int:
        if self.inner.num_free_blocks == 0:
            for block in self.cache.evict(1):
                self.inner.free(block)
        return self.inner.allocate()

    def free(self, block_id: int) -> None:
        if not self.cache.keep(block_id):
            self.inner.free(block_id)

    def take(self, block_id: int) -> None:
        """A hit on an unused cached block: it leaves the free pool with its content."""
        self.cache.take(block_id)

    @property
    def num_free_blocks(self) -> int:
        return self.inner.num_free_blocks + self.cache.num_evictable
