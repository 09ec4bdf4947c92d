"""The paged KV cache: block allocator, block manager (tables + refcounts), CPU swap space, and the
prefix caches (hashed block chain, radix tree) behind one interface."""
from minikv.cache.allocator import BlockAllocator, FreeListAllocator, NoFreeBlocksError
from minikv.cache.block_manager import BlockManager, blocks_needed
from minikv.cache.hash_chain import HashChainCache
from minikv.cache.prefix_cache import PrefixCache, PrefixMatch
from minikv.cache.radix import RadixCache
from minikv.cache.swap import SwapSpace

__all__ = ["BlockAllocator", "FreeListAllocator", "NoFreeBlocksError", "BlockManager", "blocks_needed", "SwapSpace",
           "PrefixCache", "PrefixMatch", "HashChainCache", "RadixCache"]
