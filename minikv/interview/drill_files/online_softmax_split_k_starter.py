"""Drill: the online softmax of a decode kernel, and the split-K merge (30 minutes).

1. online_step(q, k, v, m, l, acc, scale) -> (m, l, acc)
       fold one tile of keys into a running softmax (the checker calls it tile after tile)
       q [H, D] query heads; k, v [N, D] one tile; m [H] running max of the scores (starts -inf);
       l [H] running sum of exp(score - m) (starts 0); acc [H, D] running sum of exp(score - m) * v
       (starts 0). At the end acc / l[:, None] must equal softmax(q @ K^T * scale) @ V over all tiles.

2. merge_splits(part_out, part_lse) -> out
       part_out [B, H, S, D]  split s's attention output, normalised by its OWN softmax sum
       part_lse [B, H, S]     log2 of that sum (log2 units); -inf: the split was empty and its
                              part_out holds garbage (maybe NaN)
       out      [B, H, D]     the attention over the keys of every split at once
       out = sum_s 2^lse_s * o_s / sum_s 2^lse_s, computed without overflow

Check it with: minikv drill check online-softmax-split-k
"""
import torch


def online_step(q, k, v, m, l, acc, scale):
    raise NotImplementedError("write online_step")


def merge_splits(part_out: torch.Tensor, part_lse: torch.Tensor) -> torch.Tensor:
    raise NotImplementedError("write merge_splits")
