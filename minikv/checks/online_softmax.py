"""Checker for the online-softmax drill: fold one tile of keys into a running softmax, in torch.

    online_step(q, k, v, m, l, acc, scale) -> (m, l, acc)
        q     [H, D]   the query heads that share one KV head
        k, v  [N, D]   one tile of keys and values
        m     [H]      running max of the scores so far (starts at -inf)
        l     [H]      running sum of exp(score - m)     (starts at 0)
        acc   [H, D]   running sum of exp(score - m) * v (starts at 0)
        the caller ends with acc / l[:, None]: softmax(q k^T * scale) v over every tile at once

The checker drives the loop itself, tile by tile, so a step that only looks right on one tile (no
rescale when a later tile raises the max, exp without subtracting the max) fails on the first tile
that shows it. Cases: one tile, a later tile with a larger max, a later tile with a smaller one,
scores large enough to overflow exp in float32, tiles of one key, then random ones.
"""
from __future__ import annotations

import random

import torch

from minikv.checks.report import fail, first_difference, passed


def reference_step(q, k, v, m, l, acc, scale):
    s = (q.double() @ k.double().T) * scale  # [H, N]
    m_new = torch.maximum(m.double(), s.max(dim=1).values)
    alpha = torch.exp(m.double() - m_new)  # rescales what was summed under the old max
    p = torch.exp(s - m_new[:, None])
    return m_new, l.double() * alpha + p.sum(dim=1), acc.double() * alpha[:, None] + p @ v.double()


def _case(rng: random.Random, H: int, D: int, T: int, tile: int, spread: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(H, D, generator=g) * spread
    k, v = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
    return q, k, v, tile


def _hand_picked():
    g = torch.Generator().manual_seed(0)
    D, H = 8, 2
    q = torch.randn(H, D, generator=g)
    k, v = torch.randn(12, D, generator=g), torch.randn(12, D, generator=g)
    rising = k.clone()
    rising[8:] = q[0] * 3  # the third tile holds the largest scores: the running max must grow
    falling = k.clone()
    falling[:4] = q[0] * 3  # the first tile holds the largest scores
    return [
        ("one tile holds every key", q, k[:4], v[:4], 4),
        ("a later tile raises the max: acc and l must be rescaled by exp(m_old - m_new)", q, rising, v, 4),
        ("a later tile has smaller scores: the max stays, the new terms are scaled down", q, falling, v, 4),
        ("scores near 1000: exp overflows in float32 unless the max is subtracted", q * 40, k, v, 4),
        ("tiles of one key each", q, k[:5], v[:5], 1),
        ("the last tile is shorter than the others (10 keys in tiles of 4)", q, k[:10], v[:10], 4),
    ]


def _run(step, q, k, v, tile, scale, lesson: str):
    H, D = q.shape
    m = torch.full((H,), float("-inf"))
    l, acc = torch.zeros(H), torch.zeros(H, D)
    rm, rl, racc = m.double(), l.double(), acc.double()
    for t, start in enumerate(range(0, k.shape[0], tile)):
        kt, vt = k[start:start + tile], v[start:start + tile]
        case = (f"case: {lesson}\n  H={H}, D={D}, {k.shape[0]} keys in tiles of {tile}; tile {t} "
                f"(keys {start}..{start + kt.shape[0] - 1})")
        try:
            got = step(q, kt, vt, m, l, acc, scale)
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001  shown to the learner
            fail(case, "online_step raised", f"{type(e).__name__}: {e}")
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            fail(case, "online_step returned", f"{type(got).__name__}; expected the tuple (m, l, acc)",
                 "did it forget to `return m, l, acc`?")
        m, l, acc = (torch.as_tensor(x, dtype=torch.float32) for x in got)
        rm, rl, racc = reference_step(q, kt, vt, rm, rl, racc, scale)
        # m may differ from the reference if the learner keeps another (equally valid) max; what
        # must agree is the normalised output so far and the log-sum-exp
        out, want = acc / l[:, None], (racc / rl[:, None]).float()
        diff = first_difference(want, out, ("head", "dim"), atol=1e-4, rtol=1e-3)
        if diff is not None:
            hint = None
            if t > 0 and "raises the max" in lesson:
                hint = "when m grows, multiply l and acc by exp(m_old - m_new) before adding this tile"
            elif not torch.isfinite(out).all():
                hint = "subtract the running max before exp: exp(1000) is inf in float32"
            fail(case, "acc / l after this tile (the attention over the keys seen so far)", diff, hint)
        lse, want_lse = m + torch.log(l), (rm + torch.log(rl)).float()
        diff = first_difference(want_lse, lse, ("head",), atol=1e-3, rtol=1e-4)
        if diff is not None:
            fail(case, "m + log(l) after this tile (log of the softmax denominator)", diff,
                 "l must be the sum of exp(score - m) with the m you return")


def check_online_step(step, num_random: int = 40, seed: int = 0) -> None:
    cases = _hand_picked()
    rng = random.Random(seed)
    for n in range(num_random):
        H, D, T = rng.choice([1, 2, 4]), rng.choice([4, 8, 16]), rng.randint(1, 40)
        tile = rng.choice([1, 3, 4, 8, 16])
        q, k, v, tile = _case(rng, H, D, T, tile, rng.choice([0.5, 1.0, 8.0]), seed * 1000 + n)
        cases.append(("random", q, k, v, tile))
    for lesson, q, k, v, tile in cases:
        _run(step, q, k, v, tile, q.shape[1] ** -0.5, lesson)
    passed(len(cases), "online_step folds tile after tile into the exact softmax")
