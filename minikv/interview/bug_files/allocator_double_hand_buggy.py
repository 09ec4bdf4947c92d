"""Bug lab: under memory pressure the engine crashes with "allocator returned block N, which is still in use".

Our block allocator (plugged in with LLM(..., kv_backend="paged", block_allocator=...)) hands out
never-used blocks from a bump pointer first and keeps freed ones for later. With few requests all is
well; when the pool fills up and requests finish and get preempted, the engine stops with the error
above (and before that, sometimes, answers are wrong).

Stuck? `minikv bugs hint allocator-double-hand` gives a first hint; `--level 2` a closer one.

    minikv bugs check allocator-double-hand
"""
from minikv.cache.blocks.allocator import NoFreeBlocksError


class BumpAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.next = 0  # blocks [next, num_blocks) were never handed out
        self.recycled: list[int] = []  # freed blocks, reused once the bump pointer reaches the end

    def allocate(self) -> int:
        if self.next < self.num_blocks:
            self.next += 1
            return self.next - 1
        if not self.recycled:
            raise NoFreeBlocksError(f"all {self.num_blocks} blocks are in use")
        return self.recycled.pop()

    def free(self, block_id: int) -> None:
        if block_id == self.next - 1:  # the newest block: just move the pointer back
            self.next -= 1
        self.recycled.append(block_id)

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self.next + len(self.recycled)


def engine_options() -> dict:
    return {"block_allocator": BumpAllocator}
