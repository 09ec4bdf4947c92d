"""Attention backends behind one interface: naive (rung 1), contiguous (rung 2), paged (rung 4)."""
from minikv.attention.base import AttentionBackend
from minikv.attention.contiguous import ContiguousBackend
from minikv.attention.metadata import AttentionMetadata
from minikv.attention.naive import NaiveBackend
from minikv.attention.paged import PagedBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "ContiguousBackend", "NaiveBackend", "PagedBackend"]
