"""Drill: the block hash chain of a prefix cache, with a tenant salt (15 minutes).

1. hash_block(parent, token_ids, extra) -> bytes
       the key of one full block: stable across processes (not Python's hash()), a function of the
       parent key (None for the first block), every token in order, and the extra keys

2. block_hashes(token_ids, block_size, cache_salt=None) -> [key, ...]
       the keys of every FULL block of token_ids, each chained to the previous one's key. The salt
       enters the first block only, as extra = (("cache_salt", cache_salt),); every other block
       (and every block without a salt) has extra = (). A partial last block gets no key.
   Example: 10 tokens, block_size 4 -> 2 keys; k1 = hash_block(k0, tokens[4:8], ())

Check it with: minikv drill check block-hash-chain
"""


def hash_block(parent: bytes | None, token_ids, extra: tuple = ()) -> bytes:
    raise NotImplementedError("write hash_block")


def block_hashes(token_ids: list[int], block_size: int, cache_salt: str | None = None) -> list[bytes]:
    raise NotImplementedError("write block_hashes")
