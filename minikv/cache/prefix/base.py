"""Rung 6: prefix caching. What a prefix cache must do, whatever its data structure.

Many requests start with the same tokens (a system prompt, a few-shot preamble, the earlier turns of
a chat). Their K/V are the same, so a block computed once can serve every later request:

    request 2:  [ system prompt ........ | its question ]
                [0, num_cached_tokens)     blocks found in the prefix cache: no compute
                [num_cached_tokens, len)   computed this time, then offered to the cache

Two designs implement this interface side by side:

    HashChainCache (vLLM)   a flat table  key(block) -> physical block, where
                            key(block i) = hash(key(block i-1), tokens of block i, extra keys)
    RadixCache (SGLang)     a tree whose edges hold token runs; a lookup walks it from the root

(`make_prefix_cache` in registry.py builds either by name.)

Rules both keep:
  * only FULL blocks are cached: a block is immutable once its last slot is written
  * a cached block keeps its K/V after its last user leaves; it is "unused" (ref_count 0) and
    evictable, and only evicted when no empty block is left (the policy picks which: LRU or FIFO)
  * a hit on an unused block takes it back (ref_count 0 -> 1): no copy, no compute
  * at least one prompt token is always computed: its logits give the first output token
  * requests with different `cache_salt` never share a block (multi-tenant isolation)

The BlockManager owns reference counts; the cache reads them (`bind`) to tell used from unused.
Free blocks sit in two places: empty ones in the block allocator, unused cached ones here
(`CachingAllocator` in blocks/allocator.py joins the two).
"""
from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Hashable, Iterable

from minikv.cache.blocks.block_table import CachedRequest, TokenIds

EVICTION_POLICIES = ("lru", "fifo")


@dataclass
class PrefixMatch:
    """The longest cached prefix of a token list, in whole blocks."""

    blocks: list[int] = field(default_factory=list)  # physical blocks holding tokens [0, len(blocks) * block_size)
    num_tokens: int = 0  # (len(blocks) + len(loads)) * block_size
    loads: list[bytes] = field(default_factory=list)  # store keys of the blocks after them, to copy back (rung 9)


