"""Bug lab: the server stalls when the same prompt comes twice.

Our prefix cache lets a request reuse every cached block of its prompt (below). The first request of
a prompt is fine; when the very same prompt comes again and its length is a multiple of the block
size, the engine stops with "the scheduler could run nothing this step".

Localize it: print llm.prefix_cache.match(ids) and the sequence's num_computed_tokens against its
num_tokens when it is admitted (llm.add_observer with an on_schedule hook shows the batch of every
step); ask what the first output token is computed from. Then fix the code below.

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
