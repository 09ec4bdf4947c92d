"""Build a prefix cache by name: `LLM(prefix_caching="hash" | "radix" | a PrefixCache)`.

    base.py           the interface (PrefixCache, PrefixMatch, EvictionQueue); imports no design
    hash_chain.py     HashChainCache(PrefixCache)      both import the interface,
    radix.py          RadixCache(PrefixCache)          never each other
    registry.py       the registry below                imports the designs, nobody imports it back
"""
from __future__ import annotations

from minikv.cache.prefix.hash_chain import HashChainCache
from minikv.cache.prefix.base import PrefixCache
from minikv.cache.prefix.radix import RadixCache

PREFIX_CACHES: dict[str, type[PrefixCache]] = {"hash": HashChainCache, "radix": RadixCache}


def make_prefix_cache(design: str | PrefixCache, block_size: int, eviction: str = "lru") -> PrefixCache:
    """"hash", "radix" (a new cache of that design), or a PrefixCache instance (a learner's, say)."""
    if isinstance(design, PrefixCache):
        if design.block_size != block_size:
            raise ValueError(f"the prefix cache was built for block_size {design.block_size}, the engine uses "
                             f"{block_size}; build it with the engine's block_size")
        return design
    if not isinstance(design, str) or design not in PREFIX_CACHES:
        names = ", ".join(repr(n) for n in PREFIX_CACHES)
        raise ValueError(f"prefix_caching must be None, {names} (or a PrefixCache), got {design!r}")
    return PREFIX_CACHES[design](block_size, eviction)
