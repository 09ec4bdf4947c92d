"""What the cache needs of a request, and where a request's tokens live in the paged pool.

    block_table = [7, 2, 9]     logical block i of the request lives in physical block block_table[i]
    block_size  = 4

    positions   0 1 2 3 | 4 5 6 7 | 8 9
    block           7   |    2    |  9 (2 of 4 slots used)
    slot        28 ... 31 | 8 ... 11 | 36 37     slot = block_table[p // block_size] * block_size + p % block_size

The cache never imports the engine. It asks a request for the few fields below (`CachedRequest`);
the engine's `Sequence` has them all, so it passes as one without naming this class.
"""
from __future__ import annotations

from collections.abc import Sequence as _AnySequence
from typing import Protocol

TokenIds = _AnySequence[int]  # token ids as a list or a tuple (the caches key on tuples)


class CachedRequest(Protocol):
    """The part of a request the block manager and the prefix caches read.

        [0, num_computed_tokens)            K/V already written in the blocks of block_table
        [num_computed_tokens, num_tokens)   still to run through the model

    `block_table` is the cache's own structure: the block manager appends to it, replaces entries
    (copy-on-write, a prefix hit) and empties it. Everything else is read, never written: what a
    request must record (how many tokens a prefix hit computed) comes back as a return value.
    """

    block_table: list[int]

    @property
    def seq_id(self) -> int:
        """Unique per request for its whole life (the prefix caches key their progress by it)."""
        ...

    @property
    def request_id(self) -> str:
        """The id error messages name."""
        ...

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def cache_salt(self) -> str | None:
        """Requests with different salts never share a cached block."""
        ...


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


def slot_mapping(block_table: list[int], positions: list[int], block_size: int) -> list[int]:
    """The slot (flat index into the pool's num_blocks * block_size token slots) of each position."""
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]
