"""Drill: KV cache append + one decode step (15 minutes).

Write decode_step(q, k_new, v_new, k_cache, v_cache, pos, scale) -> out

    q             [num_heads, head_dim]              the new token's query; the token sits at position pos
    k_new, v_new  [num_kv_heads, head_dim]           its key and value
    k_cache       [max_len, num_kv_heads, head_dim]  one request's cache row (v_cache the same):
                  [0, pos)         written by earlier steps
                  [pos]            write k_new / v_new here, in place
                  (pos, max_len)   stale numbers of an earlier request: never read them
    out           [num_heads, head_dim]              attention of q over positions 0..pos

GQA: query head h reads kv head h // (num_heads // num_kv_heads). Use the scale passed in (the engine
passes 1 / sqrt(head_dim); some models pass others: the hidden cases vary it).

Check it with: minikv drill check kv-decode-step
"""
import torch


def decode_step(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, pos: int, scale: float) -> torch.Tensor:
    raise NotImplementedError("write decode_step")
