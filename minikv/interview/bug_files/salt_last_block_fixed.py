"""Fixed: the salt enters the FIRST block's key; every later key inherits it through its parent, so
no block of one tenant's chain can match another tenant's."""
from minikv.cache.prefix.hash_chain import HashChainCache


class TeamHashCache(HashChainCache):
    def _key(self, parent, token_ids, i: int, salt):
        bs = self.block_size
        toks = tuple(token_ids[i * bs:(i + 1) * bs])
        extra = (("cache_salt", salt),) if salt is not None and i == 0 else ()
        return self.hash_fn(parent, toks, extra), toks, extra


def engine_options() -> dict:
    return {"prefix_caching": TeamHashCache(block_size=4)}
