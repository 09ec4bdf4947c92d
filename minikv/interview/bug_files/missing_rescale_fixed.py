"""Fixed: when a tile raises the running max, what was summed under the old max is rescaled by
exp(m_old - m_new) before the tile is added."""
import torch

TILE = 8


def decode_step(q, k_new, v_new, k_cache, v_cache, pos, scale):
    k_cache[pos], v_cache[pos] = k_new, v_new
    group = q.shape[0] // k_new.shape[0]
    m = torch.full((q.shape[0],), float("-inf"))
    l = torch.zeros(q.shape[0])
    acc = torch.zeros_like(q, dtype=torch.float32)
    for start in range(0, pos + 1, TILE):
        end = min(start + TILE, pos + 1)
        k = k_cache[start:end].repeat_interleave(group, dim=1).float()
        v = v_cache[start:end].repeat_interleave(group, dim=1).float()
        s = torch.einsum("hd,jhd->hj", q.float(), k) * scale
        m_new = torch.maximum(m, s.max(dim=1).values)
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[:, None])
        l = l * alpha + p.sum(dim=1)
        acc = acc * alpha[:, None] + torch.einsum("hj,jhd->hd", p, v)
        m = m_new
    return (acc / l[:, None]).to(q.dtype)


def engine_options() -> dict:
    return {"decode_step": decode_step}
