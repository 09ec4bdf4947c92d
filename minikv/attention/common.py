"""Attention over a padded [B, L] view of each sequence's keys: the math every torch backend shares."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from minikv.attention.metadata import AttentionMetadata


def attend(
    q: torch.Tensor,  # [T, num_heads, head_dim]  the flattened new tokens
    keys: torch.Tensor,  # [B, L, num_kv_heads, head_dim]  key at position j of sequence b is keys[b, j]
    values: torch.Tensor,  # [B, L, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    sink_tokens: int = 0,
) -> torch.Tensor:
    """Causal attention of each new token over its own sequence's positions [0, its position]
    (with a sliding window: the last `sliding_window` of them, plus the first `sink_tokens`).

    The queries are scattered into a padded [B, max_query_len] grid, one masked SDPA call runs
    over all sequences at once (no Python loop), and the result is gathered back to [T, ...]. When
    every sequence runs the same number of new tokens (one prompt, a batch of equal chunks), the
    flat batch already is that grid, seen as [B, max_query_len, ...]: nothing to scatter or gather.

    A decode step (one query per sequence) goes further: the `group` query heads that share a KV
    head become that head's query rows, so the keys are read as they are, not repeated per q head,

        q [B, num_heads, head_dim]  ->  [B, num_kv_heads, group, head_dim]    q head h = kv * group + g
    """
    T, num_heads, head_dim = q.shape
    B, L, num_kv_heads, _ = keys.shape
    max_q = meta.max_query_len
    mask = causal_mask(meta, L, sliding_window, sink_tokens)
    group = num_heads // num_kv_heads  # grouped-query attention: each KV head serves `group` q heads
    if max_q == 1:  # T == B, token b is sequence b's
        out = F.scaled_dot_product_attention(
            q.reshape(B, num_kv_heads, group, head_dim), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=mask[:, None], scale=scale)  # [B, num_kv_heads, group, head_dim]
        return out.reshape(T, num_heads, head_dim)
    padded = T < B * max_q
    if padded:
        q_pad = q.new_zeros(B, max_q, num_heads, head_dim)
        q_pad[meta.token_seq, meta.token_qpos] = q
    else:  # sequence b's tokens are [b * max_q, (b + 1) * max_q) of the batch
        q_pad = q.reshape(B, max_q, num_heads, head_dim)
    k = keys.transpose(1, 2).repeat_interleave(group, dim=1)  # [B, num_heads, L, head_dim]
    v = values.transpose(1, 2).repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2), k, v, attn_mask=mask[:, None], scale=scale
    ).transpose(1, 2)  # [B, max_q, num_heads, head_dim]
    return out[meta.token_seq, meta.token_qpos] if padded else out.reshape(T, num_heads, head_dim)


def causal_mask(meta: AttentionMetadata, L: int, sliding_window: int | None, sink_tokens: int = 0) -> torch.Tensor:
    """[B, max_query_len, L] bool: may padded query (b, i) see key position j? Built once per step
    and reused by every layer. With a sliding window W and S sink tokens (StreamingLLM), the query
    at position p sees

        [0, S)  the sinks          and          (p - W, p]  its window      (j <= p always)
    """
    key = ("causal_mask", L, sliding_window, sink_tokens)
    if key not in meta.step_memo:
        B, max_q = meta.num_seqs, meta.max_query_len
        # absolute position of each padded query; padding rows see position 0 only (never NaN)
        q_pos = torch.zeros(B, max_q, dtype=torch.long, device=meta.token_pos.device)
        q_pos[meta.token_seq, meta.token_qpos] = meta.token_pos
        k_pos = torch.arange(L, device=q_pos.device)
        mask = k_pos[None, None, :] <= q_pos[:, :, None]  # causal, which also keeps j < seq_len
        if sliding_window is not None:
            in_window = k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
            mask &= in_window | (k_pos < sink_tokens)[None, None, :]
        meta.step_memo[key] = mask
    return meta.step_memo[key]
