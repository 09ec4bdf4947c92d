"""Checker for exercise 08b: the split-K merge of the paged decode kernel.

    merge_splits(part_out, part_lse) -> out
        part_out  [B, H, S, D] fp32   split s's attention output, normalised by its OWN softmax sum
        part_lse  [B, H, S]    fp32   log2 of that sum, log2(sum_j 2^s_j) over the split's scores
                                      (log2 units); -inf: the split was empty and part_out was never written
        out       [B, H, D]           the softmax over the keys of every split, applied to their values

A long context is cut into S splits read by separate programs (split-K); each returns (o_s, lse_s), and

    out = sum_s 2^lse_s * o_s / sum_s 2^lse_s        (computed with 2^(lse_s - max lse): no overflow)

Two stages, each stopping at the first problem with a message that says where:
  1. hand-picked cases (one split, equal weights, base 2, overflow, empty splits, per-head weights),
     then random ones whose partials come from real attention, against the merge in float64
  2. (check_merge_in_kernel) minikv's decode kernel with your merge in place of its merge kernel
     (`paged_decode_attention(..., num_splits=S, merge=fn)`, the seam), on paged batches whose short
     sequences leave splits empty, against the torch paged reference
"""
from __future__ import annotations

import math
import random

import torch

from minikv.checks.report import fail, first_difference, passed

DIMS = ("sequence", "head", "dim")


def reference_merge(part_out: torch.Tensor, part_lse: torch.Tensor) -> torch.Tensor:
    """The merge in float64: [B, H, S, D], [B, H, S] -> [B, H, D] (at least one split non-empty per row)."""
    lse = part_lse.double()
    w = torch.exp2(lse - lse.max(dim=-1, keepdim=True).values)
    o = torch.where(w[..., None] > 0, part_out.double(), 0.0)
    return (w[..., None] * o).sum(dim=-2) / w.sum(dim=-1, keepdim=True)


