"""Reference for the gqa-attention drill."""
import torch


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    T, H, D = q.shape
    group = H // k.shape[1]
    qg = q.view(T, k.shape[1], group, D)  # query head h = kv head h // group, member h % group
    scores = torch.einsum("ikgd,jkd->kgij", qg, k) * scale  # [kv_heads, group, T, T]
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    weights = scores.masked_fill(future, float("-inf")).softmax(-1)
    return torch.einsum("kgij,jkd->ikgd", weights, v).reshape(T, H, D)
