"""Reference for the lru-block-budget drill: a doubly linked list with sentinels, nodes in a dict."""


class FreeBlockQueue:
    def __init__(self):
        self._links: dict = {"head": [None, "tail"], "tail": ["head", None]}  # node -> [prev, next]

    def append(self, block: int) -> None:
        last = self._links["tail"][0]
        self._links[block] = [last, "tail"]
        self._links[last][1] = block
        self._links["tail"][0] = block

    def remove(self, block: int) -> None:
        if block in ("head", "tail") or block not in self._links:
            raise KeyError(block)
        prev, nxt = self._links.pop(block)
        self._links[prev][1] = nxt
        self._links[nxt][0] = prev

    def popleft(self) -> int:
        first = self._links["head"][1]
        if first == "tail":
            raise IndexError("the free queue is empty")
        self.remove(first)
        return first

    def __len__(self) -> int:
        return len(self._links) - 2

    def __contains__(self, block) -> bool:
        return block not in ("head", "tail") and block in self._links

    def __iter__(self):
        node = self._links["head"][1]
        while node != "tail":
            nxt = self._links[node][1]
            yield node
            node = nxt


def release(block_table, ref_count, queue, is_cached):
    empty = []
    for b in reversed(block_table):
        ref_count[b] -= 1
        if ref_count[b]:
            continue
        if is_cached(b):
            queue.append(b)
        else:
            empty.append(b)
    return empty
