"""What a store of evicted blocks is (the `kv_offload_store` seam).

A value is what `KVPool.read_blocks` returns for one block: a tuple of tensors, each
[num_layers, block_size, ...]. The store treats it as opaque bytes.
"""
from __future__ import annotations

from typing import Protocol

Value = tuple  # tensors of one block: (k [num_layers, block_size, kv_heads, head_dim], v [...])


class BlockStore(Protocol):
    """What the engine needs of a store of evicted blocks (the `kv_offload_store` seam)."""

    def put(self, key: bytes, value: Value) -> None:
        """A block leaves the pool: keep it (or drop something else, or it) within the budget."""
        ...

    def get(self, key: bytes) -> Value | None:
        """The block stored under `key`, or None. It stays stored (a copy goes back to the pool)."""
        ...

    def __contains__(self, key: bytes) -> bool: ...
