"""Bug lab: one tenant's prompt speeds up another tenant's requests.

Every tenant sends a cache_salt so that tenants never share KV blocks. A security review measured
time to first token: when tenant "alice" has sent a long prompt, tenant "bob" gets a faster first
token on a prompt that starts the same way, which leaks what alice asked. Our cache mixes the salt
into block keys as below.

Stuck? `minikv bugs hint salt-last-block` gives a first hint; `--level 2` a closer one.

    minikv bugs check salt-last-block
"""
from minikv.cache.prefix.hash_chain import HashChainCache


class TeamHashCache(HashChainCache):
    def _key(self, parent, token_ids, i: int, salt):
        """The key of full block i of token_ids, chained to its parent's key, and what it hashed."""
        bs = self.block_size
        toks = tuple(token_ids[i * bs:(i + 1) * bs])
        last = len(token_ids) // bs - 1
        extra = (("cache_salt", salt),) if salt is not None and i == last else ()  # salt the request's key
        return self.hash_fn(parent, toks, extra), toks, extra


def engine_options() -> dict:
    return {"prefix_caching": TeamHashCache(block_size=4)}
