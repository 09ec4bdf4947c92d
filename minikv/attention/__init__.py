"""Attention backends behind one interface: naive (rung 1), contiguous (rung 2), paged (rung 4).
Each reads and writes the KV memory it is given (minikv/cache/blocks/pool.py) and builds its own metadata."""
from minikv.attention.base import AttentionBackend
from minikv.attention.contiguous import ContiguousBackend
from minikv.attention.metadata import AttentionMetadata, BatchInputs, ContiguousMetadata, PagedMetadata
from minikv.attention.naive import NaiveBackend
from minikv.attention.paged import PagedBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "BatchInputs", "ContiguousBackend", "ContiguousMetadata",
           "NaiveBackend", "PagedBackend", "PagedMetadata"]
