"""Checker for the speculative-decoding drill: accept draft tokens, then roll back the KV of the rest.

    num_accepted(draft, p, q, u) -> int
        draft  [k] token ids the draft model proposed        p  [k, V] the target's probabilities
        u      [k] uniform numbers in [0, 1), one per token  q  [k, V] the draft's probabilities
        token i is accepted when u[i] < min(1, p[i, draft[i]] / q[i, draft[i]]); count the accepted
        tokens up to the first rejection

    residual(p_row, q_row) -> [V]
        the distribution to sample the replacement token from after a rejection:
        max(0, p - q) normalised to sum 1 (p itself if p <= q everywhere)

    rollback(block_table, num_tokens, k, accepted, block_size, free) -> num_computed_tokens
        before the step the sequence held num_tokens tokens, K/V written for [0, num_tokens - 1);
        verification wrote K/V for [num_tokens - 1, num_tokens + k) (its last token and k drafts).
        Afterwards the sequence holds num_tokens + accepted + 1 tokens (the accepted drafts and one
        token from the target); the K/V of [0, num_tokens + accepted) stay valid, the rest are garbage
        the next step overwrites. Keep the blocks the sequence needs to hold all its tokens
        (ceil((num_tokens + accepted + 1) / block_size)), give every other block back with free(b),
        last block first, shortening block_table in place; return the number of valid K/V positions.

      positions   [0, n-1)   [n-1, n-1+accepted]   (.., n+k)
                  cached     verified & kept       rejected: rolled back
"""
from __future__ import annotations

import math
import random

import torch

from minikv.checks.report import fail, passed


def reference_num_accepted(draft, p, q, u) -> int:
    for i, t in enumerate(draft):
        ratio = float(p[i, t]) / float(q[i, t]) if float(q[i, t]) > 0 else math.inf
        if not float(u[i]) < min(1.0, ratio):
            return i
    return len(draft)


def reference_residual(p_row, q_row):
    r = torch.clamp(p_row.double() - q_row.double(), min=0)
    return (p_row.double() if float(r.sum()) <= 0 else r / r.sum()).to(p_row.dtype)


def reference_rollback(block_table, num_tokens, k, accepted, block_size, free) -> int:
    keep = -(-(num_tokens + accepted + 1) // block_size)
    while len(block_table) > keep:
        free(block_table.pop())
    return num_tokens + accepted


def _dist(g, k, V, peaked=False):
    x = torch.randn(k, V, generator=g) * (4.0 if peaked else 1.0)
    return x.softmax(dim=-1)


def check_num_accepted(num_accepted, num_random: int = 200, seed: int = 0) -> None:
    V = 6
    one_hot = torch.eye(V)
    cases = [
        ("greedy, every draft matches the target's argmax", [1, 2, 3], one_hot[[1, 2, 3]], one_hot[[1, 2, 3]],
         torch.tensor([0.5, 0.5, 0.5])),
        ("greedy, the second draft differs: one accepted", [1, 4, 3], one_hot[[1, 2, 3]], one_hot[[1, 4, 3]],
         torch.tensor([0.5, 0.5, 0.5])),
        ("p > q for the token: accepted whatever u is (the ratio is capped at 1)", [0],
         torch.tensor([[0.9, 0.1, 0, 0, 0, 0]]), torch.tensor([[0.3, 0.7, 0, 0, 0, 0]]), torch.tensor([0.999])),
        ("p / q = 0.5 and u = 0.6: rejected", [0], torch.tensor([[0.2, 0.8, 0, 0, 0, 0]]),
         torch.tensor([[0.4, 0.6, 0, 0, 0, 0]]), torch.tensor([0.6])),
        ("a rejection stops the count even if later tokens would pass", [0, 0, 0],
         torch.tensor([[0.2, 0.8, 0, 0, 0, 0]] * 3), torch.tensor([[0.4, 0.6, 0, 0, 0, 0]] * 3),
         torch.tensor([0.1, 0.9, 0.1])),
        ("no draft tokens", [], torch.zeros(0, V), torch.zeros(0, V), torch.zeros(0)),
    ]
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    for _ in range(num_random):
        k = rng.randint(1, 6)
        p, q = _dist(g, k, V, rng.random() < 0.5), _dist(g, k, V, rng.random() < 0.5)
        draft = [rng.randrange(V) for _ in range(k)]
        cases.append(("random", draft, p, q, torch.rand(k, generator=g)))
    for lesson, draft, p, q, u in cases:
        want = reference_num_accepted(draft, p, q, u)
        case = f"case: {lesson}\n  draft={draft}, u={[round(float(x), 3) for x in u]}"
        try:
            got = num_accepted(draft, p, q, u)
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001
            fail(case, "num_accepted raised", f"{type(e).__name__}: {e}")
        if got != want:
            ratios = [round(float(p[i, t]) / max(float(q[i, t]), 1e-12), 3) for i, t in enumerate(draft)]
            fail(case, f"expected {want} accepted, got {got!r}", f"p/q of each draft token: {ratios}",
                 "accept token i while u[i] < min(1, p/q); stop at the first rejection")
    passed(len(cases), "num_accepted applies the rejection rule token by token")


def check_residual(residual, num_random: int = 100, seed: int = 0) -> None:
    cases = [
        ("p puts more mass than q on token 0 only", torch.tensor([0.6, 0.2, 0.2]), torch.tensor([0.2, 0.4, 0.4])),
        ("p == q: nothing left over, sample from p", torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.5, 0.5, 0.0])),
        ("two tokens gain", torch.tensor([0.5, 0.4, 0.1]), torch.tensor([0.1, 0.1, 0.8])),
    ]
    g = torch.Generator().manual_seed(seed)
    for _ in range(num_random):
        d = _dist(g, 2, 8, peaked=True)
        cases.append(("random", d[0], d[1]))
    for lesson, p, q in cases:
        case = f"case: {lesson}\n  p={[round(float(x), 3) for x in p]}, q={[round(float(x), 3) for x in q]}"
        try:
            got = residual(p, q)
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001
            fail(case, "residual raised", f"{type(e).__name__}: {e}")
        want = reference_residual(p, q)
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or not torch.allclose(
                got.double(), want.double(), atol=1e-5):
            fail(case, "wrong distribution", f"expected {[round(float(x), 4) for x in want]}, got {got!r}",
                 "max(0, p - q), divided by its sum; where p <= q everywhere, p")
    passed(len(cases), "residual is the normalised positive part of p - q")


