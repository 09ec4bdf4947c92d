"""The seam between the pool's prefix cache and a store of evicted blocks (tiered.py).

The block manager asks it at three moments of a block's life:

    lookup   the hash chain stops at block m; blocks m, m+1, ... whose keys the store holds are
             a hit too, to be loaded into free blocks:
                 [0, m)             pool blocks (the prefix cache's hit)
                 [m, m + loads)     copied back from the store (one batched copy)
                 [m + loads, len)   computed
    cached   a block just joined the prefix cache: queue it for the disk (write-through), read
             from the pool in one batch at the end of the step, before any block can be reused
    evicted  the pool gives a cached block away: its bytes go down to the store first (one batch)

A load is started, then finished. Blocks in the CPU tier are gathered into a staging buffer at
once (so a later spill may reuse their slots); blocks on disk are read by reader threads. A load
with disk reads lets the engine go on without it (the request waits in the scheduler's `loading`):

    step k     lookup hits disk   start_load: blocks taken, CPU slots gathered, reads queued
    step k+1.. other requests decode; the reads run beside them
    step j     reads done         finish_load: disk bytes into the staging buffer, then ONE copy
                                  into the pool; the request is admitted on its loaded prefix

A read that fails (a corrupted or vanished file, an error) or takes longer than `read_timeout`
ends the hit there: the blocks after it are computed. The store only ever sees keys (identity.store_key:
the block's hash chain key + the model's and the pool's identity) and values (the block's tensors);
it never sees a block id or a token.
"""
from __future__ import annotations

import time
import weakref
from concurrent.futures import wait
from dataclasses import dataclass, field

import torch

from minikv.cache.blocks.block_table import CachedRequest
from minikv.cache.blocks.pool import KVPool, runs
from minikv.cache.prefix.base import PrefixMatch
from minikv.cache.prefix.hash_chain import HashChainCache, block_hashes
from minikv.cache.tiers.block_file import payload_tensors
from minikv.cache.tiers.identity import store_key
from minikv.cache.tiers.store import BlockStore
from minikv.cache.tiers.tiered import TieredStore

READ_TIMEOUT_S = 30.0  # a disk read slower than this is given up: its block (and the rest) is computed


@dataclass(eq=False)  # compared (and hashed) by identity: one object per load
class PendingLoad:
    """A load in flight: block j of `keys` goes into pool block `blocks[j]`.

    staged  planes [num_layers, len(keys), ...], pinned on a GPU engine: CPU-tier blocks are in
            already; a disk block lands at its position when its read is done
    reads   position -> Future of DiskTier.read (bytes only)"""

    keys: list[bytes]
    blocks: list[int]
    tiers: list[str]
    staged: tuple
    wanted: int  # blocks the lookup found: fewer in `keys` means the store lost some since
    started: float  # perf_counter() when the load began
    reads: dict = field(default_factory=dict)
    work_seconds: float = 0.0  # the load's own time so far: the CPU tier's gather, then the reads' span
    reads_done_at: float = 0.0  # perf_counter() when the last read finished (set by the reader threads)

    def read_done(self, _future) -> None:
        self.reads_done_at = max(self.reads_done_at, time.perf_counter())

    @property
    def ready(self) -> bool:
        return all(f.done() for f in self.reads.values()) or time.perf_counter() > self.started + READ_TIMEOUT_S


