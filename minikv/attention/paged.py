"""Rung 4: paged KV. All sequences share one pool of fixed-size blocks (the KVPool of
minikv/cache/blocks/pool.py); a block table maps each sequence's logical blocks to physical ones, so memory
is taken block by block as a sequence grows.

    pool.k_cache: [num_layers, num_blocks, block_size, num_kv_heads, head_dim]   (v_cache the same)

    sequence's block_table = [7, 2, 9]     block_size = 4,  seq_len = 10
    position:   0 1 2 3 | 4 5 6 7 | 8 9 . .
    physical:   block 7 | block 2 | block 9 (2 slots still free)
    slot of position p = block_table[p // block_size] * block_size + p % block_size

This torch version is the reference the Triton kernels are checked against: it writes the new K/V
through the slot mapping, gathers each sequence's blocks into a padded [B, L] view and runs one
masked attention over the whole flattened batch (prefill and decode mixed, no loop over sequences).
On a quantized pool (minikv/cache/blocks/quant.py) the store quantizes and the gather dequantizes
(q * scale + zero): the attention itself runs on K/V in the model's dtype.
"""
from __future__ import annotations

import torch

from minikv.attention.common import attend
from minikv.attention.metadata import BatchInputs, PagedMetadata
from minikv.cache.blocks.pool import KVPool
from minikv.cache.blocks.quant import dequantize_block


class PagedBackend:
    name = "paged"

    def __init__(self, pool: KVPool, sliding_window: int | None = None, sink_tokens: int = 0):
        self.pool = pool
        self.sliding_window = sliding_window
        self.sink_tokens = sink_tokens if sliding_window else 0  # StreamingLLM's sinks: [0, sink_tokens) stay seen

    def prepare_metadata(self, inputs: BatchInputs) -> PagedMetadata:
        return PagedMetadata.from_inputs(inputs, slot_mapping=inputs.slot_mapping, block_tables=inputs.block_tables)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write this step's K/V [T, num_kv_heads, head_dim] into their physical slots."""
        self.pool.store(layer, k, v, slot_mapping)

    def gather(self, layer: int, meta: PagedMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's K/V read through its block table: [B, max_seq_len, num_kv_heads, head_dim]."""
        k_cache, v_cache = self.pool.layer(layer)  # [num_blocks, block_size, num_kv_heads, head_dim]
        tables = meta.block_tables.clamp(min=0)  # -1 = no block (past the table, or given back outside
        # every window): those positions are masked anyway
        B, nb = tables.shape
        L = meta.max_seq_len
        keys = k_cache[tables].reshape(B, nb * self.pool.block_size, *k_cache.shape[2:])[:, :L]
        values = v_cache[tables].reshape(B, nb * self.pool.block_size, *v_cache.shape[2:])[:, :L]
        if self.pool.quantized:  # scales [num_blocks, block_size, num_kv_heads], read through the same tables
            k_scale, v_scale = self.pool.layer_scales(layer)
            ks = k_scale[tables].reshape(B, nb * self.pool.block_size, -1)[:, :L]
            vs = v_scale[tables].reshape(B, nb * self.pool.block_size, -1)[:, :L]
            kz, vz = self.pool.layer_zeros(layer)  # int8's zero points (None on fp8), read the same way
            if kz is not None:
                kz = kz[tables].reshape(B, nb * self.pool.block_size, -1)[:, :L]
                vz = vz[tables].reshape(B, nb * self.pool.block_size, -1)[:, :L]
            keys = dequantize_block(keys, ks, kz, self.pool.dtype)
            values = dequantize_block(values, vs, vz, self.pool.dtype)
        return keys, values

    def forward(self, layer, q, k, v, meta: PagedMetadata, scale: float) -> torch.Tensor:
        self.store(layer, k, v, meta.slot_mapping)
        keys, values = self.gather(layer, meta)
        return attend(q, keys, values, meta, scale, self.sliding_window, self.sink_tokens)
