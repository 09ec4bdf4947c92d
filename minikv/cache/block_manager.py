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

The rule is `copy_on_write_rule`, on plain lists; exercise 07a's version plugs in in its place with
`BlockManager(..., copy_on_write=fn)` (or `LLM(..., kv_backend="paged", copy_on_write=fn)`), and
the block manager still counts the copies and checks what comes back.

Prefix caching (rung 6, `attach_prefix_cache`): a block whose ref_count drops to 0 may keep its
K/V in the prefix cache (unused, evictable) instead of going back empty; an admitted sequence first
takes the blocks of its cached prefix (`acquire_prefix`), and its newly full blocks join the cache
after each step (`cache_blocks`). Cached blocks are never written: writes start past the prefix.

Sliding window (rung 8, `sliding_window=W, sink_tokens=S`): after each step, the blocks no later
query can see go back (`free_outside_window`, rule in minikv/cache/blocks/window.py); their table entries
become NO_BLOCK (-1), so a table keeps its shape and a long sequence holds a bounded number of
blocks. Every loop over a table skips NO_BLOCK. A given-back block that the prefix cache holds stays
there, unused and evictable: its K/V still belong to its prefix (the hash chain's rule; the radix
tree, which evicts leaves only, is refused with a window by the engine's configuration).

Offload tiers (rung 9, `attach_offload`): a lookup continues past the pool's hit into a store of
evicted blocks (CPU memory, disk); those blocks are copied back into free blocks and count as
cached. Evicted blocks go down to the store, newly cached ones are written through. A hit that
reads files loads beside the engine's other work (`start_load` ... `finish_load`; the scheduler keeps
the request in `loading`): the block manager hands that lifecycle to `TierLoads`
(minikv/cache/tiers/loading.py), which holds the loads and asks it to take, trim and cache blocks.
"""
from __future__ import annotations

from typing import Callable

from minikv.cache.blocks.allocator import BlockAllocator, CachingAllocator, FreeListAllocator, NoFreeBlocksError
from minikv.cache.blocks.block_table import CachedRequest, blocks_needed
from minikv.cache.blocks.window import NO_BLOCK, WindowFreeRule, checked_frees, window_free_rule
from minikv.cache.prefix.base import PrefixCache, PrefixMatch
from minikv.cache.tiers.loading import TierLoads
from minikv.cache.tiers.offload import Offload

# copy_on_write(block_table, ref_count, num_computed_tokens, num_tokens, block_size, allocate) -> [(src, dst)]
CopyOnWrite = Callable[[list[int], list[int], int, int, int, Callable[[], int]], list[tuple[int, int]]]


def copy_on_write_rule(block_table: list[int], ref_count: list[int], num_computed_tokens: int, num_tokens: int,
                       block_size: int, allocate: Callable[[], int]) -> list[tuple[int, int]]:
    """The engine's copy-on-write rule on plain lists (what `BlockManager(copy_on_write=...)` replaces).

    The step writes positions [num_computed_tokens, num_tokens); block_table already covers them.
    Every block they fall in that another table still holds (ref_count > 1) is swapped, in place in
    block_table, for a fresh block from allocate() (ref_count 1); the shared one loses this holder.
    Returns the (src, dst) pairs whose K/V the runner copies before the forward."""
    copies = []
    first, last = num_computed_tokens // block_size, min(len(block_table), blocks_needed(num_tokens, block_size))
    for i in range(first, last):
        src = block_table[i]
        if ref_count[src] > 1:  # someone else reads it: never write in place
            dst = allocate()
            ref_count[dst] = 1
            ref_count[src] -= 1  # > 0 still: the others keep it
            block_table[i] = dst
            copies.append((src, dst))
    return copies


class BlockManager:
    """allocator: who hands out free block ids (`BlockAllocator`; rung 4's seam).
    copy_on_write: a function with `copy_on_write_rule`'s signature used in its place (rung 6's seam).
    sliding_window, sink_tokens: blocks outside every later window go back (rung 8); None: all kept.
    free_rule: a function with `window_free_rule`'s signature used in its place (rung 8's seam)."""

    def __init__(self, num_blocks: int, block_size: int, allocator: BlockAllocator | None = None,
                 copy_on_write: CopyOnWrite | None = None, sliding_window: int | None = None,
                 sink_tokens: int = 0, free_rule: WindowFreeRule | None = None):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.allocator = allocator if allocator is not None else FreeListAllocator(num_blocks)
        if copy_on_write is not None and not callable(copy_on_write):
            raise TypeError(f"copy_on_write must be a function (block_table, ref_count, num_computed_tokens, "
                            f"num_tokens, block_size, allocate) -> [(src, dst), ...], got {copy_on_write!r}")
        self.copy_on_write_fn: CopyOnWrite = copy_on_write or copy_on_write_rule
        self.ref_count = [0] * num_blocks
        self.sliding_window, self.sink_tokens = sliding_window, sink_tokens
        self.free_rule: WindowFreeRule = free_rule or window_free_rule
        self.num_window_freed = 0  # table entries given back by the window since start
        self.prefix_cache: PrefixCache | None = None
        self.offload: Offload | None = None
        self.tier_loads: TierLoads | None = None  # loads from the offload store (with `offload`)
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

    def num_new_blocks(self, seq: CachedRequest, num_tokens: int) -> int:
        """Blocks `seq` must still get to hold `num_tokens` tokens."""
        return max(0, blocks_needed(num_tokens, self.block_size) - len(seq.block_table))

    def can_grow(self, seq: CachedRequest, num_tokens: int) -> bool:
        """Room for the new blocks AND for the private copies of shared blocks the step writes into."""
        need = self.num_new_blocks(seq, num_tokens) + len(self.shared_blocks_to_write(seq, num_tokens))
        return need <= self.num_free_blocks

    def grow(self, seq: CachedRequest, num_tokens: int, holes: frozenset[int] = frozenset()) -> None:
        """Append blocks to seq.block_table until it can hold `num_tokens` tokens. Logical indexes in
        `holes` get NO_BLOCK instead (a windowed sequence swapped back in: those were given back)."""
        start, new = len(seq.block_table), self.num_new_blocks(seq, num_tokens)
        if new == 0:  # most decode steps: the last block still has room
            return
        need = new - sum(1 for i in holes if i >= start)
        if need > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {need} blocks, {self.num_free_blocks} free")
        for i in range(start, start + new):
            if i in holes:
                seq.block_table.append(NO_BLOCK)
                continue
            block = self.allocator.allocate()
            if self.ref_count[block] != 0:
                raise RuntimeError(f"allocator returned block {block}, which is still in use")
            self.ref_count[block] = 1
            self.num_refs += 1
            seq.block_table.append(block)
        self._track_peaks()

    def free(self, seq: CachedRequest) -> None:
        """Drop the sequence's references, tail first; blocks nobody references go back."""
        for block in reversed(seq.block_table):
            if block != NO_BLOCK:
                self.decref(block)
        seq.block_table = []
        if self.prefix_cache is not None:
            self.prefix_cache.forget(seq)
        if self.tier_loads is not None:
            self.tier_loads.forget(seq)

    def incref(self, block: int) -> None:
        self.share((block,))

    def share(self, blocks) -> None:
        """incref of every block, in bulk (a hit of 8,192 tokens takes 512 blocks at once): the unused
        cached ones leave the free pool, then every count goes up."""
        ref_count = self.ref_count
        for b in [b for b in blocks if ref_count[b] < 1]:
            if self.prefix_cache is None or not self.prefix_cache.holds(b):
                raise RuntimeError(f"block {b} is free; cannot share it")
            self.allocator.take(b)  # an unused cached block: back in use, content and all
        for b in blocks:
            ref_count[b] += 1
        self.num_refs += len(blocks)

    def decref(self, block: int) -> None:
        if self.ref_count[block] < 1:
            raise RuntimeError(f"block {block} freed twice")
        self.ref_count[block] -= 1
        self.num_refs -= 1
        if self.ref_count[block] == 0:
            self.allocator.free(block)

    def fork(self, parent: CachedRequest, child: CachedRequest) -> None:
        """The child shares every block of the parent (copy-on-write happens on the next write)."""
        self.share([b for b in parent.block_table if b != NO_BLOCK])
        child.block_table = list(parent.block_table)
        self.num_forks += 1
        self._track_peaks()

    def shared_blocks_to_write(self, seq: CachedRequest, num_tokens: int) -> list[int]:
        """Logical indexes of the blocks that writing positions [num_computed_tokens, num_tokens) touches
        while another block table still holds them (ref_count > 1)."""
        first = seq.num_computed_tokens // self.block_size
        last = min(len(seq.block_table), blocks_needed(num_tokens, self.block_size))
        return [i for i in range(first, last) if self.ref_count[seq.block_table[i]] > 1]

    def copy_on_write(self, seq: CachedRequest, num_tokens: int) -> list[tuple[int, int]]:
        """Before a step writes positions [seq.num_computed_tokens, num_tokens): swap every shared block
        it writes into for a private copy (`copy_on_write_rule`, or the function given to the
        constructor). Returns the (src, dst) pairs whose K/V must be copied (all layers) before the
        forward. The last owner of a block writes in place: its ref_count is 1.

        The rule edits block_table and ref_count in place; num_refs stays as it was (each copy adds
        one holder to dst and takes one from src), so `check` catches a rule that miscounts."""
        handed: list[int] = []

        def allocate() -> int:
            block = self.allocator.allocate()
            if self.ref_count[block] != 0:
                raise RuntimeError(f"allocator returned block {block}, which is still in use")
            handed.append(block)
            return block

        table_len = len(seq.block_table)
        raw = self.copy_on_write_fn(seq.block_table, self.ref_count, seq.num_computed_tokens, num_tokens,
                                    self.block_size, allocate)
        copies = self._checked_copies(raw, handed, seq, table_len)
        self.num_cow_copies += len(copies)
        self._track_peaks()
        return copies

    def _checked_copies(self, raw, handed: list[int], seq: CachedRequest, table_len: int) -> list[tuple[int, int]]:
        """What a copy_on_write function returned, as (src, dst) int pairs, or a ValueError naming the fault."""
        if isinstance(raw, (list, tuple)) and not raw and not handed and len(seq.block_table) == table_len:
            return []  # nothing shared was written: the common case, checked cheaply

        def fault(what: str) -> ValueError:
            name = getattr(self.copy_on_write_fn, "__name__", "copy_on_write")
            return ValueError(f"{name} for request {seq.request_id} (block_table now {seq.block_table}) {what}")

        if raw is None:
            raise fault("returned None; return the list of (src, dst) copies, [] when nothing is copied "
                        "(did it forget to `return`?)")
        try:
            copies = [(int(src), int(dst)) for src, dst in raw]
        except (TypeError, ValueError):
            raise fault(f"returned {raw!r}; expected a list of (src, dst) pairs of block ids") from None
        for src, dst in copies:
            if not (0 <= src < self.num_blocks and 0 <= dst < self.num_blocks):
                raise fault(f"returned the copy ({src}, {dst}); block ids are in [0, {self.num_blocks})")
            if dst not in handed:
                raise fault(f"returned the copy ({src}, {dst}), but block {dst} did not come from allocate() "
                            f"(it handed out {handed}): the copy would overwrite a block in use")
        if sorted(d for _, d in copies) != sorted(handed):
            raise fault(f"took blocks {handed} from allocate() but returned copies into {[d for _, d in copies]}: "
                        "each allocated block holds exactly one copy, returned once")
        if len(seq.block_table) != table_len:
            raise fault(f"changed the length of block_table from {table_len} to {len(seq.block_table)}; "
                        "copy-on-write replaces entries, it never adds or removes one")
        return copies

    # ---- sliding window (rung 8) ----------------------------------------------------------------
    def free_outside_window(self, seq: CachedRequest) -> int:
        """After a step: give back the blocks of `seq` that no later query sees (the free rule, its
        answer checked); their entries become NO_BLOCK. Returns how many went back."""
        if self.sliding_window is None or not seq.block_table:
            return 0
        idx = checked_frees(self.free_rule, seq.block_table, seq.num_computed_tokens, self.block_size,
                            self.sliding_window, self.sink_tokens, seq.request_id)
        for i in idx:
            self.decref(seq.block_table[i])  # shared (a fork, a cached prefix): the others keep it
            seq.block_table[i] = NO_BLOCK
        self.num_window_freed += len(idx)
        return len(idx)

    # ---- prefix cache (rung 6) -------------------------------------------------------------------
    def attach_prefix_cache(self, cache: PrefixCache) -> None:
        """Turn prefix caching on (before any block is in use)."""
        if self.num_refs or self.prefix_cache is not None:
            raise RuntimeError("attach the prefix cache to a fresh BlockManager, before any block is in use")
        self.prefix_cache = cache
        cache.bind(self.ref_count)
        self.allocator = CachingAllocator(self.allocator, cache)

    def match_prefix(self, seq: CachedRequest) -> PrefixMatch:
        """The cached prefix a sequence about to be prefilled can take (empty if none, or caching is off)."""
        held = self.tier_loads.held(seq) if self.tier_loads is not None else None
        if held is not None:
            return held  # its blocks came back from the store: held for it
        if self.prefix_cache is None or seq.block_table:
            return PrefixMatch()
        hit = self.prefix_cache.lookup(seq)
        if self.offload is not None and self.prefix_cache.enabled:
            hit = self.offload.extend(hit, seq)  # [len(hit.blocks), ...) from the store, if it holds them
        return hit

    def attach_offload(self, offload: Offload) -> None:
        """Put a store of evicted blocks below the prefix cache (after `attach_prefix_cache`)."""
        if offload.cache is not self.prefix_cache:
            raise RuntimeError("the offload tiers must serve this block manager's prefix cache")
        self.offload = offload
        self.tier_loads = TierLoads(self, offload)

    def flush_offload(self) -> None:
        """End of a step: hand the newly cached blocks to the store's write-through."""
        if self.offload is not None:
            self.offload.flush()

    # ---- loads from the offload store (the lifecycle is TierLoads') ------------------------------------
    def start_load(self, seq: CachedRequest, hit: PrefixMatch) -> bool:
        """If the hit reads files: take its blocks and start the reads, and return True (the caller keeps
        the request waiting until `load_ready`). False: nothing to read (admit it as usual)."""
        return self.tier_loads is not None and self.tier_loads.start(seq, hit)

    def load_ready(self, seq: CachedRequest) -> bool:
        return self.tier_loads.ready(seq)

    def wait_for_load(self, seq: CachedRequest) -> None:
        self.tier_loads.wait(seq)

    def finish_load(self, seq: CachedRequest) -> None:
        """The reads are done: one copy into the pool, the blocks join the cache, and the request holds
        them for its admission (`match_prefix` / `acquire_prefix` give them back as its hit)."""
        self.tier_loads.finish(seq)

    def trim_table(self, seq: CachedRequest, num_blocks: int) -> None:
        """Keep the first `num_blocks` entries of the table; the rest are dropped, tail first."""
        for block in reversed(seq.block_table[num_blocks:]):
            self.decref(block)
        del seq.block_table[num_blocks:]

    def can_admit(self, seq: CachedRequest, hit: PrefixMatch, num_tokens: int) -> bool:
        """Room for `num_tokens` tokens once the hit's blocks are taken (unused hit blocks leave the free pool)."""
        if not hit.blocks:
            return self.can_grow(seq, num_tokens)
        # unused hit blocks leave the free pool; pinned ones were never in it
        revived = sum(1 for b in hit.blocks if self.ref_count[b] == 0 and b not in self.prefix_cache.pinned)
        return blocks_needed(num_tokens, self.block_size) - len(hit.blocks) + revived <= self.num_free_blocks

    def acquire_prefix(self, seq: CachedRequest, hit: PrefixMatch) -> int | None:
        """Start the sequence on its cached prefix: [0, hit.num_tokens) needs no compute. Returns
        hit.num_tokens, the tokens the caller records as computed; None if it took nothing (caching
        off, or the sequence already holds blocks) and the sequence stays as it was. A sequence whose
        load finished holds its hit already (`finish_load`)."""
        loaded = self.tier_loads.take(seq) if self.tier_loads is not None else None
        if loaded is not None:
            self.prefix_cache.record(seq, loaded)
            return loaded.num_tokens
        if self.prefix_cache is None or seq.block_table:
            return None
        self.share(hit.blocks)
        seq.block_table = list(hit.blocks)
        if hit.loads:
            hit = self.tier_loads.load_now(seq, hit)
        self.prefix_cache.record(seq, hit)
        self._track_peaks()
        return hit.num_tokens

    def cache_blocks(self, seq: CachedRequest) -> None:
        """After a step: the sequence's newly full blocks join the cache. A block the cache already
        holds under another id (computed twice) is swapped for the cached one, and ours goes back."""
        if self.prefix_cache is None:
            return
        for i, block in self.prefix_cache.insert(seq).items():
            self.incref(block)
            self.decref(seq.block_table[i])
            seq.block_table[i] = block
        if self.offload is not None:
            self.offload.cached(seq)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (after the weights change, say). Refused while any is in use."""
        busy = self.prefix_cache.blocks_in_use()
        if busy:
            raise RuntimeError(f"{len(busy)} blocks of the prefix cache are in use by running requests; let them "
                               "finish (or abort them) and reset again, or reset with defer=True")
        self.flush_offload()  # queued write-through reads first: the blocks are handed back empty
        for b in self.prefix_cache.clear():
            self.allocator.inner.free(b)

    def check(self, seqs: list[CachedRequest]) -> None:
        """Invariants: refcounts equal block-table membership; used + free == total."""
        counts = [0] * self.num_blocks
        for s in seqs:
            for b in s.block_table:
                if b != NO_BLOCK:
                    counts[b] += 1
        if counts != self.ref_count:
            bad = next(i for i, (a, b) in enumerate(zip(counts, self.ref_count)) if a != b)
            raise AssertionError(f"block {bad}: in {counts[bad]} block tables but ref_count {self.ref_count[bad]}")
        if self.num_refs != sum(counts):
            raise AssertionError(f"num_refs is {self.num_refs} but block tables hold {sum(counts)} entries; "
                                 "change ref_count only through grow / incref / decref / copy_on_write")
        in_use = sum(1 for c in counts if c)
        pinned_idle = 0  # prefix cache: pinned blocks nobody uses are neither in use nor free
        if self.prefix_cache is not None:
            self.prefix_cache.check(seqs)
            pinned_idle = sum(1 for b in self.prefix_cache.pinned if self.ref_count[b] == 0)
            empty, cached = self.allocator.inner.num_free_blocks, self.prefix_cache.num_evictable
            if in_use + pinned_idle + empty + cached != self.num_blocks:
                raise AssertionError(f"{in_use} in use + {pinned_idle} pinned idle + {empty} empty + {cached} cached "
                                     f"unused != {self.num_blocks} blocks: a block is lost or counted twice")
        if in_use + pinned_idle + self.num_free_blocks != self.num_blocks:
            raise AssertionError(f"{in_use} blocks in use + {self.num_free_blocks} free != {self.num_blocks}")
