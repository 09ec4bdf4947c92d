"""Bug lab: the naive engine disagrees with Hugging Face on every prompt longer than one token.

Our causal attention (plugged in with LLM(..., kv_backend="naive", causal_attention=...)) is below.
A one-token prompt gets the right first token; any longer prompt gets another one (and the naive
engine, with no cache, runs every later token over a longer sequence, so those drift too).
Training-style loss on a sentence is suspiciously low.

Stuck? `minikv bugs hint causal-mask-peek` gives a first hint; `--level 2` a closer one.

    minikv bugs check causal-mask-peek
"""
import torch


def causal_attention(q, k, v, scale: float) -> torch.Tensor:
    """q [T, num_heads, head_dim], k, v [T, num_kv_heads, head_dim] -> [T, num_heads, head_dim]."""
    T, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("ihd,jhd->hij", q, k) * scale
    future = torch.ones(T, T, dtype=torch.bool).triu(diagonal=2)  # keys after the query
    scores = scores.masked_fill(future, float("-inf"))
    return torch.einsum("hij,jhd->ihd", scores.softmax(dim=-1), v)


def engine_options() -> dict:
    return {"causal_attention": causal_attention}
