"""A read-only view of one engine: what views, checkers, bug labs and the server read.

    view = llm.view                       (or core.view)
    view.num_blocks, view.free_blocks, view.used_blocks, view.kv_usage       the pool
    view.running, view.waiting, view.swapped, view.loading                   the queues (tuples)
    view.cached_blocks()                                                     the prefix cache
    view.tiers()                                                             the offload tiers

Everything here is a number, a tuple or a fresh dict: changing it changes nothing in the engine.
The engine's parts (scheduler, block manager, attention backend, pool) stay private to
minikv/engine/; reading them through this view is what keeps them free to change.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minikv.engine.sequence import Sequence


@dataclass(frozen=True)
class ViewSnapshot:
    """The numbers a server reads of its engine, copied at once: plain data that crosses a process
    boundary (the core in its own process sends one with every step's events)."""

    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    free_seats: int = 0
    kv_usage: float = 0.0
    num_preemptions: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache, and found
    prefix_hits: int = 0
    tenant_service: dict = field(default_factory=dict)  # the fair scheduler's weighted tokens per tenant
    waiting_by_tenant: dict = field(default_factory=dict)  # requests waiting for a seat, per tenant
    num_steps: int = 0  # engine steps since start, and the seconds spent inside them (EngineCore.run_step)
    step_seconds: float = 0.0
    wait_seconds: float = 0.0  # of step_seconds, the waits for the device (EngineCore.wait_seconds)


class EngineView:
    """Over an EngineCore (minikv/engine/core.py), which builds it: `core.view`, `llm.view`."""

    def __init__(self, core):
        self._core = core

    # ---- the engine ---------------------------------------------------------------------------
    @property
    def kv_backend(self) -> str:
        return self._core.kv_backend

    @property
    def is_paged(self) -> bool:
        return self._core.is_paged

    @property
    def block_size(self) -> int | None:
        return self._core.block_size

    @property
    def max_model_len(self) -> int:
        return self._core.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self._core.scheduler.max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int | None:
        return getattr(self._core.scheduler, "max_num_batched_tokens", None)

    @property
    def preemption(self) -> str | None:
        return getattr(self._core.scheduler, "preemption", None)

    @property
    def step_index(self) -> int:
        """Steps scheduled so far."""
        return getattr(self._core.scheduler, "step_index", 0)

    # ---- the queues ---------------------------------------------------------------------------
    @property
    def running(self) -> tuple["Sequence", ...]:
        return tuple(self._core.scheduler.running)

    @property
    def waiting(self) -> tuple["Sequence", ...]:
        return tuple(self._core.scheduler.waiting)

    @property
    def swapped(self) -> tuple["Sequence", ...]:
        return tuple(getattr(self._core.scheduler, "swapped", ()))

    @property
    def loading(self) -> tuple["Sequence", ...]:
        return tuple(getattr(self._core.scheduler, "loading", ()))

    def sequences(self) -> tuple["Sequence", ...]:
        """Every sequence the scheduler holds (waiting, running, swapped, loading, finishing)."""
        return tuple(self._core.scheduler.all_sequences())

    @property
    def num_requests(self) -> int:
        """Requests added and not finished yet."""
        return self._core.num_requests()

    @property
    def free_seats(self) -> int:
        """Seats (max_num_seqs) that no running, swapped-out or loading request holds."""
        return max(0, self.max_num_seqs - len(self.running) - len(self.swapped) - len(self.loading))

    @property
    def num_preemptions(self) -> int:
        return getattr(self._core.scheduler, "num_preemptions", 0)

    def tenant_service(self) -> dict[str, float]:
        """The fair scheduler's weighted tokens served to each tenant (empty without schedule_policy='vtc')."""
        fair = getattr(self._core.scheduler, "fair", None)
        return dict(fair.counters) if fair is not None else {}

    def snapshot(self) -> ViewSnapshot:
        """The server's numbers, now (cheap: no walk over the pool or the cache)."""
        sch = self._core.scheduler
        waiting = list(sch.waiting)
        cache = self._core.prefix_cache
        return ViewSnapshot(len(sch.running), len(waiting), len(self.swapped), self.free_seats, self.kv_usage,
                            self.num_preemptions, cache.queries if cache is not None else 0,
                            cache.hits if cache is not None else 0, self.tenant_service(),
                            dict(Counter(s.root.tenant or "" for s in waiting)), self._core.num_steps,
                            self._core.step_seconds, self._core.wait_seconds)

    # ---- the pool -----------------------------------------------------------------------------
    def _bm(self):
        bm = self._core.block_manager
        if bm is None:
            raise ValueError(f"the {self.kv_backend} engine has no block pool; build it with kv_backend='paged'")
        return bm

    @property
    def num_blocks(self) -> int:
        return self._bm().num_blocks

    @property
    def free_blocks(self) -> int:
        return self._bm().num_free_blocks

    @property
    def used_blocks(self) -> int:
        return self._bm().num_used_blocks

    @property
    def held_blocks(self) -> int:
        """Blocks some request holds (ref_count > 0); cached blocks nobody holds are not counted."""
        return sum(1 for r in list(self._bm().ref_count) if r > 0)

    @property
    def kv_usage(self) -> float:
        """Fraction of the pool's blocks a new request cannot take (1 = full): held by requests or
        pinned; cached blocks nobody holds count as free (they are evicted on demand). O(1): the
        server reads it every step."""
        return self.used_blocks / self.num_blocks

    def ref_counts(self) -> tuple[int, ...]:
        return tuple(self._bm().ref_count)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: K and V of all layers (scales included)."""
        return self._core.pool.block_bytes

    @property
    def bytes_per_token(self) -> int:
        return self._core.pool.bytes_per_token

    @property
    def block_allocator(self):
        """The object handing out block ids (the engine's, or yours through the block_allocator seam)."""
        return self._bm().allocator

    @property
    def free_swap_blocks(self) -> int:
        """Free blocks of the CPU swap space (0 without preemption='swap')."""
        swap = getattr(self._core.scheduler, "swap", None)
        return swap.num_free_blocks if swap is not None else 0

    def check(self, seqs=None) -> None:
        """The pool's invariants against these sequences' block tables (default: every sequence the
        scheduler holds); raises AssertionError naming the first broken one."""
        self._bm().check(list(self.sequences() if seqs is None else seqs))

    # ---- the prefix cache and its tiers -------------------------------------------------------
    @property
    def has_prefix_cache(self) -> bool:
        return self._core.prefix_cache is not None

    def _cache(self):
        cache = self._core.prefix_cache
        if cache is None:
            raise ValueError("this engine has no prefix cache; build the LLM with prefix_caching='hash' or 'radix'")
        return cache

    def cached_blocks(self) -> list[int]:
        """The blocks the prefix cache holds, sorted."""
        return sorted(self._cache().cached_blocks())

    def prefix_stats(self) -> dict:
        """Queries, hits (tokens), cached and evicted blocks of the prefix cache."""
        return dict(self._cache().stats())

    def match(self, token_ids: list[int], salt: str | None = None, limit: int | None = None):
        """What a lookup of these tokens would find now (a PrefixMatch), changing nothing."""
        cache = self._cache()
        return cache.match(token_ids, salt) if limit is None else cache.match(token_ids, salt, limit)

    def tiers(self) -> dict | None:
        """The offload tiers below the prefix cache (rung 9): their stats, or None without tiers."""
        offload = self._core.block_manager.offload if self._core.block_manager is not None else None
        return offload.stats() if offload is not None else None

    def tier_key(self, block_hash) -> bytes | None:
        """The key a block of this chain hash has in the offload tiers (None without tiers)."""
        offload = self._core.block_manager.offload if self._core.block_manager is not None else None
        return offload.key(block_hash) if offload is not None else None

    @property
    def tier_identity(self) -> str | None:
        """What the offload tiers key this engine's blocks by: the model's weights, dtype and pool
        format, hashed (engines that could share a block file share it; None without tiers)."""
        return getattr(self._core, "_offload_identity", None) if self._core.offload_store is not None else None

    def pool_format(self) -> dict:
        """The paged pool's storage format (block size, layout, tensors' dtypes and shapes), as the
        tiers' identity records it."""
        from minikv.cache.tiers.identity import pool_format

        return pool_format(self._core.pool)

    @property
    def offload_store(self):
        """The store the pool's evicted blocks go to (rung 9), or None."""
        return self._core.offload_store
