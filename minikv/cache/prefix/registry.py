"""Build a prefix cache by name: `LLM(prefix_caching="hash" | "radix" | a PrefixCache)`.

    base.py           the interface (PrefixCache, PrefixMatch, EvictionQueue); imports no design
    hash_chain.py     HashChainCache(PrefixCache)      both import the interface,
    radix.py          RadixCache(PrefixCache)          never each other
    registry.py       the registry below                imports the designs, nobody imports it back
"""
from __future__ import annotations

from minikv.cache.prefix.base import PrefixCache
from minikv.cache.prefix.hash_chain import HashChainCache
from minikv.cache.prefix.radix import RadixCache

PREFIX_CACHES: dict[str, type[PrefixCache]] = {"hash": HashChainCache, "radix": RadixCache}


# the named seams each design takes: LLM option -> its constructor's argument
PREFIX_SEAMS: dict[str, dict[str, str]] = {
    "hash": {"free_block_queue": "free_queue"},
    "radix": {"radix_insert": "insert_fn", "radix_evict_leaf": "evict_leaf_fn"},
}


def make_prefix_cache(design: str | PrefixCache, block_size: int, eviction: str = "lru", **seams) -> PrefixCache:
    """"hash", "radix" (a new cache of that design), or a PrefixCache instance (a learner's, say).
    seams: the learner's code the design takes (PREFIX_SEAMS; None: the cache's own)."""
    seams = {k: v for k, v in seams.items() if v is not None}
    takes = PREFIX_SEAMS.get(design, {}) if isinstance(design, str) else {}
    for name in seams:
        if name not in takes:
            owner = next((d for d, t in PREFIX_SEAMS.items() if name in t), None)
            if owner is None:
                raise TypeError(f"no prefix cache takes a seam named {name!r}; the seams are {PREFIX_SEAMS}")
            raise ValueError(f"{name} plugs into the {owner!r} prefix cache; build it with prefix_caching={owner!r} "
                             f"(got {design!r})")
    if isinstance(design, PrefixCache):
        if design.block_size != block_size:
            raise ValueError(f"the prefix cache was built for block_size {design.block_size}, the engine uses "
                             f"{block_size}; build it with the engine's block_size")
        return design
    if not isinstance(design, str) or design not in PREFIX_CACHES:
        names = ", ".join(repr(n) for n in PREFIX_CACHES)
        raise ValueError(f"prefix_caching must be None, {names} (or a PrefixCache), got {design!r}")
    return PREFIX_CACHES[design](block_size, eviction, **{takes[k]: v for k, v in seams.items()})
