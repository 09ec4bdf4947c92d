"""Bug lab: the contiguous engine's answers drift from the first generated token on.

Our decode step (plugged in with LLM(..., kv_backend="contiguous", decode_step=...)) is below. The
first output token is right (it comes from the prefill), every later one may be wrong, and the
answers change when the server ran a longer request in the same cache row before.

Stuck? `minikv bugs hint decode-reads-past-len` gives a first hint; `--level 2` a closer one.

    minikv bugs check decode-reads-past-len
"""
import torch


def decode_step(q, k_new, v_new, k_cache, v_cache, pos: int, scale: float) -> torch.Tensor:
    """q [num_heads, head_dim] of the token at position pos; k_cache, v_cache [max_len, num_kv_heads, head_dim]."""
    k_cache[pos], v_cache[pos] = k_new, v_new
    group = q.shape[0] // k_new.shape[0]
    seq_len = pos + 1
    keys = k_cache[: seq_len + 1].repeat_interleave(group, dim=1)  # the sequence so far
    values = v_cache[: seq_len + 1].repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,jhd->hj", q, keys) * scale
    return torch.einsum("hj,jhd->hd", scores.softmax(dim=-1), values)


def engine_options() -> dict:
    return {"decode_step": decode_step}
