"""Bug lab: a burst of requests with a new shared prefix uses far more KV memory than it should.

When many users start with the same new document at once, KV usage jumps as if nothing were shared,
and stays high until those requests finish; a prefix that was cached before the burst is shared as
expected. Our cache's insert is below.

Stuck? `minikv bugs hint duplicate-prefix-blocks` gives a first hint; `--level 2` a closer one.

    minikv bugs check duplicate-prefix-blocks
"""
from minikv.cache.prefix.hash_chain import CachedBlock, HashChainCache


class TeamHashCache(HashChainCache):
    def insert(self, seq) -> dict[int, int]:
        """Offer the sequence's newly full blocks to the cache. Returns {index: cached block} for each
        of its blocks whose content the cache already holds in another block."""
        if not self.enabled:
            return {}
        keys = self._seq_keys.setdefault(seq.seq_id, [])
        for i in range(len(keys), seq.num_computed_tokens // self.block_size):
            parent = keys[-1] if keys else None
            key, toks, extra = self._key(parent, seq.token_ids, i, seq.cache_salt)
            keys.append(key)
            block = seq.block_table[i]
            if key not in self.table and block not in self.by_block:
                now = self.tick()
                self.table[key] = self.by_block[block] = CachedBlock(block, key, parent, toks, extra,
                                                                     seq.cache_salt, now, now)
        return {}


def engine_options() -> dict:
    return {"prefix_caching": TeamHashCache(block_size=4)}
