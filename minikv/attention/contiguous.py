"""Rung 2: a contiguous KV cache. Each request owns one preallocated row of max_len positions
(the RowPool of minikv/cache/blocks/pool.py):

    k_cache[layer]: [num_rows, max_len, num_kv_heads, head_dim]
    row r:  [0, seq_len)         filled: prompt, then one token per decode step
            [seq_len, max_len)   reserved for this request whether it is ever used or not

Prefill writes the prompt's K/V at once; each decode step writes one position and attends over
the row. The reservation up front is what paged KV (rung 4) removes.
"""
from __future__ import annotations

import torch

from minikv.attention.common import attend
from minikv.attention.metadata import BatchInputs, ContiguousMetadata
from minikv.cache.blocks.pool import RowPool


class ContiguousBackend:
    name = "contiguous"

    def __init__(self, pool: RowPool, sliding_window: int | None = None):
        self.pool = pool
        self.sliding_window = sliding_window

    def prepare_metadata(self, inputs: BatchInputs) -> ContiguousMetadata:
        return ContiguousMetadata.from_inputs(inputs, cache_rows=inputs.cache_rows)

    def forward(self, layer, q, k, v, meta: ContiguousMetadata, scale: float) -> torch.Tensor:
        if meta.max_seq_len > self.pool.max_len:
            raise ValueError(f"sequence reached {meta.max_seq_len} tokens but cache rows hold {self.pool.max_len}")
        rows, k_cache, v_cache = meta.cache_rows, self.pool.k_cache[layer], self.pool.v_cache[layer]
        slots = self.slots(meta)  # one index into the layer seen flat: index_copy_, cheaper than two indexes
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v)
        L = meta.max_seq_len
        keys = k_cache[:, :L].index_select(0, rows)  # [B, L, num_kv_heads, head_dim]
        values = v_cache[:, :L].index_select(0, rows)
        return attend(q, keys, values, meta, scale, self.sliding_window)

    def slots(self, meta: ContiguousMetadata) -> torch.Tensor:
        """[T] where each new token goes in a layer's rows seen flat (computed once per step):

            k_cache[layer]  [num_rows, max_len, ...]  ->  [num_rows * max_len, ...]
            row r, position p                         ->  r * max_len + p
        """
        if "slots" not in meta.step_memo:
            meta.step_memo["slots"] = meta.cache_rows[meta.token_seq] * self.pool.max_len + meta.token_pos
        return meta.step_memo["slots"]
