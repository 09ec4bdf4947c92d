"""Reference for the block-hash-chain drill."""
import hashlib
import struct


def hash_block(parent, token_ids, extra=()):
    h = hashlib.sha256()
    h.update(b"root" if parent is None else b"p" + parent)
    h.update(struct.pack(f"<{len(token_ids)}q", *(int(t) for t in token_ids)))  # 8 bytes per id: unambiguous
    h.update(repr(tuple(extra)).encode())
    return h.digest()


def block_hashes(token_ids, block_size, cache_salt=None):
    keys = []
    for i in range(len(token_ids) // block_size):
        extra = (("cache_salt", cache_salt),) if i == 0 and cache_salt is not None else ()
        keys.append(hash_block(keys[-1] if keys else None, tuple(token_ids[i * block_size:(i + 1) * block_size]),
                               extra))
    return keys
