"""The interface every attention backend implements.

A backend reads and writes the KV memory of its rung (none, a RowPool, or a KVPool from
minikv/cache/blocks/pool.py; it never owns those tensors), builds its own metadata from the runner's
`BatchInputs`, and is called by every attention layer with that layer's new q/k/v and the metadata,
passed explicitly.

    runner:  inputs = BatchInputs(...)                  once per step, the same for every backend
             meta = backend.prepare_metadata(inputs)    the backend's own metadata class
    model:   out = backend.forward(layer, q, k, v, meta, scale)   in every layer

A decode step replayed from a CUDA graph (minikv/engine/cuda_graph.py) calls prepare_metadata on
the graph's static inputs, so a backend whose metadata only views (or derives on the device from)
its inputs can be captured as it is.
"""
from __future__ import annotations

from typing import Protocol

import torch

from minikv.attention.metadata import AttentionMetadata, BatchInputs


class AttentionBackend(Protocol):
    name: str

    def prepare_metadata(self, inputs: BatchInputs) -> AttentionMetadata:
        """This backend's metadata for one step (built once, read by every layer)."""
        ...

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