class Offload:
    """pool: the KVPool; cache: the hash chain it serves; store: a TieredStore or any BlockStore;
    identity: identity.store_identity of the model and the pool (part of every key)."""

    def __init__(self, pool: KVPool, cache: HashChainCache, store: BlockStore, identity: str):
        if not isinstance(cache, HashChainCache):
            raise ValueError("the KV offload tiers key blocks by the hash chain; use prefix_caching='hash'")
        self.pool, self.cache, self.store, self.identity = pool, cache, store, identity
        self.block_size = pool.block_size
        self._pending: list[tuple[int, bytes]] = []  # (pool block, store key) to write through
        self._progress: dict[int, int] = {}  # seq_id -> its blocks already offered for write-through
        self._spill_buffers: tuple = ()  # pinned host planes a spill from a GPU lands in, reused
        self._spare: tuple = ()  # flat staging buffers of a finished load, for the next one
        self.inflight: set[PendingLoad] = set()  # loads started and not finished or cancelled
        spill = weakref.WeakMethod(self.spill)  # no cycle cache <-> offload: the pool goes with the engine

        def on_evict(keys: list[tuple[int, bytes]]) -> None:
            fn = spill()
            if fn is not None:
                fn(keys)
        cache.on_evict = on_evict
        self.reset_stats()

    def reset_stats(self) -> None:
        self.tier_hits: dict[str, int] = {}  # tier -> tokens loaded from it
        self.blocks_out = self.bytes_out = 0  # pool -> store (evictions and write-through reads)
        self.blocks_in = self.bytes_in = 0  # store -> pool (hits)
        self.load_seconds = 0.0  # the loads' own time: gathers, the reads' span from the start, the copies
        self.load_latency_seconds = 0.0  # from a load's start to its blocks in the pool (other steps between)
        self.stall_seconds = 0.0  # of which the engine waited with nothing else to run
        self.num_async_loads = 0  # loads that read files beside the engine's other work
        self.load_failures = 0  # loads cut short: a block the store listed but could not give in time

    def key(self, block_hash: bytes) -> bytes:
        return store_key(self.identity, block_hash)

    # ---- lookup ---------------------------------------------------------------------------------
    def extend(self, hit: PrefixMatch, seq: CachedRequest) -> PrefixMatch:
        """The pool's hit, continued with the blocks the store holds (`loads`: their keys, in order)."""
        bs, m = self.block_size, len(hit.blocks)
        n_full = (seq.num_tokens - 1) // bs  # the last token is always computed
        if m >= n_full:
            return hit
        parent = self.cache.key_of(hit.blocks[-1]) if hit.blocks else None
        tokens = seq.token_ids[m * bs:n_full * bs]
        hashes = block_hashes(tokens, bs, seq.cache_salt if m == 0 else None, self.cache.hash_fn, parent)
        loads = []
        for h in hashes:
            k = self.key(h)
            if k not in self.store:
                break
            loads.append(k)
        if not loads:
            return hit
        return PrefixMatch(list(hit.blocks), (m + len(loads)) * bs, loads)

    def reads_disk(self, keys: list[bytes]) -> bool:
        """Would loading these keys read files (then the engine loads them beside its other work)?"""
        return isinstance(self.store, TieredStore) and any(self.store.locate(k) == "disk" for k in keys)

    def load(self, keys: list[bytes], blocks: list[int]) -> int:
        """Copy the stored blocks of `keys` into pool `blocks`, in one batch, waiting for any read.
        Returns how many it loaded: a block the store cannot give (gone, corrupted) ends the prefix."""
        pending = self.start_load(keys, blocks)
        self.wait(pending)
        n, tier_tokens = self.finish_load(pending)
        self.count_hits(tier_tokens)
        return n

    def start_load(self, keys: list[bytes], blocks: list[int]) -> PendingLoad:
        """Gather the CPU tier's blocks into a staging buffer now and queue the disk's reads. The pool
        blocks must stay reserved for the load until `finish_load` or `cancel`."""
        started = time.perf_counter()
        if isinstance(self.store, TieredStore):
            tiers = []
            for k in keys:
                tier = self.store.locate(k)
                if tier is None:
                    break
                tiers.append(tier)
            pending = PendingLoad(keys[:len(tiers)], blocks[:len(tiers)], tiers, self._staging(len(tiers)), len(keys),
                                  started=started)
            on_cpu = [j for j, t in enumerate(tiers) if t == "cpu"]
            if len(on_cpu) == len(tiers) and tiers:  # the common case: one index_select per tensor, in place
                self.store.cpu.gather(pending.keys, out=list(pending.staged))
            elif on_cpu:  # CPU and disk blocks interleaved: one gather, then a copy per run of positions
                got = self.store.cpu.gather([keys[j] for j in on_cpu])
                for j, i, n in runs(on_cpu, range(len(on_cpu))):
                    for staged, g in zip(pending.staged, got):
                        staged[:, j:j + n].copy_(g[:, i:i + n])
            pending.work_seconds = time.perf_counter() - started
            for j, t in enumerate(tiers):
                if t == "disk":
                    pending.reads[j] = self.store.disk.read_async(keys[j])
                    pending.reads[j].add_done_callback(pending.read_done)
        else:  # a store of the seam: one get per key, stopping at the first miss (a get touches LRU order)
            values, tiers = [], []
            locate = getattr(self.store, "where", None)
            for k in keys:
                value = self.store.get(k)
                if value is None:
                    break
                values.append(value)
                tiers.append(locate(k) if locate is not None else "store")
            device = self.pool.device
            if device.type == "cuda" and values and all(t.device == device for v in values for t in v):
                # blocks the store holds on the pool's own device (a disaggregated decode engine's inbox):
                # gathered there, never through the host
                staged = tuple(torch.stack([v[i] for v in values], dim=1) for i in range(len(values[0])))
            else:
                staged = self._staging(len(values))
                for i, plane in enumerate(staged):  # one copy per plane: a block per call cost ~5 us each
                    if values:
                        torch.stack([v[i].to("cpu") for v in values], dim=1, out=plane)
            pending = PendingLoad(keys[:len(values)], blocks[:len(values)], tiers, staged, len(keys), started=started)
            pending.work_seconds = time.perf_counter() - started
        if pending.reads:
            self.num_async_loads += 1
        self.inflight.add(pending)
        return pending

    def wait(self, pending: PendingLoad) -> None:
        """Block until the load's reads are done (or given up); the time counts as a stall."""
        if pending.ready:
            return
        t0 = time.perf_counter()
        wait(list(pending.reads.values()), timeout=max(0.0, pending.started + READ_TIMEOUT_S - t0))
        self.stall_seconds += time.perf_counter() - t0

    def finish_load(self, pending: PendingLoad) -> tuple[int, dict[str, int]]:
        """Put the load's blocks into the pool in one copy, up to the first that failed. Returns
        (blocks loaded, tokens per tier) for `count_hits` when the request is admitted on them."""
        self.inflight.discard(pending)
        copy_start = time.perf_counter()
        if pending.reads:  # the reads ran beside the engine: count their span, not the steps between
            pending.work_seconds = max(pending.work_seconds, (pending.reads_done_at or copy_start) - pending.started)
        n = len(pending.keys)
        for j in sorted(pending.reads):
            future = pending.reads[j]
            found = future.result() if future.done() and future.exception() is None else None
            if found is None:  # gone, damaged, failed or too slow: the hit ends here
                if not future.done() or future.exception() is not None:
                    self.store.disk.forget(pending.keys[j])  # never asked for again (nor waited for)
                n = j
                break
            for plane, t in zip(pending.staged, payload_tensors(*found)):
                plane[:, j].copy_(t)
        if n < pending.wanted:
            self.load_failures += 1
        if n:
            planes = pending.staged if n == len(pending.keys) else tuple(p[:, :n] for p in pending.staged)
            device = self.pool.device
            self.pool.write_blocks(pending.blocks[:n], *(p.to(device, non_blocking=True) for p in planes))
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()  # loaded: the time below is the copy's
            self.blocks_in += n
            self.bytes_in += sum(p.numel() * p.element_size() for p in planes)
        now = time.perf_counter()
        self.load_seconds += pending.work_seconds + (now - copy_start)
        self.load_latency_seconds += now - pending.started
        self._recycle(pending)
        tier_tokens: dict[str, int] = {}
        for t in pending.tiers[:n]:
            tier_tokens[t] = tier_tokens.get(t, 0) + self.block_size
        return n, tier_tokens

    def cancel(self, pending: PendingLoad) -> None:
        """The request went away while loading: its reads finish unseen (they only fill their own bytes)."""
        self.inflight.discard(pending)
        self._recycle(pending)

    def count_hits(self, tier_tokens: dict[str, int]) -> None:
        for tier, tokens in tier_tokens.items():
            self.tier_hits[tier] = self.tier_hits.get(tier, 0) + tokens

    def _staging(self, n: int) -> tuple:
        """Empty planes [num_layers, n, ...] like the pool's, pinned when the pool is on a GPU (so the
        copy up is asynchronous). Views of the spare buffers when they are free and large enough (a
        fresh large buffer costs a page fault per page), else new ones."""
        planes = self.pool.planes
        sizes = [n * p.shape[0] * p[0, 0].numel() for p in planes]  # n blocks, every layer
        spare, self._spare = self._spare, ()
        if not spare or any(b.numel() < k for b, k in zip(spare, sizes)):
            pin = self.pool.device.type == "cuda"
            spare = tuple(torch.empty(k, dtype=p.dtype, pin_memory=pin) for k, p in zip(sizes, planes))
        return tuple(b[:k].view((p.shape[0], n) + tuple(p.shape[2:])) for b, k, p in zip(spare, sizes, planes))

    def _recycle(self, pending: PendingLoad) -> None:
        """The load's staging buffers are free again (its copy is done, or it was cancelled)."""
        if pending.staged and pending.staged[0].device.type != "cpu":
            return  # gathered on the device for this load alone: not a host staging buffer
        bases = tuple(p._base if p._base is not None else p for p in pending.staged)
        if not self._spare or bases[0].numel() > self._spare[0].numel():
            self._spare = bases

    # ---- write-through --------------------------------------------------------------------------
    def cached(self, seq: CachedRequest) -> None:
        """Queue the sequence's newly cached full blocks for the disk (if the store persists)."""
        persist = getattr(self.store, "persist", None)
        n_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        start = self._progress.get(seq.seq_id, 0)
        self._progress[seq.seq_id] = max(start, n_full)
        if persist is None or getattr(self.store, "disk", None) is None:
            return
        for block in seq.block_table[start:n_full]:
            h = self.cache.key_of(block)
            if h is not None and self.key(h) not in self.store.disk:
                self._pending.append((block, self.key(h)))

    def forget(self, seq: CachedRequest) -> None:
        self._progress.pop(seq.seq_id, None)

    def flush(self) -> None:
        """Read the blocks queued for write-through (one batched read) and hand them to the store."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        self._move_out(pending, "persist")

    def close(self) -> None:
        """The engine is closed: write through what is queued, cancel the loads left, drop the buffers."""
        self.flush()
        for pending in list(self.inflight):
            self.cancel(pending)
        self._spill_buffers = self._spare = ()

    # ---- eviction -------------------------------------------------------------------------------
    def spill(self, evicted: list[tuple[int, bytes]]) -> None:
        """The prefix cache is giving these (block, block hash) away: their bytes go to the store."""
        self.flush()  # a queued write-through may read one of them: before it is reused
        needs = getattr(self.store, "needs", None)
        out = []
        for block, h in evicted:
            k = self.key(h)
            if needs is None or needs(k):
                out.append((block, k))
            elif hasattr(self.store, "touch"):
                self.store.touch(k)
        self._move_out(out, "put")

    def _move_out(self, pairs: list[tuple[int, bytes]], how: str) -> None:
        """The blocks of `pairs` to the store's `put` or `persist`: one gather from the pool, one copy to
        the host, then the store's batched form (`put_many`) or one call per block (a seam's store)."""
        if not pairs:
            return
        blocks, keys = [b for b, _ in pairs], [k for _, k in pairs]
        read = self.pool.read_blocks(blocks)  # each [num_layers, n, block_size, ...], one gather
        batched = getattr(self.store, f"{how}_many", None)
        if batched is not None:
            batched(keys, self._to_host(read))  # the store copies out before the buffers are reused
        else:  # a store that may keep what it is given: tensors of its own
            read = tuple(t.to("cpu") for t in read)
            give = getattr(self.store, how)
            for j, k in enumerate(keys):
                give(k, tuple(t[:, j] for t in read))
        self.blocks_out += len(pairs)
        self.bytes_out += sum(t.numel() * t.element_size() for t in read)

    def _to_host(self, planes: tuple) -> tuple:
        """Planes on the host: as they are on a CPU pool; from a GPU, one copy per tensor into reused
        pinned buffers (asynchronous, then waited for once)."""
        if self.pool.device.type != "cuda":
            return planes
        if (len(self._spill_buffers) != len(planes)
                or any(b.numel() < p.numel() for b, p in zip(self._spill_buffers, planes))):
            self._spill_buffers = tuple(torch.empty(2 * p.numel(), dtype=p.dtype, pin_memory=True) for p in planes)
        host = tuple(b[:p.numel()].view(p.shape) for b, p in zip(self._spill_buffers, planes))
        for h, p in zip(host, planes):
            h.copy_(p, non_blocking=True)
        torch.cuda.current_stream(self.pool.device).synchronize()
        return host

    # ---- reporting ------------------------------------------------------------------------------
    def stats(self) -> dict:
        out = {"hits_by_tier": dict(self.tier_hits), "blocks_out": self.blocks_out, "bytes_out": self.bytes_out,
               "blocks_in": self.blocks_in, "bytes_in": self.bytes_in, "load_seconds": self.load_seconds,
               "load_latency_seconds": self.load_latency_seconds,
               "stall_seconds": self.stall_seconds, "async_loads": self.num_async_loads,
               "loading": len(self.inflight), "load_failures": self.load_failures}
        if hasattr(self.store, "stats"):
            out["tiers"] = self.store.stats()
        return out
