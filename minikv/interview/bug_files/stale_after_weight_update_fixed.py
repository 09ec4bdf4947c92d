"""Fixed: a reset forgets every entry. Cached K/V were computed by the old weights; after an update
no key may lead to them (the blocks go back to the pool empty)."""
from minikv.cache.prefix.base import EvictionQueue
from minikv.cache.prefix.hash_chain import HashChainCache


class TeamHashCache(HashChainCache):
    def _clear(self) -> None:
        self.table.clear()
        self.by_block.clear()
        self.free_queue = EvictionQueue()
        self._seq_keys.clear()


def engine_options() -> dict:
    return {"prefix_caching": TeamHashCache(block_size=4)}
