"""Bug lab: after a weight update the server answers like the old model on some prompts.

An RL loop updates the model's weights in place every few minutes and then calls
llm.reset_prefix_cache(), as the docs say. Prompts never seen before get the new model's answers;
prompts that were cached before the update still get the old model's. Our cache keeps itself
"warm" across resets (below).

Localize it: after the update and the reset, print llm.prefix_cache.stats() (cached blocks, hits)
and the num_cached_tokens of the next request; compare with an engine built on the new weights with
prefix_caching=None; call llm.block_manager.check([]) after the reset. Then fix the code below.

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
