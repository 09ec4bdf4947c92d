"""Prefix caches (rung 6): the blocks of a computed prefix, kept for the next request that shares it.

    base.py         the interface (PrefixCache, PrefixMatch, EvictionQueue)
    hash_chain.py   HashChainCache: one hash per full block, chained over the prefix
    radix.py        RadixCache: a radix tree over token ids
    registry.py     make_prefix_cache: a design by name ("hash", "radix") or a learner's instance
"""
