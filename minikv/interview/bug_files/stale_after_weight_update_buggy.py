"""Bug lab: after a weight update the server answers like the old model on some prompts.

An RL loop updates the model's weights in place every few minutes and then calls
llm.reset_prefix_cache(), as the docs say. Prompts never seen before get the new model's answers;
prompts that were cached before the update still get the old model's. Our cache keeps itself
"warm" across resets (below).

Stuck? `minikv bugs hint stale-after-weight-update` gives a first hint; `--level 2` a closer one.

    minikv bugs check stale-after-weight-update
"""
from minikv.cache.prefix.base import EvictionQueue
from minikv.cache.prefix.hash_chain import HashChainCache


class TeamHashCache(HashChainCache):
    def _clear(self) -> None:
        """Called by reset_prefix_cache once no request holds a block."""
        self.free_queue = EvictionQueue()  # drop the eviction order and the requests' progress ...
        self._seq_keys.clear()  # ... but keep the table, so the next requests still hit


def engine_options() -> dict:
    return {"prefix_caching": TeamHashCache(block_size=4)}
