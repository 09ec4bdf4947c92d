"""One engine step as tensors (`BatchInputs`), and what each attention backend derives from them.

One step's batch is flattened: the new tokens of B sequences laid end to end.

    tokens:          | seq 0: 5 new | seq 1: 1 new | seq 2: 3 new |
    query_start_loc:  0              5              6              9
    seq_lens:        context length of each sequence AFTER this step (cached + new)

    for sequence b:
      [0, num_computed)          already in the KV cache (written by earlier steps)
      [num_computed, seq_len)    computed this step: its K/V are written, its queries attend

The model runner builds `BatchInputs` once per step; the backend turns them into its metadata
(`backend.prepare_metadata(inputs)`), which the model passes explicitly to every layer (no global
context). A decode step replayed from a CUDA graph copies the same inputs into static buffers first
(minikv/engine/cuda_graph.py). Each rung's metadata carries only its own fields:

    AttentionMetadata    rung 1 (naive) and every backend's common part
    ContiguousMetadata   rung 2: + cache_rows
    PagedMetadata        rungs 4-7: + slot_mapping, block_tables
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class BatchInputs:
    """The tensors of one step, built once by the runner (every tensor on the engine's device).

    Paged engines fill block_tables and slot_mapping, rung 2 fills cache_rows. In a CUDA graph's static
    buffers the per-sequence lengths change with every replay, so there seq_lens_list is None and
    max_seq_len is the longest context any replay may see (max_model_len)."""

    input_ids: torch.Tensor  # [T] the new tokens of every sequence, end to end
    positions: torch.Tensor  # [T] position of each new token in its sequence
    query_start_loc: torch.Tensor  # [B+1] offset of each sequence's first new token
    seq_lens: torch.Tensor  # [B] context length after this step
    query_lens_list: list[int]  # [B] host: new tokens of each sequence
    seq_lens_list: list[int] | None  # [B] host copy of seq_lens (None in a graph's static buffers)
    max_seq_len: int  # host: the longest context this step (a bound, in a graph's static buffers)
    block_tables: torch.Tensor | None = None  # [B, max_blocks] physical block ids, -1 past a sequence's table
    slot_mapping: torch.Tensor | None = None  # [T] physical slot of each new token, -1 = store nothing
    cache_rows: torch.Tensor | None = None  # [B] the contiguous cache row each sequence owns
    logits_indices: torch.Tensor | None = None  # [S] batch index of each sampled sequence's last token

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_list)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_list)


@dataclass(kw_only=True)
class AttentionMetadata:
    """What every attention backend reads: where each sequence's tokens sit in the batch, and how long
    each context is. The torch backends scatter tokens into a padded [B, max_query_len] grid with
    token_seq / token_qpos (see minikv/attention/common.py)."""

    query_start_loc: torch.Tensor  # [B+1] offsets of each sequence's tokens in the batch
    seq_lens: torch.Tensor  # [B] context length after this step
    query_lens_list: list[int]  # host copies, so backends need no device sync
    seq_lens_list: list[int] | None  # None under a CUDA graph (lengths change every replay)
    max_seq_len: int  # host: longest context (under a CUDA graph: the longest any replay may see)
    token_seq: torch.Tensor  # [T] sequence index of each token
    token_qpos: torch.Tensor  # [T] index of each token among its sequence's new tokens
    token_pos: torch.Tensor  # [T] absolute position of each token in its sequence
    step_memo: dict = field(default_factory=dict)  # values a backend derives once per step for every layer

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_list)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_list)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @classmethod
    def from_inputs(cls, inputs: BatchInputs, **fields) -> "AttentionMetadata":
        """Metadata of the runner's batch (vectorized: no loop over tokens), plus this rung's `fields`."""
        return cls._index(inputs.query_lens_list, inputs.seq_lens_list, inputs.query_start_loc, inputs.seq_lens,
                          inputs.positions, inputs.max_seq_len, **fields)

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], device: torch.device | str = "cpu",
              **fields) -> "AttentionMetadata":
        """Metadata for sequences that each add `query_lens[b]` tokens and end at `seq_lens[b]` (for
        tests and notebooks that call a backend without a runner)."""
        if len(query_lens) != len(seq_lens) or not query_lens:
            raise ValueError("query_lens and seq_lens must be non-empty and of equal length")
        if any(q < 1 or q > s for q, s in zip(query_lens, seq_lens)):
            raise ValueError(f"need 1 <= query_len <= seq_len, got {query_lens} / {seq_lens}")
        positions = [p for q, s in zip(query_lens, seq_lens) for p in range(s - q, s)]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        return cls._index(list(query_lens), list(seq_lens), as_long(starts), as_long(seq_lens), as_long(positions),
                          max(seq_lens), **fields)

    @classmethod
    def _index(cls, query_lens: list[int], seq_lens_list: list[int] | None, query_start_loc: torch.Tensor,
               seq_lens: torch.Tensor, positions: torch.Tensor, max_seq_len: int, **fields) -> "AttentionMetadata":
        """The per-token indexes, derived on the device (no copy from the host, no sync)."""
        device, B, T = positions.device, len(query_lens), positions.numel()
        if T == B:  # one new token per sequence (a decode step)
            token_seq = torch.arange(B, device=device)
            token_qpos = torch.zeros(B, dtype=torch.long, device=device)
        else:
            token_seq = torch.repeat_interleave(torch.arange(B, device=device), query_start_loc.diff(), output_size=T)
            token_qpos = torch.arange(T, device=device) - query_start_loc[token_seq]
        return cls(query_start_loc=query_start_loc, seq_lens=seq_lens, query_lens_list=list(query_lens),
                   seq_lens_list=seq_lens_list, max_seq_len=max_seq_len, token_seq=token_seq,
                   token_qpos=token_qpos, token_pos=positions, **fields)


@dataclass(kw_only=True)
class ContiguousMetadata(AttentionMetadata):
    """Rung 2: each sequence reads and writes its own preallocated row."""

    cache_rows: torch.Tensor  # [B] which row of the RowPool each sequence owns


@dataclass(kw_only=True)
class PagedMetadata(AttentionMetadata):
    """Rungs 4-7: each sequence reads its blocks through its block table."""

    slot_mapping: torch.Tensor  # [T] physical slot of each new token (-1: store nothing)
    block_tables: torch.Tensor  # [B, max_blocks] physical block ids, -1 past a sequence's table
