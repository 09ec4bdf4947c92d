"""Drill: an LRU budget of cached KV blocks (30 minutes).

A prefix cache keeps the blocks of finished requests; unused ones wait in a free queue and the least
recently used is evicted first when the pool needs an empty block.

1. class FreeBlockQueue:            unused cached blocks, least recently used first; every operation O(1)
       append(block)                the block joins at the most recently used end
       remove(block)                a cache hit takes it out from wherever it is; KeyError if absent
       popleft() -> block           the least recently used one (to evict); IndexError if empty
       __len__, __contains__, __iter__   (iteration: least recently used first)

2. release(block_table, ref_count, queue, is_cached) -> [empty blocks]
       a request finished: drop its reference to each of its blocks, LAST block first. A block nobody
       holds any more (ref_count 0) joins the queue when is_cached(block), else it goes back empty:
       return those, in the order released.
   Example: table [4, 7, 2], ref_count 1 each, 4 and 7 cached -> queue gets 7 then 4, returns [2].

Check it with: minikv drill check lru-block-budget   (a timing test tells an O(1) remove from a scan)
"""


class FreeBlockQueue:
    def __init__(self):
        raise NotImplementedError("write FreeBlockQueue")

    def append(self, block: int) -> None:
        raise NotImplementedError("write append")

    def remove(self, block: int) -> None:
        raise NotImplementedError("write remove")

    def popleft(self) -> int:
        raise NotImplementedError("write popleft")

    def __len__(self) -> int:
        raise NotImplementedError("write __len__")

    def __contains__(self, block: int) -> bool:
        raise NotImplementedError("write __contains__")

    def __iter__(self):
        raise NotImplementedError("write __iter__")


def release(block_table: list[int], ref_count: list[int], queue: FreeBlockQueue, is_cached) -> list[int]:
    raise NotImplementedError("write release")
