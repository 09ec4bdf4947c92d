"""The paged KV cache: block allocator, block manager (tables + refcounts), CPU swap space."""
from minikv.cache.allocator import BlockAllocator, FreeListAllocator, NoFreeBlocksError
from minikv.cache.block_manager import BlockManager, blocks_needed
from minikv.cache.swap import SwapSpace

__all__ = ["BlockAllocator", "FreeListAllocator", "NoFreeBlocksError", "BlockManager", "blocks_needed", "SwapSpace"]
