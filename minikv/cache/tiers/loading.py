"""The block manager's loads from the store (rung 9): a hit that reads files loads beside the
engine's other work (the scheduler keeps the request in `loading`), holding everything it will use
until it is admitted or let go:

    start       [0, m) pool hit: ref_count + 1 (never evicted under the load)
                [m, m + loads) new blocks, written by nobody else (not cached yet)
    finish      one copy into [m, m + n), n <= loads (the hit ends at a failed read); the blocks
                join the cache and the request keeps them until admitted (`take`)
    forget      the request went away or was not admitted this step: its blocks go back (the
                loaded ones stay cached, a pool hit next time)

A hit on the CPU tier alone loads at admission, in one batch (`load_now`). The block manager owns
the tables and reference counts; this object owns the loads and asks the block manager to take,
trim and cache blocks.
"""
from __future__ import annotations

import weakref
from typing import Protocol

from minikv.cache.blocks.block_table import CachedRequest
from minikv.cache.prefix.base import PrefixCache, PrefixMatch
from minikv.cache.tiers.offload import Offload, PendingLoad


class TableOwner(Protocol):
    """What the loads need of the block manager that delegates to them (which they never import)."""
    block_size: int
    prefix_cache: PrefixCache | None

    def incref(self, block: int) -> None: ...
    def grow(self, seq: CachedRequest, num_tokens: int) -> None: ...
    def trim_table(self, seq: CachedRequest, num_blocks: int) -> None: ...
    def cache_blocks(self, seq: CachedRequest) -> None: ...
    def free(self, seq: CachedRequest) -> None: ...


class _Computed:
    """A request seen with another num_computed_tokens (the cache only reads it; the caller records it)."""

    def __init__(self, seq: CachedRequest, num_computed_tokens: int):
        self.seq, self.num_computed_tokens = seq, num_computed_tokens

    def __getattr__(self, name: str):
        return getattr(self.seq, name)


class TierLoads:
    """The loads of one block manager from its offload store, from `start` to admission (`take`)."""

    def __init__(self, bm: TableOwner, offload: Offload):
        self._owner, self.offload = weakref.ref(bm), offload  # weakly: the owner holds this, not the other way
        self.loads: dict[int, tuple[PrefixMatch, PendingLoad]] = {}  # seq_id -> its load in flight
        self.loaded: dict[int, tuple[PrefixMatch, dict]] = {}  # seq_id -> its loaded prefix, tokens per tier

    @property
    def bm(self) -> TableOwner:
        return self._owner()

    def held(self, seq: CachedRequest) -> PrefixMatch | None:
        """The prefix a finished load holds for `seq` until its admission, or None."""
        loaded = self.loaded.get(seq.seq_id)
        return loaded[0] if loaded is not None else None

    def start(self, seq: CachedRequest, hit: PrefixMatch) -> bool:
        """If the hit reads files: take its blocks and start the reads, and return True (the caller keeps
        the request waiting until `ready`). False: nothing to read (admit it as usual)."""
        bm = self.bm
        if not hit.loads or seq.block_table or not self.offload.reads_disk(hit.loads):
            return False
        m = len(hit.blocks)
        for b in hit.blocks:
            bm.incref(b)
        seq.block_table = list(hit.blocks)
        bm.grow(seq, (m + len(hit.loads)) * bm.block_size)
        self.loads[seq.seq_id] = (hit, self.offload.start_load(hit.loads, seq.block_table[m:]))
        return True

    def ready(self, seq: CachedRequest) -> bool:
        return self.loads[seq.seq_id][1].ready

    def wait(self, seq: CachedRequest) -> None:
        self.offload.wait(self.loads[seq.seq_id][1])

    def finish(self, seq: CachedRequest) -> None:
        """The reads are done: one copy into the pool, the blocks join the cache, and the request holds
        them for its admission (`held` / `take` give them back as its hit)."""
        bm = self.bm
        hit, pending = self.loads.pop(seq.seq_id)
        n, tier_tokens = self.offload.finish_load(pending)
        m = len(hit.blocks)
        bm.trim_table(seq, m + n)
        if not bm.prefix_cache.enabled:  # a reset is pending: nothing loaded before it may be used
            bm.free(seq)
            return
        bm.cache_blocks(_Computed(seq, (m + n) * bm.block_size))
        self.loaded[seq.seq_id] = (PrefixMatch(list(seq.block_table), (m + n) * bm.block_size), tier_tokens)

    def take(self, seq: CachedRequest) -> PrefixMatch | None:
        """Admission of a request whose load finished: its hit (the blocks it holds already), counted
        as hits of the tiers it came from; None if no finished load holds blocks for it."""
        if seq.seq_id not in self.loaded:
            return None
        hit, tier_tokens = self.loaded.pop(seq.seq_id)
        self.offload.count_hits(tier_tokens)
        return hit

    def load_now(self, seq: CachedRequest, hit: PrefixMatch) -> PrefixMatch:
        """Copy the hit's stored blocks back into new blocks of `seq` (one batch, waiting for any read)
        and cache them. The prefix ends at the first block the store cannot give (a corrupted file,
        say): its block goes back."""
        bm = self.bm
        m, bs = len(hit.blocks), bm.block_size
        bm.grow(seq, (m + len(hit.loads)) * bs)
        n = self.offload.load(hit.loads, seq.block_table[m:])
        bm.trim_table(seq, m + n)
        bm.cache_blocks(_Computed(seq, (m + n) * bs))  # [0, m + n) blocks hold their K/V now
        return PrefixMatch(list(hit.blocks), (m + n) * bs)

    def forget(self, seq: CachedRequest) -> None:
        """`seq` went away (or gave its blocks back): its write-through, its load in flight and its
        loaded prefix are let go (the block manager gives back the blocks)."""
        self.offload.forget(seq)
        load = self.loads.pop(seq.seq_id, None)
        if load is not None:
            self.offload.cancel(load[1])
        self.loaded.pop(seq.seq_id, None)
