"""Drill: slot mapping and a block allocator (15 minutes).

1. slot_mapping(block_table, positions, block_size) -> slots
       block_table  [7, 2, 9]   logical block i of the sequence lives in physical block block_table[i]
       positions    [4, 5, 6]   positions whose K/V this step writes
       slots        one int per position: the physical block * block_size + the offset in the block
   Example: block_table [7, 2, 9], block_size 4, positions [4, 5, 6] -> [8, 9, 10]

2. class BlockAllocator:  BlockAllocator(num_blocks)
       .num_blocks                     the pool size
       .allocate() -> int              a free block id in [0, num_blocks); raise
                                       minikv.cache.blocks.allocator.NoFreeBlocksError when none is left
       .free(block_id)                 give it back; freeing a block that is already free must raise
       .num_free_blocks                a property: how many blocks are free
   Every operation O(1).

Check it with: minikv drill check slot-mapping-allocator
"""
from minikv.cache.blocks.allocator import NoFreeBlocksError  # noqa: F401  (raise it when the pool is empty)


def slot_mapping(block_table: list[int], positions: list[int], block_size: int) -> list[int]:
    raise NotImplementedError("write slot_mapping")


class BlockAllocator:
    def __init__(self, num_blocks: int):
        raise NotImplementedError("write BlockAllocator")

    def allocate(self) -> int:
        raise NotImplementedError("write allocate")

    def free(self, block_id: int) -> None:
        raise NotImplementedError("write free")

    @property
    def num_free_blocks(self) -> int:
        raise NotImplementedError("write num_free_blocks")
