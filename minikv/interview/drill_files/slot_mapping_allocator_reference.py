"""Reference for the slot-mapping-allocator drill."""
from minikv.cache.blocks.allocator import NoFreeBlocksError


def slot_mapping(block_table, positions, block_size):
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


class BlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._stack = list(range(num_blocks))[::-1]  # allocate pops from the end: block 0 first
        self._free = [True] * num_blocks

    def allocate(self) -> int:
        if not self._stack:
            raise NoFreeBlocksError(f"all {self.num_blocks} blocks are in use")
        b = self._stack.pop()
        self._free[b] = False
        return b

    def free(self, block_id: int) -> None:
        if self._free[block_id]:
            raise RuntimeError(f"block {block_id} is already free")
        self._free[block_id] = True
        self._stack.append(block_id)

    @property
    def num_free_blocks(self) -> int:
        return len(self._stack)
