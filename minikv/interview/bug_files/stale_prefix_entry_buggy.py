"""Bug lab: a returning user gets a wrong answer after the cache was under pressure.

Our team's prefix cache is a HashChainCache with its own eviction (below). Users report that a
prompt they sent an hour ago now gets a different answer, but only on a busy server; restarting
the server fixes it for a while. Now and then the server also stops with
`RuntimeError: block N is free; cannot share it` (the block manager refusing a cache hit on a block
that holds nothing): same bug, other luck. A fix must keep the cache useful: a returning prompt
whose blocks are still cached must hit them. Keep the fix in TeamHashCache.

Stuck? `minikv bugs hint stale-prefix-entry` gives a first hint; `--level 2` a closer one.

    minikv bugs check stale-prefix-entry          checks this file
"""
from minikv.cache.prefix.hash_chain import HashChainCache


class TeamHashCache(HashChainCache):
    def evict(self, num_blocks: int) -> list[int]:
        """Forget up to num_blocks unused cached blocks, least recently used first; return them (now empty)."""
        out = []
        while len(out) < num_blocks and len(self.free_queue):
            block = self.free_queue.pop()
            self.by_block.pop(block)  # the block leaves the cache: it goes back to the pool empty
            out.append(block)
        self.num_evicted += len(out)
        return out


def engine_options() -> dict:
    """What this lab plugs into LLM(tiny-random, kv_backend="paged", block_size=4, ...)."""
    return {"prefix_caching": TeamHashCache(block_size=4)}
