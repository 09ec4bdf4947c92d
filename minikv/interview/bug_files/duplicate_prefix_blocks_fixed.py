"""Fixed: a block computed twice in the same step (two requests sharing a new prefix) is swapped for
the copy the cache already holds, and the duplicate goes back to the pool."""
from minikv.cache.prefix.hash_chain import CachedBlock, HashChainCache


class TeamHashCache(HashChainCache):
    def insert(self, seq) -> dict[int, int]:
        if not self.enabled:
            return {}
        keys = self._seq_keys.setdefault(seq.seq_id, [])
        adopt = {}
        for i in range(len(keys), seq.num_computed_tokens // self.block_size):
            parent = keys[-1] if keys else None
            key, toks, extra = self._key(parent, seq.token_ids, i, seq.cache_salt)
            keys.append(key)
            block, entry = seq.block_table[i], self.table.get(key)
            if entry is None:
                if block not in self.by_block:
                    now = self.tick()
                    self.table[key] = self.by_block[block] = CachedBlock(block, key, parent, toks, extra,
                                                                         seq.cache_salt, now, now)
            elif entry.block != block and self._same(entry, parent, toks, extra):
                adopt[i] = entry.block  # the same K/V already cached: use that block, free ours
        return adopt


def engine_options() -> dict:
    return {"prefix_caching": TeamHashCache(block_size=4)}
