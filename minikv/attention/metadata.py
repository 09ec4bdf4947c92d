"""The batch metadata every attention backend receives, passed explicitly (no global context).

One step's batch is flattened: the new tokens of B sequences laid end to end.

    tokens:          | seq 0: 5 new | seq 1: 1 new | seq 2: 3 new |
    query_start_loc:  0              5              6              9
    seq_lens:        context length of each sequence AFTER this step (cached + new)

    for sequence b:
      [0, num_computed)          already in the KV cache (written by earlier steps)
      [num_computed, seq_len)    computed this step: its K/V are written, its queries attend
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [B+1] int64 offsets of each sequence's tokens in the batch
    seq_lens: torch.Tensor  # [B] context length after this step
    query_lens_list: list[int]  # host copies, so backends need no device sync
    seq_lens_list: list[int]
    slot_mapping: torch.Tensor | None = None  # [T] paged: physical slot of each new token
    block_tables: torch.Tensor | None = None  # [B, max_blocks] paged: physical block ids, -1 = none
    cache_rows: torch.Tensor | None = None  # [B] contiguous: which preallocated row each sequence owns
    # derived per-token indexes, built once per step and shared by every layer
    token_seq: torch.Tensor | None = None  # [T] sequence index of each token
    token_qpos: torch.Tensor | None = None  # [T] index of each token among its sequence's new tokens
    token_pos: torch.Tensor | None = None  # [T] absolute position of each token in its sequence
    cache: dict = field(default_factory=dict)  # per-step values backends derive once for all layers

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_list)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_list)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        device: torch.device | str = "cpu",
        **extra,
    ) -> "AttentionMetadata":
        """Metadata for sequences that each add `query_lens[b]` tokens and end at `seq_lens[b]`."""
        if len(query_lens) != len(seq_lens) or not query_lens:
            raise ValueError("query_lens and seq_lens must be non-empty and of equal length")
        if any(q < 1 or q > s for q, s in zip(query_lens, seq_lens)):
            raise ValueError(f"need 1 <= query_len <= seq_len, got {query_lens} / {seq_lens}")
        seq_idx, qpos, pos = [], [], []
        for b, (q, s) in enumerate(zip(query_lens, seq_lens)):
            seq_idx += [b] * q
            qpos += range(q)
            pos += range(s - q, s)
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        return cls(
            query_start_loc=as_long(starts),
            seq_lens=as_long(seq_lens),
            query_lens_list=list(query_lens),
            seq_lens_list=list(seq_lens),
            token_seq=as_long(seq_idx),
            token_qpos=as_long(qpos),
            token_pos=as_long(pos),
            **extra,
        )
