"""Bug lab: short chats are right, long ones go wrong.

Our decode step reads the cache row in tiles of 8 positions with an online softmax, as a fused kernel
would (plugged in with LLM(..., kv_backend="contiguous", decode_step=...)). Answers to prompts of a few
tokens are right; once the context passes 8 tokens they drift. TILE is the kernel's tile (what fits
in its fast memory): keep it at 8, and keep the tiles (a fix that reads the whole row at once is
another kernel).

Stuck? `minikv bugs hint missing-rescale` gives a first hint; `--level 2` a closer one.

    minikv bugs check missing-rescale
"""
import torch

TILE = 8


def decode_step(q, k_new, v_new, k_cache, v_cache, pos: int, scale: float) -> torch.Tensor:
    k_cache[pos], v_cache[pos] = k_new, v_new
    group = q.shape[0] // k_new.shape[0]
    m = torch.full((q.shape[0],), float("-inf"))  # running max of the scores
    l = torch.zeros(q.shape[0])  # running sum of exp(score - m)
    acc = torch.zeros_like(q, dtype=torch.float32)  # running sum of exp(score - m) * v
    for start in range(0, pos + 1, TILE):
        end = min(start + TILE, pos + 1)
        k = k_cache[start:end].repeat_interleave(group, dim=1).float()  # [n, num_heads, head_dim]
        v = v_cache[start:end].repeat_interleave(group, dim=1).float()
        s = torch.einsum("hd,jhd->hj", q.float(), k) * scale
        m_new = torch.maximum(m, s.max(dim=1).values)
        p = torch.exp(s - m_new[:, None])
        l = l + p.sum(dim=1)
        acc = acc + torch.einsum("hj,jhd->hd", p, v)
        m = m_new
    return (acc / l[:, None]).to(q.dtype)


def engine_options() -> dict:
    return {"decode_step": decode_step}
