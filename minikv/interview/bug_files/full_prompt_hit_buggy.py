"""Bug lab: the server stalls when the same prompt comes twice.

Our prefix cache lets a request reuse every cached block of its prompt (below). The first request of
a prompt is fine; when the very same prompt comes again and its length is a multiple of the block
size, the engine stops with "the scheduler could run nothing this step".

Stuck? `minikv bugs hint full-prompt-hit` gives a first hint; `--level 2` a closer one.

    minikv bugs check full-prompt-hit
"""
from minikv.cache.prefix.base import PrefixMatch
from minikv.cache.prefix.hash_chain import HashChainCache


class TeamHashCache(HashChainCache):
    def lookup(self, seq) -> PrefixMatch:
        """What a sequence about to be prefilled can reuse from the cache."""
        if not self.enabled:
            return PrefixMatch()
        return self.match(seq.token_ids, seq.cache_salt)  # every cached block of the prompt


def engine_options() -> dict:
    return {"prefix_caching": TeamHashCache(block_size=4)}
