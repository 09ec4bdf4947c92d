"""Exercise 08b's checker (the split-K merge) passes the reference merge, catches the mistakes
learners make and names them, and the kernel's `merge` seam really runs the learner's function.

Runs in Triton's interpreter on the CPU (conftest sets TRITON_INTERPRET=1 before triton is imported).
"""
from __future__ import annotations

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from minikv.checks.split_k import (
    check_merge_in_kernel,
    check_merge_splits,
    full_attention,
    reference_merge,
    split_partials,
)


def merge(part_out, part_lse):
    m = part_lse.max(dim=-1, keepdim=True).values
    w = torch.exp2(part_lse - m)
    o = torch.where(w[..., None] > 0, part_out, 0.0)
    return (w[..., None] * o).sum(dim=-2) / w.sum(dim=-1, keepdim=True)


def _weights(part_lse, base=2.0, subtract_max=True):
    lse = part_lse - part_lse.max(dim=-1, keepdim=True).values if subtract_max else part_lse
    return torch.pow(torch.tensor(base), lse)


def _nan_safe(part_out, w):
    return torch.where(w[..., None] > 0, part_out, 0.0)


BUGS = {
    "plain average": (lambda o, lse: torch.nanmean(o, dim=-2), "plain average"),
    "natural exp": (lambda o, lse: (lambda w: (w[..., None] * _nan_safe(o, w)).sum(-2) / w.sum(-1, keepdim=True))(
        _weights(lse, math.e)), "exp2, not exp"),
    "not normalised": (lambda o, lse: (lambda w: (w[..., None] * _nan_safe(o, w)).sum(-2))(_weights(lse)),
                       "divide the weighted sum"),
    "no max subtracted": (lambda o, lse: (lambda w: (w[..., None] * _nan_safe(o, w)).sum(-2) / w.sum(-1, keepdim=True))(
        _weights(lse, subtract_max=False)), "subtract the largest lse"),
    "0 * NaN of an empty split": (lambda o, lse: (lambda w: (w[..., None] * o).sum(-2) / w.sum(-1, keepdim=True))(
        _weights(lse)), "0 \\* NaN = NaN"),
    "first split only": (lambda o, lse: o[..., 0, :], "only the first split"),
    "forgot to return": (lambda o, lse: None, "return"),
}


def test_task_08b_reference_merge_passes(capsys):
    check_merge_splits(merge)
    assert "cases passed" in capsys.readouterr().out


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_task_08b_merge_bugs_are_caught_and_named(bug):
    fn, words = BUGS[bug]
    with pytest.raises(AssertionError, match=words):
        check_merge_splits(fn, num_random=20)


def test_task_08b_split_partials_merge_back_to_attention_over_the_whole_row():
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 8, generator=g), torch.randn(11, 2, 8, generator=g), torch.randn(11, 2, 8, generator=g)
    part_out, part_lse = split_partials(q, k, v, num_splits=4, split_len=4)
    assert torch.isinf(part_lse[:, 3]).all() and torch.isnan(part_out[:, 3]).all()  # [12, 11): empty
    assert torch.allclose(reference_merge(part_out[None], part_lse[None])[0], full_attention(q, k, v), atol=1e-12)


def test_task_08b_kernel_check_passes_and_uses_the_learners_merge(capsys):
    check_merge_in_kernel(merge)
    assert "equals the torch paged reference" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="sequence 0"):
        check_merge_in_kernel(lambda o, lse: torch.zeros(o.shape[0], o.shape[1], o.shape[3]))


def test_task_08b_kernel_merge_seam_gets_the_partials_of_every_split():
    from minikv.checks.decode_kernel import _paged_case
    from minikv.kernels import paged_decode_attention

    q, k_cache, v_cache, tables = _paged_case([40, 1], 2, 2, 16, 0)
    seen = []

    def spy(part_out, part_lse):
        seen.append((tuple(part_out.shape), torch.isinf(part_lse[1, 0]).tolist()))
        return merge(part_out, part_lse)

    own = paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor([40, 1]), 16**-0.5, num_splits=3, block_n=16)
    mine = paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor([40, 1]), 16**-0.5, num_splits=3,
                                  block_n=16, merge=spy)
    assert seen == [((2, 4, 3, 16), [False, True, True])]  # the 1-token sequence leaves splits 1 and 2 empty
    assert torch.allclose(own, mine, atol=1e-5)
    with pytest.raises(ValueError, match="merge returned"):
        paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor([40, 1]), 16**-0.5, num_splits=3,
                               block_n=16, merge=lambda o, lse: o)
