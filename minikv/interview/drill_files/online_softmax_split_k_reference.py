"""Reference for the online-softmax-split-k drill."""
import torch


def online_step(q, k, v, m, l, acc, scale):
    s = q @ k.T * scale  # [H, N]
    m_new = torch.maximum(m, s.max(dim=1).values)
    alpha = torch.exp(m - m_new)  # 0 on the first tile (m = -inf)
    p = torch.exp(s - m_new[:, None])
    return m_new, l * alpha + p.sum(dim=1), acc * alpha[:, None] + p @ v


def merge_splits(part_out, part_lse):
    top = part_lse.amax(dim=-1, keepdim=True)
    w = torch.exp2(part_lse - top)  # empty splits weigh 0
    safe = torch.nan_to_num(part_out * (w[..., None] > 0), nan=0.0, posinf=0.0, neginf=0.0)
    return (w[..., None] * safe).sum(-2) / w.sum(-1, keepdim=True)
