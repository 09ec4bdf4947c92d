"""Drill: causal grouped-query attention over one sequence (10 minutes).

Write causal_attention(q, k, v, scale) -> out

    q     [T, num_heads, head_dim]       queries of one whole sequence
    k, v  [T, num_kv_heads, head_dim]    its keys and values (num_heads is a multiple of num_kv_heads)
    out   [T, num_heads, head_dim]       token i attends to keys 0..i only; query head h reads
                                         kv head h // (num_heads // num_kv_heads)

Scores are q . k * scale (the scale passed in: the hidden cases vary it), softmax over the visible
keys, then the weighted sum of the values.
Example: T = 1 gives out[0, h] = v[0, h // group] for every head h.

Check it with: minikv drill check gqa-attention
"""
import torch


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    raise NotImplementedError("write causal_attention")
