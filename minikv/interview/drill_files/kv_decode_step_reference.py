"""Reference for the kv-decode-step drill."""
import torch


def decode_step(q, k_new, v_new, k_cache, v_cache, pos, scale):
    k_cache[pos], v_cache[pos] = k_new, v_new
    H, D = q.shape
    kv = k_new.shape[0]
    qg = q.view(kv, H // kv, D)
    scores = torch.einsum("kgd,jkd->kgj", qg, k_cache[:pos + 1]) * scale  # only [0, pos]: never stale slots
    return torch.einsum("kgj,jkd->kgd", scores.softmax(-1), v_cache[:pos + 1]).reshape(H, D)
