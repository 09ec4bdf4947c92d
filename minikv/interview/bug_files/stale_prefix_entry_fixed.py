"""Fixed: an evicted block leaves both indexes of the cache, the key table and the block index."""
from minikv.cache.prefix.hash_chain import HashChainCache


class TeamHashCache(HashChainCache):
    def evict(self, num_blocks: int) -> list[int]:
        out = []
        while len(out) < num_blocks and len(self.free_queue):
            block = self.free_queue.pop()
            entry = self.by_block.pop(block)
            del self.table[entry.key]  # else a later lookup of this key returns a block that now holds other K/V
            out.append(block)
        self.num_evicted += len(out)
        return out


def engine_options() -> dict:
    return {"prefix_caching": TeamHashCache(block_size=4)}