def check_rollback(rollback, num_random: int = 300, seed: int = 0) -> None:
    cases = [
        ("every draft accepted: nothing to free", 8, 4, 3, 3, 4),
        ("nothing accepted: the drafts' block goes back", 8, 4, 4, 0, 4),
        ("rejected tokens inside the last kept block: no block freed, the slots are overwritten later", 10, 4,
         2, 1, 4),
        ("two blocks past the end go back, the last one first", 5, 4, 9, 0, 2),
    ]
    rng = random.Random(seed)
    for _ in range(num_random):
        bs = rng.choice([2, 4, 8, 16])
        k = rng.randint(0, 8)
        cases.append(("random", rng.randint(1, 60), bs, k, rng.randint(0, k), bs))
    for lesson, n, bs, k, accepted, _ in cases:
        need = -(-(n + k) // bs)  # verification wrote up to position n + k - 1
        table = random.Random(n * 31 + k).sample(range(100), need)
        mine, ref = list(table), list(table)
        freed, want_freed = [], []
        case = (f"case: {lesson}\n  num_tokens={n}, k={k}, accepted={accepted}, block_size={bs}, "
                f"block_table={table}")
        try:
            got = rollback(mine, n, k, accepted, bs, freed.append)
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001
            fail(case, "rollback raised", f"{type(e).__name__}: {e}")
        want = reference_rollback(ref, n, k, accepted, bs, want_freed.append)
        if got != want:
            fail(case, f"returned {got!r}, expected {want} valid K/V positions",
                 f"[0, {n} - 1) were cached, the step wrote [{n - 1}, {n + k}); {accepted} drafts kept",
                 "the last token and the accepted drafts keep their K/V: num_tokens + accepted")
        if mine != ref or freed != want_freed:
            fail(case, f"block_table is {mine} and freed {freed}; expected {ref} and freed {want_freed}",
                 f"the sequence now holds {n + accepted + 1} tokens: ceil({n + accepted + 1} / {bs}) = {len(ref)} "
                 "blocks", "free the blocks past that, the last one first, popping them off block_table")
    passed(len(cases), "rollback keeps the accepted K/V and frees the blocks past the sequence's end")
