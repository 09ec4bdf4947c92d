"""Attention backends that run a learner's function inside the engine (the rung 1 and rung 2 seams).

    LLM("smollm2-135m", kv_backend="naive", causal_attention=my_causal_attention)
    LLM("smollm2-135m", kv_backend="contiguous", decode_step=my_decode_step)

The engine keeps doing everything else (the model, the scheduler, the cache rows); only the
attention of each layer goes through the learner's function, one sequence at a time.
"""
from __future__ import annotations

from typing import Callable

import torch

from minikv.attention.metadata import AttentionMetadata, BatchInputs


class CausalAttentionSeam:
    """Rung 1: the learner's `causal_attention(q, k, v, scale)` on each whole sequence of the batch.

        q [L, num_heads, head_dim], k and v [L, num_kv_heads, head_dim]  ->  [L, num_heads, head_dim]
    """

    name = "naive"

    def __init__(self, causal_attention: Callable):
        self.fn = causal_attention

    def prepare_metadata(self, inputs: BatchInputs) -> AttentionMetadata:
        return AttentionMetadata.from_inputs(inputs)

    def forward(self, layer, q, k, v, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.query_lens_list != meta.seq_lens_list:
            raise ValueError("causal_attention needs whole sequences; build the LLM with kv_backend='naive'")
        outs, start = [], 0
        for n in meta.query_lens_list:  # [start, start + n) are this sequence's tokens in the flat batch
            outs.append(self.fn(q[start:start + n], k[start:start + n], v[start:start + n], scale))
            start += n
        return torch.cat(outs).to(q.dtype)


class DecodeStepSeam:
    """Rung 2: the engine's contiguous backend runs the prefill, the learner's
    `decode_step(q, k, v, k_row, v_row, pos, scale)` every decode step, on the engine's own cache rows.

        q [num_heads, head_dim], k and v [num_kv_heads, head_dim]: this token's; k_row / v_row
        [max_len, num_kv_heads, head_dim]: its sequence's row of this layer, written in place at pos
    """

    name = "contiguous"

    def __init__(self, base, decode_step: Callable):
        self.base, self.fn = base, decode_step

    def __getattr__(self, name: str):  # rows, sizes: the engine's backend answers
        return getattr(self.base, name)

    def forward(self, layer, q, k, v, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if not meta.is_decode_only:
            return self.base.forward(layer, q, k, v, meta, scale)
        outs, rows = [], self.base.pool
        for b, row in enumerate(meta.cache_rows.tolist()):  # one new token per sequence
            pos = meta.seq_lens_list[b] - 1
            outs.append(self.fn(q[b], k[b], v[b], rows.k_cache[layer, row], rows.v_cache[layer, row], pos, scale))
        return torch.stack(outs).to(q.dtype)
