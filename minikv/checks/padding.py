"""Checker for exercise 03a: the left-padding mask of static batching (rung 3).

    padded_mask(pad_lens, q_cols, L) -> mask
        pad_lens  [B]       int: left pads of each row (columns [0, pad) hold pad tokens)
        q_cols    [B, n]    int: the column of each query of this step (a prefill: 0..P-1; a decode: one column)
        L                   the keys are columns [0, L) of every row's cache
        mask      [B, n, L] bool: may the query in column q_cols[b, i] of row b see the key in column j?

    row b with pad_lens[b] = 2, prefill of 5 columns (x: visible):   key j:  0 1 2 3 4
                                                          query 0 (a pad)    x . . . .
                                                          query 1 (a pad)    x x . . .
                                                          query 2 (real)     . . x . .
                                                          query 3 (real)     . . x x .
                                                          query 4 (real)     . . x x x

Two stages, each stopping at the first problem with a message that says where:
  1. hand-picked steps (no padding, padded prefills, a decode step, a pad row), then random ones,
     against the engine's PaddedContiguousBackend.padded_mask; known mistakes are named
  2. (check_padded_mask_in_engine) StaticBatcher serves prompts of different lengths in one batch
     with your mask in its attention, through its seam `StaticBatcher(llm, batch_size,
     padded_mask=fn)`: the tokens must equal the engine's own mask and rung 2's
"""
from __future__ import annotations

import random

import torch

from minikv.checks.report import fail, passed


def reference_mask(pad_lens: torch.Tensor, q_cols: torch.Tensor, L: int) -> torch.Tensor:
    """The engine's rule (PaddedContiguousBackend.padded_mask): causal over columns; a real query never
    sees a pad; a pad query sees the pads before it (so its row is never empty)."""
    q = q_cols[:, :, None]
    k = torch.arange(L)[None, None, :]
    pad = pad_lens[:, None, None]
    return (k <= q) & ((k >= pad) | (q < pad))


MISTAKES = {
    "pads are visible: a real query must not see columns [0, pad) of its row (they hold pad tokens)":
        lambda pad, q, k: k <= q,
    "a pad query's row is empty (every key hidden): a softmax over no key is 0/0 = NaN (exercise 01's attention "
    "gives NaN there; torch's SDPA happens to return zeros), and a NaN in a pad's hidden state reaches the next "
    "layer's keys and values. Let a pad query see the pads before it":
        lambda pad, q, k: (k <= q) & (k >= pad),
    "the mask is not causal: a query must not see later columns (key j <= query column)":
        lambda pad, q, k: (k >= pad) | (q < pad),
    "the diagonal is hidden (k < q): a token sees itself":
        lambda pad, q, k: (k < q) & ((k >= pad) | (q < pad)),
    "the pad boundary is off by one: the first real token sits in column pad, which is visible":
        lambda pad, q, k: (k <= q) & ((k > pad) | (q < pad)),
    "the mask uses positions (column - pad) for the keys too: compare columns with columns":
        lambda pad, q, k: (k <= q - pad) & ((k >= pad) | (q < pad)),
}


def _hint(got: torch.Tensor, pad_lens, q_cols, L) -> str | None:
    q, k, pad = q_cols[:, :, None], torch.arange(L)[None, None, :], pad_lens[:, None, None]
    for text, rule in MISTAKES.items():
        alt = rule(pad, q, k)
        if alt.shape == got.shape and torch.equal(alt, got):
            return text
    return None


def _grid(row: torch.Tensor, q_cols: list[int], pad: int) -> str:
    head = "           key " + " ".join(f"{j % 10}" for j in range(row.shape[-1]))
    lines = [head]
    for i, qc in enumerate(q_cols):
        kind = "pad " if qc < pad else "real"
        lines.append(f"    query {qc:>2} ({kind}) " + " ".join("x" if v else "." for v in row[i].tolist()))
    return "\n".join(lines)


HAND_PICKED = [  # (lesson, pad_lens, q_cols as (start, n), L)
    ("one row, no padding, a prefill of 4 columns: plain causal", [0], (0, 4), 4),
    ("one row with 2 pads, a prefill of 5 columns: real queries skip the pads", [2], (0, 5), 5),
    ("a decode step (one query in column 6) of a row with 3 pads", [3], (6, 1), 7),
    ("three rows padded 0, 1 and 3 in one prefill", [0, 1, 3], (0, 5), 5),
    ("a row that is all pads but its last column", [4], (0, 5), 5),
    ("a decode step of three rows: each sees its own real columns", [0, 2, 5], (9, 1), 10),
]


def _cols(B: int, start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n).repeat(B, 1)