class EvictionQueue:
    """Evictable items, the one to evict first on top. A heap with lazy deletion.

    The policy sets the priority: "lru" pushes an item with the time it was last used, "fifo" with
    the time it entered the cache. Pushing an item again replaces its old entry.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Hashable]] = []
        self._live: dict[Hashable, tuple[int, int, Hashable]] = {}
        self._count = itertools.count()

    def push(self, item: Hashable, priority: int) -> None:
        entry = (priority, next(self._count), item)
        self._live[item] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._live) + 64:  # drop stale entries now and then
            self._heap = sorted(self._live.values())

    def discard(self, item: Hashable) -> None:
        self._live.pop(item, None)

    def pop(self) -> Hashable:
        while self._heap:
            entry = heapq.heappop(self._heap)
            if self._live.get(entry[2]) is entry:
                del self._live[entry[2]]
                return entry[2]
        raise IndexError("nothing to evict")

    def priority(self, item: Hashable) -> int:
        return self._live[item][0]

    def ordered(self) -> list[Hashable]:
        """Items in eviction order (first = next to go)."""
        return [e[2] for e in sorted(self._live.values())]

    def __contains__(self, item: Hashable) -> bool:
        return item in self._live

    def __len__(self) -> int:
        return len(self._live)


class PrefixCache(ABC):
    """The seam between the BlockManager and a prefix-cache design."""

    design = "?"

    def __init__(self, block_size: int, eviction: str = "lru"):
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {', '.join(EVICTION_POLICIES)}, got {eviction!r}")
        self.block_size = block_size
        self.eviction = eviction
        self.ref_count: list[int] = []  # the BlockManager's, set by bind()
        self.pinned: dict[int, int] = {}  # block -> how many pinned prefixes cover it
        self._pins: dict[tuple, list[int]] = {}  # (salt, token ids) given to pin() -> blocks it pinned
        self.enabled = True  # False while a reset waits for running requests to drain
        self.clock = 0  # logical time: LRU and FIFO order, deterministic
        self.queries = self.hits = 0  # tokens looked up / tokens served from the cache
        self.num_evicted = self.num_resets = 0
        self.on_evict = None  # fn([(block, key)]) told before evicted blocks are reused (offload tiers)

    def bind(self, ref_count: list[int]) -> None:
        self.ref_count = ref_count

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def is_unused(self, block: int) -> bool:
        return self.ref_count[block] == 0 and block not in self.pinned

    # ---- lookup ---------------------------------------------------------------------------------
    @abstractmethod
    def match(self, token_ids: TokenIds, salt: str | None = None, max_tokens: int | None = None) -> PrefixMatch:
        """Longest cached prefix of token_ids[:max_tokens] in whole blocks. No side effects."""

    def lookup(self, seq: CachedRequest) -> PrefixMatch:
        """What a sequence about to be prefilled can reuse: everything but its last token."""
        if not self.enabled:
            return PrefixMatch()
        return self.match(seq.token_ids, seq.cache_salt, seq.num_tokens - 1)

    def record(self, seq: CachedRequest, hit: PrefixMatch) -> None:
        """A sequence was admitted with `hit` (possibly empty): count it, refresh LRU times."""
        self.queries += seq.num_tokens
        self.hits += hit.num_tokens
        if hit.blocks:
            self.touch(hit.blocks)

    @abstractmethod
    def touch(self, blocks: list[int]) -> None:
        """These cached blocks were just used (LRU time)."""

    # ---- filling --------------------------------------------------------------------------------
    @abstractmethod
    def insert(self, seq: CachedRequest) -> dict[int, int]:
        """Offer the sequence's full computed blocks. Returns {index: block} for each of its blocks
        whose content the cache already holds in another block: the sequence should use that one."""

    @abstractmethod
    def forget(self, seq: CachedRequest) -> None:
        """The sequence let go of its blocks (finished, preempted, aborted): drop its progress."""

    # ---- unused blocks --------------------------------------------------------------------------
    @abstractmethod
    def holds(self, block: int) -> bool:
        """Is this block's content in the cache?"""

    @abstractmethod
    def keep(self, block: int) -> bool:
        """The block's last user left. True: the cache keeps it (unused, evictable unless pinned);
        False: not a cached block, the allocator takes it back empty."""

    @abstractmethod
    def take(self, block: int) -> None:
        """An unused cached block is used again (a hit): it is no longer evictable."""

    @property
    @abstractmethod
    def num_evictable(self) -> int:
        """Unused, unpinned cached blocks: free blocks that still hold reusable K/V."""

    @abstractmethod
    def evict(self, num_blocks: int) -> list[int]:
        """Forget up to `num_blocks` unused blocks, in policy order, and return them (now empty)."""

    @abstractmethod
    def cached_blocks(self) -> list[int]:
        """Every block the cache holds, used or not."""

    # ---- control --------------------------------------------------------------------------------
    def pin(self, token_ids: TokenIds, salt: str | None = None) -> int:
        """Never evict the cached blocks of this prefix (the whole path from the first block, so
        what stays is always reachable). Returns the number of tokens pinned."""
        key = (salt, tuple(token_ids))
        if key not in self._pins:
            self._pins[key] = self.match(token_ids, salt).blocks
            for b in self._pins[key]:
                self.pinned[b] = self.pinned.get(b, 0) + 1
                if self.pinned[b] == 1:
                    self._on_pin(b)
        return len(self._pins[key]) * self.block_size

    def unpin(self, token_ids: TokenIds, salt: str | None = None) -> int:
        """Undo `pin` of the same tokens and salt (blocks other pins cover stay pinned)."""
        blocks = self._pins.pop((salt, tuple(token_ids)), [])
        for b in blocks:
            self.pinned[b] -= 1
            if self.pinned[b] == 0:
                del self.pinned[b]
                self._on_unpin(b)
        return len(blocks) * self.block_size

    @abstractmethod
    def _on_pin(self, block: int) -> None: ...

    @abstractmethod
    def _on_unpin(self, block: int) -> None: ...

    def blocks_in_use(self) -> list[int]:
        return [b for b in self.cached_blocks() if self.ref_count[b] > 0]

    def clear(self) -> list[int]:
        """Forget everything (no block may be in use). Returns the blocks to hand back empty."""
        busy = self.blocks_in_use()
        if busy:
            raise RuntimeError(f"{len(busy)} cached blocks are still in use; cannot clear the prefix cache")
        blocks = self.cached_blocks()
        self.pinned.clear()
        self._pins.clear()
        self._clear()
        self.enabled = True
        self.num_resets += 1
        self.queries = self.hits = self.num_evicted = 0  # the figures describe the cache since its last reset
        return blocks

    @abstractmethod
    def _clear(self) -> None: ...

    # ---- reporting ------------------------------------------------------------------------------
    def stats(self) -> dict:
        cached = self.cached_blocks()
        return {
            "design": self.design, "eviction": self.eviction,
            "queries": self.queries, "hits": self.hits,
            "hit_rate": self.hits / self.queries if self.queries else 0.0,
            "cached_blocks": len(cached), "evictable_blocks": self.num_evictable,
            "pinned_blocks": len(self.pinned), "evicted_blocks": self.num_evicted, "resets": self.num_resets,
        }

    def check(self, seqs: Iterable[CachedRequest] = ()) -> None:
        """Invariants of the design (see each implementation); AssertionError names the first broken."""
        cached = set(self.cached_blocks())
        if not set(self.pinned) <= cached:
            raise AssertionError(f"pinned blocks {sorted(set(self.pinned) - cached)} are not in the cache")
        unused = sum(1 for b in cached if self.is_unused(b))
        if unused != self.num_evictable:
            raise AssertionError(f"{unused} unused unpinned cached blocks but num_evictable says {self.num_evictable}")
        for s in seqs:
            for b in s.block_table:
                if b in cached and self.salt_of(b) != s.cache_salt:
                    raise AssertionError(f"request {s.request_id} (cache_salt {s.cache_salt!r}) holds block {b} "
                                         f"cached for cache_salt {self.salt_of(b)!r}")

    @abstractmethod
    def salt_of(self, block: int) -> str | None:
        """The cache_salt of the request that cached this block."""

