"""Rung 1: no cache. Every step feeds the whole sequence again, so step n costs O(n^2) attention
and O(n) projections: quadratic total work for one generated sequence."""
from __future__ import annotations

import torch

from minikv.attention.common import attend
from minikv.attention.metadata import AttentionMetadata, BatchInputs


class NaiveBackend:
    name = "naive"

    def __init__(self, sliding_window: int | None = None):
        self.sliding_window = sliding_window

    def prepare_metadata(self, inputs: BatchInputs) -> AttentionMetadata:
        return AttentionMetadata.from_inputs(inputs)

    def forward(self, layer, q, k, v, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.query_lens_list != meta.seq_lens_list:
            raise ValueError("the naive backend keeps no cache: every step must feed whole sequences")
        B, L = meta.num_seqs, meta.max_query_len
        keys = k.new_zeros(B, L, *k.shape[1:])
        values = v.new_zeros(B, L, *v.shape[1:])
        keys[meta.token_seq, meta.token_qpos] = k
        values[meta.token_seq, meta.token_qpos] = v
        return attend(q, keys, values, meta, scale, self.sliding_window)
