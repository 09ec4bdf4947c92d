"""Rung 4: paged KV. All sequences share one pool of fixed-size blocks; a block table maps each
sequence's logical blocks to physical ones, so memory is taken block by block as a sequence grows.

    k_cache: [num_layers, num_blocks, block_size, num_kv_heads, head_dim]   (v_cache the same)

    Storage order (kv_layout), the same indexing either way:
      "nhd"  token-major: a slot's kv_heads x head_dim values side by side (one row per token)
      "hnd"  head-major: each KV head's block_size x head_dim values side by side (stored as
             [layers, blocks, kv_heads, block_size, head_dim], seen through a transposed view), so a
             kernel reading one KV head streams whole blocks instead of rows num_kv_heads apart

    sequence's block_table = [7, 2, 9]     block_size = 4,  seq_len = 10
    position:   0 1 2 3 | 4 5 6 7 | 8 9 . .
    physical:   block 7 | block 2 | block 9 (2 slots still free)
    slot of position p = block_table[p // block_size] * block_size + p % block_size

This torch version is the reference the Triton kernels are checked against: it writes the new K/V
through the slot mapping, gathers each sequence's blocks into a padded [B, L] view and runs one
masked attention over the whole flattened batch (prefill and decode mixed, no loop over sequences).
"""
from __future__ import annotations

import torch

from minikv.attention.common import attend
from minikv.attention.metadata import AttentionMetadata


KV_LAYOUTS = ("nhd", "hnd")


def new_pool(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device, kv_layout="nhd"):
    """A zeroed pool indexed [layer, block, slot, kv_head, dim], stored in kv_layout's order."""
    if kv_layout == "hnd":
        stored = torch.zeros(num_layers, num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype, device=device)
        return stored.transpose(2, 3)
    return torch.zeros(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)


class PagedBackend:
    name = "paged"

    kv_layout = "nhd"  # storage order of the pool (see above); rung 4 keeps a token's heads together

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device, sliding_window: int | None = None, kv_layout: str | None = None):
        self.kv_layout = kv_layout or self.kv_layout
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout {self.kv_layout!r} is not one of {KV_LAYOUTS}")
        self.k_cache = new_pool(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device,
                                self.kv_layout)
        self.v_cache = new_pool(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device,
                                self.kv_layout)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.sliding_window = sliding_window

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K and V of one block over all layers."""
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block dst gets block src's K and V in every layer (done before the forward)."""
        src = torch.tensor([s for s, _ in pairs], device=self.k_cache.device)
        dst = torch.tensor([d for _, d in pairs], device=self.k_cache.device)
        self.k_cache[:, dst] = self.k_cache[:, src]
        self.v_cache[:, dst] = self.v_cache[:, src]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write this step's K/V [T, num_kv_heads, head_dim] into their physical slots."""
        block, offset = slot_mapping // self.block_size, slot_mapping % self.block_size
        self.k_cache[layer][block, offset] = k
        self.v_cache[layer][block, offset] = v

    def gather(self, layer: int, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's K/V read through its block table: [B, max_seq_len, num_kv_heads, head_dim]."""
        tables = meta.block_tables.clamp(min=0)  # -1 = no block; those positions are masked anyway
        B, nb = tables.shape
        L = meta.max_seq_len
        keys = self.k_cache[layer][tables].reshape(B, nb * self.block_size, *self.k_cache.shape[3:])[:, :L]
        values = self.v_cache[layer][tables].reshape(B, nb * self.block_size, *self.v_cache.shape[3:])[:, :L]
        return keys, values

    def forward(self, layer, q, k, v, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self.store(layer, k, v, meta.slot_mapping)
        keys, values = self.gather(layer, meta)
        return attend(q, keys, values, meta, scale, self.sliding_window)