def check_padded_mask(padded_mask, num_random: int = 200, seed: int = 0) -> None:
    rng = random.Random(seed)
    cases = [(lesson, torch.tensor(pads), _cols(len(pads), s, n), L) for lesson, pads, (s, n), L in HAND_PICKED]
    for _ in range(num_random):
        B, P = rng.randint(1, 5), rng.randint(1, 12)
        pads = torch.tensor([rng.randint(0, P - 1) for _ in range(B)])
        if rng.random() < 0.5:  # a prefill
            start, n = 0, P
        else:  # a decode step
            start, n = P + rng.randint(0, 6), 1
        cases.append(("random", pads, _cols(B, start, n), start + n))
    for c, (lesson, pads, q_cols, L) in enumerate(cases):
        want = reference_mask(pads, q_cols, L)
        desc = (f"case {c}: {lesson}\n  pad_lens={pads.tolist()}, query columns {q_cols[0].tolist()} in every row, "
                f"L={L}")
        try:
            got = padded_mask(pads.clone(), q_cols.clone(), L)
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001  shown to the learner
            fail(desc, "padded_mask raised", f"{type(e).__name__}: {e}")
        if got is None:
            fail(desc, "it returned None", f"expected a bool tensor of shape {tuple(want.shape)} [B, n, L]",
                 "did it forget to `return`?")
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
            fail(desc, f"it returned {type(got).__name__} of shape {tuple(getattr(got, 'shape', ()))}",
                 f"expected a bool tensor of shape {tuple(want.shape)} [B, n, L]")
        if got.dtype != torch.bool:
            fail(desc, f"it returned dtype {got.dtype}", "expected torch.bool (True: the key is visible)",
                 "comparisons give bool tensors; combine them with & and |")
        if torch.equal(got, want):
            continue
        b, i, j = (int(x) for x in torch.nonzero(got != want)[0])
        qc, pad = int(q_cols[b, i]), int(pads[b])
        fail(desc, f"row {b} (pad_lens {pad}), query column {qc}, key column {j}: "
             f"expected {'visible' if want[b, i, j] else 'hidden'}, got {'visible' if got[b, i, j] else 'hidden'}",
             f"row {b}, expected:\n{_grid(want[b], q_cols[b].tolist(), pad)}\n"
             f"row {b}, yours:\n{_grid(got[b], q_cols[b].tolist(), pad)}",
             _hint(got, pads, q_cols, L))
    passed(len(cases), "padded_mask is causal over columns, hides pads from real queries, and never leaves a "
                       "pad query's row empty")


# ---- stage 2: the static batcher attends with the learner's mask ------------------------------------

def check_padded_mask_in_engine(llm, padded_mask, prompts, max_tokens: int = 10) -> None:
    """`prompts` (of different lengths) in ONE static batch of the learner's mask; every request's
    tokens must equal the engine's StaticBatcher and rung 2 (each request alone, no padding)."""
    from minikv import SamplingParams
    from minikv.engine.static_batching import StaticBatcher

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    lens = [len(llm.encode(p)[0]) if isinstance(p, str) else len(p) for p in prompts]
    try:
        batcher = StaticBatcher(llm, len(prompts), padded_mask=padded_mask)  # the rung-3 seam
        mine = [o.token_ids for o in batcher.generate(prompts, params)]
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001  shown to the learner
        fail(f"{len(prompts)} prompts of {lens} tokens in one batch", f"the batcher on your mask raised "
             f"{type(e).__name__}", str(e))
    engine = [o.token_ids for o in StaticBatcher(llm, len(prompts)).generate(prompts, params)]
    alone = [llm.generate(p, params)[0].token_ids for p in prompts]
    show = (lambda ids: repr(llm.tokenizer.decode(ids))) if llm.tokenizer is not None else str
    P = max(lens)
    for i, (m, e, a) in enumerate(zip(mine, engine, alone)):
        if e != a:
            raise RuntimeError(f"request {i}: the engine's static batch differs from rung 2; report this")
        if m != e:
            j = next((k for k, (x, y) in enumerate(zip(m, e)) if x != y), min(len(m), len(e)))
            fail(f"request {i} ({lens[i]} prompt tokens, {P - lens[i]} left pads in a batch of {lens})",
                 f"its tokens differ from token {j} on",
                 f"rung 2 (alone):   {show(e)}\nyour batch:       {show(m)}",
                 "a request with no pads is right and a padded one is not: the pads leak into attention"
                 if lens[i] < P and all(mine[k] == engine[k] for k in range(len(prompts)) if lens[k] == P) else None)
    passed(len(prompts), f"one static batch of prompts of {lens} tokens, attending with your mask, generates each "
                         f"request's rung-2 tokens: {show(mine[lens.index(min(lens))])}")
