"""KV memory and who owns which part of it: the pools that hold the tensors (KVPool: blocks,
RowPool: contiguous rows), the block allocator, the block manager (tables + refcounts), CPU swap
space, and the prefix caches (hashed block chain, radix tree) behind one interface. It never
imports the engine: what it needs of a request is `CachedRequest` (block_table.py)."""
from minikv.cache.allocator import BlockAllocator, FreeListAllocator, NoFreeBlocksError
from minikv.cache.block_manager import BlockManager, copy_on_write_rule
from minikv.cache.block_table import CachedRequest, blocks_needed, slot_mapping
from minikv.cache.hash_chain import HashChainCache
from minikv.cache.pool import KVPool, RowPool
from minikv.cache.prefix_cache import PrefixCache, PrefixMatch
from minikv.cache.prefix_caches import PREFIX_CACHES, make_prefix_cache
from minikv.cache.radix import RadixCache
from minikv.cache.swap import SwapSpace

__all__ = ["KVPool", "RowPool", "BlockAllocator", "FreeListAllocator", "NoFreeBlocksError", "BlockManager",
           "copy_on_write_rule", "CachedRequest", "blocks_needed", "slot_mapping", "SwapSpace",
           "PrefixCache", "PrefixMatch", "HashChainCache", "RadixCache", "PREFIX_CACHES", "make_prefix_cache"]
