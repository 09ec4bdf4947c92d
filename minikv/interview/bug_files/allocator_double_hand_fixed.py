"""Fixed: a freed block goes back to exactly one place: under the bump pointer, or the recycled list.
(Freeing a block twice also raises now.)"""
from minikv.cache.blocks.allocator import NoFreeBlocksError


class BumpAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.next = 0
        self.recycled: list[int] = []
        self._free = [True] * num_blocks

    def allocate(self) -> int:
        if self.next < self.num_blocks:
            block = self.next
            self.next += 1
        elif self.recycled:
            block = self.recycled.pop()
        else:
            raise NoFreeBlocksError(f"all {self.num_blocks} blocks are in use")
        self._free[block] = False
        return block

    def free(self, block_id: int) -> None:
        if self._free[block_id]:
            raise RuntimeError(f"block {block_id} freed twice")
        self._free[block_id] = True
        if block_id == self.next - 1:
            self.next -= 1
        else:
            self.recycled.append(block_id)

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self.next + len(self.recycled)


def engine_options() -> dict:
    return {"block_allocator": BumpAllocator}
