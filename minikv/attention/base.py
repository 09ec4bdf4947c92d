"""The interface every attention backend implements.

A backend owns the KV storage of its rung (none, contiguous rows, or a paged pool) and is called by
every attention layer with that layer's new q/k/v and the step's metadata, passed explicitly.
"""
from __future__ import annotations

from typing import Protocol

import torch

from minikv.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]  this step's new keys (RoPE applied)
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Store this step's K/V where the rung keeps them, then attend."""
        ...
