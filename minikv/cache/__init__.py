"""KV memory and who owns which part of it, one floor per subsystem:

    blocks/            the pools that hold the tensors (KVPool: blocks, RowPool: contiguous rows), the
                       block allocator, block tables, CPU swap space, quantized storage, the window rule
    prefix/            the prefix caches (hashed block chain, radix tree) behind one interface
    tiers/             the offload tiers below the pool (CPU memory, disk) and the loads back from them
    block_manager.py   tables + refcounts over the three: the one place they meet

It never imports the engine: what it needs of a request is `CachedRequest` (blocks/block_table.py)."""
from minikv.cache.block_manager import BlockManager, copy_on_write_rule
from minikv.cache.blocks.allocator import BlockAllocator, FreeListAllocator, NoFreeBlocksError
from minikv.cache.blocks.block_table import CachedRequest, blocks_needed, slot_mapping
from minikv.cache.blocks.pool import KVPool, RowPool
from minikv.cache.blocks.swap import SwapSpace
from minikv.cache.prefix.base import PrefixCache, PrefixMatch
from minikv.cache.prefix.hash_chain import HashChainCache
from minikv.cache.prefix.radix import RadixCache
from minikv.cache.prefix.registry import PREFIX_CACHES, make_prefix_cache

__all__ = ["KVPool", "RowPool", "BlockAllocator", "FreeListAllocator", "NoFreeBlocksError", "BlockManager",
           "copy_on_write_rule", "CachedRequest", "blocks_needed", "slot_mapping", "SwapSpace",
           "PrefixCache", "PrefixMatch", "HashChainCache", "RadixCache", "PREFIX_CACHES", "make_prefix_cache"]
