"""The seam between the pool's prefix cache and a store of evicted blocks (tiers.py).

The block manager asks it at three moments of a block's life:

    lookup   the hash chain stops at block m; blocks m, m+1, ... whose keys the store holds are
             a hit too, to be loaded into free blocks:
                 [0, m)             pool blocks (the prefix cache's hit)
                 [m, m + loads)     copied back from the store (one batched copy)
                 [m + loads, len)   computed
    cached   a block just joined the prefix cache: queue it for the disk (write-through), read
             from the pool in one batch at the end of the step, before any block can be reused
    evicted  the pool gives a cached block away: its bytes go down to the store first

The store only ever sees keys (tiers.store_key: the block's hash chain key + the model's and the
pool's identity) and values (the block's tensors); it never sees a block id or a token.
"""
from __future__ import annotations

import time

import torch

from minikv.cache.block_table import CachedRequest
from minikv.cache.hash_chain import HashChainCache, block_hashes
from minikv.cache.pool import KVPool
from minikv.cache.prefix_cache import PrefixMatch
from minikv.cache.tiers import BlockStore, store_key, value_bytes


class Offload:
    """pool: the KVPool; cache: the hash chain it serves; store: a TieredStore or any BlockStore;
    identity: tiers.store_identity of the model and the pool (part of every key)."""

    def __init__(self, pool: KVPool, cache: HashChainCache, store: BlockStore, identity: str):
        if not isinstance(cache, HashChainCache):
            raise ValueError("the KV offload tiers key blocks by the hash chain; use prefix_caching='hash'")
        self.pool, self.cache, self.store, self.identity = pool, cache, store, identity
        self.block_size = pool.block_size
        self._pending: list[tuple[int, bytes]] = []  # (pool block, store key) to write through
        self._progress: dict[int, int] = {}  # seq_id -> its blocks already offered for write-through
        self._staging: dict[int, torch.Tensor] = {}  # pinned host buffers for loads to a GPU, reused
        cache.on_evict = self.spill
        self.reset_stats()

    def reset_stats(self) -> None:
        self.tier_hits: dict[str, int] = {}  # tier -> tokens loaded from it
        self.blocks_out = self.bytes_out = 0  # pool -> store (evictions and write-through reads)
        self.blocks_in = self.bytes_in = 0  # store -> pool (hits)
        self.load_seconds = 0.0
        self.load_failures = 0  # blocks the store listed but could not give (a corrupted file, say)

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

    def load(self, keys: list[bytes], blocks: list[int]) -> int:
        """Copy the stored blocks of `keys` into pool `blocks`, in one batch. Returns how many it
        loaded: a block the store cannot give (gone, corrupted) ends the prefix there."""
        t0 = time.perf_counter()
        values = []
        for tier, value in self._fetch(keys):
            if value is None:
                self.load_failures += 1
                break
            values.append(value)
            self.tier_hits[tier] = self.tier_hits.get(tier, 0) + self.block_size
        if values:
            self.pool.write_blocks(blocks[:len(values)], *self._stage(values))
            if self.pool.device.type == "cuda":
                torch.cuda.current_stream(self.pool.device).synchronize()  # the staging buffer is reused
            self.blocks_in += len(values)
            self.bytes_in += sum(value_bytes(v) for v in values)
        self.load_seconds += time.perf_counter() - t0
        return len(values)

    def _fetch(self, keys: list[bytes]):
        """(tier, value or None) of each key, in order; a store with get_many reads them at once."""
        get_many = getattr(self.store, "get_many", None)
        if get_many is not None:
            yield from get_many(keys)
            return
        locate = getattr(self.store, "locate", None) or getattr(self.store, "where", None)
        for k in keys:  # one at a time, stopping at the first miss: later gets would touch LRU order
            tier = locate(k) if locate is not None else "store"
            value = self.store.get(k)
            yield tier, value
            if value is None:
                return

    def _stage(self, values: list) -> list[torch.Tensor]:
        """The blocks side by side, [num_layers, n, block_size, ...] per tensor: stacked on a CPU, in a
        reused pinned buffer copied asynchronously to a GPU."""
        if self.pool.device.type != "cuda":
            return [torch.stack([v[i] for v in values], dim=1) for i in range(len(values[0]))]
        out = []
        for i in range(len(values[0])):
            first = values[0][i]
            shape = (first.shape[0], len(values)) + tuple(first.shape[1:])
            numel = torch.Size(shape).numel()
            buf = self._staging.get(i)
            if buf is None or buf.numel() < numel or buf.dtype != first.dtype:
                buf = self._staging[i] = torch.empty(max(numel, 2 * (buf.numel() if buf is not None else 0)),
                                                     dtype=first.dtype, pin_memory=True)
            staged = buf[:numel].view(shape)
            for j, v in enumerate(values):
                staged[:, j].copy_(v[i])
            out.append(staged.to(self.pool.device, non_blocking=True))
        return out

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
        self._move_out(pending, self.store.persist)

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
        self._move_out(out, self.store.put)

    def _move_out(self, pairs: list[tuple[int, bytes]], give) -> None:
        if not pairs:
            return
        read = self.pool.read_blocks([b for b, _ in pairs])  # each [num_layers, n, block_size, ...]
        read = tuple(t.to("cpu") for t in read)
        for j, (_, k) in enumerate(pairs):
            value = tuple(t[:, j] for t in read)
            give(k, value)
            self.blocks_out += 1
            self.bytes_out += value_bytes(value)

    # ---- reporting ------------------------------------------------------------------------------
    def stats(self) -> dict:
        out = {"hits_by_tier": dict(self.tier_hits), "blocks_out": self.blocks_out, "bytes_out": self.bytes_out,
               "blocks_in": self.blocks_in, "bytes_in": self.bytes_in, "load_seconds": self.load_seconds,
               "load_failures": self.load_failures}
        if hasattr(self.store, "stats"):
            out["tiers"] = self.store.stats()
        return out
