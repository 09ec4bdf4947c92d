"""Rung 2: a contiguous KV cache. Each request owns one preallocated row of max_len positions:

    k_cache[layer]: [num_rows, max_len, num_kv_heads, head_dim]
    row r:  [0, seq_len)         filled: prompt, then one token per decode step
            [seq_len, max_len)   reserved for this request whether it is ever used or not

Prefill writes the prompt's K/V at once; each decode step writes one position and attends over
the row. The reservation up front is what paged KV (rung 4) removes.
"""
from __future__ import annotations

import torch

from minikv.attention.common import attend
from minikv.attention.metadata import AttentionMetadata


class ContiguousBackend:
    name = "contiguous"

    def __init__(self, num_layers: int, num_rows: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device, sliding_window: int | None = None):
        shape = (num_layers, num_rows, max_len, num_kv_heads, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.sliding_window = sliding_window
        self.free_rows = list(range(num_rows))

    @property
    def bytes_reserved(self) -> int:
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    def allocate_row(self) -> int:
        if not self.free_rows:
            raise RuntimeError(f"all {self.k_cache.shape[1]} cache rows are in use; free one first")
        return self.free_rows.pop(0)

    def free_row(self, row: int) -> None:
        if row in self.free_rows:
            raise RuntimeError(f"cache row {row} freed twice")
        self.free_rows.append(row)

    def forward(self, layer, q, k, v, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.max_seq_len > self.max_len:
            raise ValueError(f"sequence reached {meta.max_seq_len} tokens but cache rows hold {self.max_len}")
        rows = meta.cache_rows
        self.k_cache[layer, rows[meta.token_seq], meta.token_pos] = k
        self.v_cache[layer, rows[meta.token_seq], meta.token_pos] = v
        L = meta.max_seq_len
        keys = self.k_cache[layer, rows, :L]  # [B, L, num_kv_heads, head_dim]
        values = self.v_cache[layer, rows, :L]
        return attend(q, keys, values, meta, scale, self.sliding_window)