def split_partials(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_splits: int,
                   split_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What each split of one sequence hands to the merge, in float64.

    q [H, D], k/v [L, H, D] (each query head with its own key/value head); split s reads positions
    [s * split_len, (s + 1) * split_len) and the last one any rest. Returns part_out [H, S, D] (NaN for
    an empty split: never written) and part_lse [H, S] (log2 units, -inf for an empty split)."""
    L, H, D = k.shape
    split_len = split_len or max(1, math.ceil(L / num_splits))
    scores = torch.einsum("hd,lhd->hl", q.double(), k.double()) * (D**-0.5 * math.log2(math.e))  # [H, L]
    part_out = torch.full((H, num_splits, D), float("nan"), dtype=torch.float64)
    part_lse = torch.full((H, num_splits), float("-inf"), dtype=torch.float64)
    for s in range(num_splits):
        lo, hi = s * split_len, (L if s == num_splits - 1 else min((s + 1) * split_len, L))
        if lo >= hi:
            continue
        sc = scores[:, lo:hi]
        m = sc.max(dim=1, keepdim=True).values
        p = torch.exp2(sc - m)
        part_lse[:, s] = m[:, 0] + torch.log2(p.sum(dim=1))
        part_out[:, s] = torch.einsum("hl,lhd->hd", p / p.sum(dim=1, keepdim=True), v[lo:hi].double())
    return part_out, part_lse


def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax attention of q [H, D] over all of k/v [L, H, D], float64: what the merge must rebuild."""
    scores = torch.einsum("hd,lhd->hl", q.double(), k.double()) * q.shape[-1] ** -0.5
    return torch.einsum("hl,lhd->hd", scores.softmax(dim=1), v.double())


# ---- mistakes the hints recognise -----------------------------------------------------------------

def _mistake(part_out, part_lse, kind: str) -> torch.Tensor:
    lse, o = part_lse.double(), part_out.double()
    empty = torch.isinf(lse) & (lse < 0)
    o_clean = torch.where(empty[..., None], 0.0, o)
    if kind == "mean":
        n = (~empty).sum(dim=-1, keepdim=True).clamp(min=1)
        return o_clean.sum(dim=-2) / n
    if kind == "natural":
        w = torch.exp(lse - lse.max(dim=-1, keepdim=True).values)
        return (w[..., None] * o_clean).sum(dim=-2) / w.sum(dim=-1, keepdim=True)
    if kind == "unnormalised":
        w = torch.exp2(lse - lse.max(dim=-1, keepdim=True).values)
        return (w[..., None] * o_clean).sum(dim=-2)
    if kind == "raw_weights":  # 2^lse without the max: overflows or underflows in fp32
        w = torch.exp2(part_lse.float())
        return ((w[..., None] * o_clean.float()).sum(dim=-2) / w.sum(dim=-1, keepdim=True)).double()
    if kind == "first":
        return o[..., 0, :]
    raise ValueError(kind)


HINTS = {
    "mean": "this is the plain average of the splits' outputs: a split that saw larger scores (a larger lse) "
            "must weigh more. Weight split s by 2^lse_s",
    "natural": "the lse is in log2 units (the kernel's scores carry log2(e)): weigh with exp2, not exp",
    "unnormalised": "the weights must sum to 1: divide the weighted sum by the sum of the weights",
    "raw_weights": "2^lse overflows (or underflows to 0) in fp32 when the lse is large: subtract the largest lse "
                   "first, 2^(lse_s - max lse), which changes nothing after the division",
    "first": "only the first split reached the output: sum over every split (the S axis, dim -2 of part_out)",
}


def _hint(got, part_out, part_lse) -> str | None:
    if not isinstance(got, torch.Tensor):
        return None
    g = got.detach().double()
    empty = torch.isinf(part_lse) & (part_lse < 0)
    if empty.any() and torch.isnan(g).any():
        return ("an empty split (lse = -inf) has weight 0, but its part_out was never written (here NaN) and "
                "0 * NaN = NaN: drop it with torch.where(weight > 0, part_out, 0) before the sum")
    for kind, text in HINTS.items():
        alt = _mistake(part_out, part_lse, kind)
        if alt.shape == g.shape and torch.allclose(g, alt, atol=1e-4, rtol=1e-4, equal_nan=True):
            return text
    if not torch.isfinite(g).all():
        return HINTS["raw_weights"]
    return None


# ---- stage 1: the merge alone ---------------------------------------------------------------------

def _case(lse_rows, outs=None, seed=0):
    """A hand-picked case: lse_rows [B][H][S] -> (part_out [B, H, S, 4] fp32, part_lse fp32)."""
    g = torch.Generator().manual_seed(seed)
    lse = torch.tensor(lse_rows, dtype=torch.float32)
    out = torch.randn(*lse.shape, 4, generator=g) if outs is None else torch.tensor(outs, dtype=torch.float32)
    out[torch.isinf(lse) & (lse < 0)] = float("nan")  # an empty split's output is never written
    return out, lse


INF = float("-inf")
HAND_PICKED = [
    ("one split: the merge is that split's output", [[[0.7]]]),
    ("two splits with equal lse: equal weights, the average of the two outputs", [[[2.0, 2.0]]]),
    ("lse 1 apart (log2 units): weights 2 : 1", [[[1.0, 0.0]]]),
    ("three splits with lse 3, 0, -2: weights 2^lse / their sum", [[[3.0, 0.0, -2.0]]]),
    ("large lse (1500, 1499): 2^1500 overflows even in float64", [[[1500.0, 1499.0]]]),
    ("very negative lse (-1500, -1502): 2^lse underflows to 0, and 0 / 0 is NaN", [[[-1500.0, -1502.0]]]),
    ("an empty split (lse -inf, output never written: NaN) gets weight 0", [[[0.5, INF, 1.0]]]),
    ("every split but the last is empty", [[[INF, INF, 0.25]]]),
    ("two sequences x two heads, each with its own weights: the sums run over the splits only",
     [[[0.0, 3.0], [3.0, 0.0]], [[1.0, INF], [-1.0, 2.0]]]),
]


def _random_case(rng: random.Random, seed: int):
    """Partials of real attention: B sequences of random lengths, cut into S splits of one length."""
    B, H, D, S = rng.randint(1, 3), rng.randint(1, 4), rng.choice([4, 8, 16]), rng.randint(1, 6)
    g = torch.Generator().manual_seed(seed)
    lens = [rng.randint(1, 60) for _ in range(B)]
    split_len = math.ceil(max(lens) / S)  # one split length for the batch: short sequences leave splits empty
    q = torch.randn(B, H, D, generator=g) * rng.choice([1.0, 3.0])
    outs, lses, want = [], [], []
    for b, L in enumerate(lens):
        k, v = torch.randn(L, H, D, generator=g), torch.randn(L, H, D, generator=g)
        o, lse = split_partials(q[b], k, v, S, split_len)
        outs.append(o)
        lses.append(lse)
        want.append(full_attention(q[b], k, v))
    desc = f"random: {B} sequence(s) of lengths {lens}, {H} heads, head_dim {D}, {S} splits of {split_len} positions"
    return desc, torch.stack(outs).float(), torch.stack(lses).float(), torch.stack(want)


def _compare(case: str, merge_splits, part_out, part_lse, expected) -> None:
    try:
        got = merge_splits(part_out.clone(), part_lse.clone())
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001  shown to the learner
        fail(case, "merge_splits raised", f"{type(e).__name__}: {e}")
    if got is None:
        fail(case, "it returned None", f"expected a tensor of shape {tuple(expected.shape)} [B, H, D]",
             "did the function forget to `return`?")
    problem = first_difference(expected.float(), got, DIMS, atol=1e-4, rtol=1e-4)
    if problem:
        lse = "\n    ".join(f"sequence {b}, head {h}: lse {[round(x, 3) for x in part_lse[b, h].tolist()]}"
                            for b in range(part_lse.shape[0]) for h in range(part_lse.shape[1]))
        fail(case, "the merged output [B, H, D] differs from the float64 merge",
             f"{problem}\n  the splits' lse:\n    {lse}", _hint(got, part_out, part_lse))


def check_merge_splits(merge_splits, num_random: int = 200, seed: int = 0) -> None:
    """Stage 1: hand-picked cases, then random partials of real attention (the merge must rebuild it)."""
    for i, (lesson, rows) in enumerate(HAND_PICKED):
        part_out, part_lse = _case(rows, seed=seed + i)
        _compare(f"case {i}: {lesson}", merge_splits, part_out, part_lse, reference_merge(part_out, part_lse))
    rng = random.Random(seed)
    for i in range(num_random):
        desc, part_out, part_lse, want = _random_case(rng, seed * 10_000 + i)
        _compare(f"case {len(HAND_PICKED) + i}: {desc}\n  (expected: attention over the whole sequence at once)",
                 merge_splits, part_out, part_lse, want)
    passed(len(HAND_PICKED) + num_random, "merge_splits joins the splits' softmaxes exactly (base 2, no overflow, "
                                          "empty splits dropped)")


# ---- stage 2: inside the decode kernel ------------------------------------------------------------

KERNEL_CASES = [  # (seq_lens, group, num_kv_heads, head_dim, num_splits)
    ([40, 1, 16], 1, 2, 16, 3),  # the short ones leave the last splits empty
    ([100, 33, 5], 3, 2, 32, 4),
    ([64, 64], 2, 1, 16, 2),
]


def check_merge_in_kernel(merge_splits, seed: int = 0) -> None:
    """Stage 2: paged_decode_attention(..., num_splits=S, merge=merge_splits) vs rung 4's torch paged attention.

    Needs Triton's interpreter on a CPU: TRITON_INTERPRET=1 before anything imports triton."""
    from minikv.checks.decode_kernel import BLOCK, _paged_case, _require_interpreter, torch_decode_reference

    _require_interpreter()
    from minikv.kernels import paged_decode_attention

    for i, (lens, group, kvh, D, splits) in enumerate(KERNEL_CASES):
        q, k_cache, v_cache, tables = _paged_case(lens, group, kvh, D, seed + i)
        seen = {}

        def spy(part_out, part_lse):
            seen["part"] = (part_out.clone(), part_lse.clone())
            return merge_splits(part_out, part_lse)

        case = (f"kernel case {i}: {len(lens)} sequences of lengths {lens}, {group} query heads per KV head, "
                f"head_dim {D}, {splits} splits")
        try:
            out = paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens), D**-0.5,
                                         num_splits=splits, block_n=BLOCK, merge=spy)
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001  shown to the learner
            fail(case, f"the kernel with your merge raised {type(e).__name__}", str(e))
        want = torch_decode_reference(q, k_cache, v_cache, tables, lens).float()
        problem = first_difference(want, out, DIMS, atol=1e-4, rtol=1e-4)
        if problem:
            part_out, part_lse = seen["part"]
            b = next(b for b in range(len(lens)) if not torch.allclose(out[b], want[b], atol=1e-4, rtol=1e-4))
            empty = [s for s in range(splits) if torch.isinf(part_lse[b, 0, s])]
            fail(case, f"sequence {b} (length {lens[b]}) is wrong",
                 f"{problem}\n  its splits' lse (head 0): {[round(x, 3) for x in part_lse[b, 0].tolist()]}"
                 + (f"; splits {empty} are empty" if empty else ""),
                 _hint(merge_splits(part_out.clone(), part_lse.clone()), part_out, part_lse))
    passed(len(KERNEL_CASES), "the decode kernel with your merge equals the torch paged reference (ragged lengths, "
                              "empty splits, GQA)")
