"""Checkers for exercise 01 (causal attention, rung 1) and exercise 02 (a decode step with a KV cache, rung 2).

Each checker runs the learner's function on random cases and compares it with the engine's own code
(NaiveBackend for 01, ContiguousBackend for 02). On the first wrong case it raises an AssertionError
that says which case, where the first difference is, and, when the output equals a known mistake
(no scale, an off-by-one mask, the wrong head grouping, ...), which one. The `*_in_engine` checks then
plug the function into a running LLM and compare the generated tokens with the engine's.

    exercise 01   causal_attention(q, k, v, scale) -> out
        q     [T, num_heads, head_dim]       queries of one whole sequence
        k, v  [T, num_kv_heads, head_dim]    its keys and values (RoPE already applied)
        out   [T, num_heads, head_dim]       token i attends to keys 0..i; query head h reads
                                             kv head h // (num_heads // num_kv_heads)

    exercise 02   decode_step(q, k_new, v_new, k_cache, v_cache, pos, scale) -> out
        q             [num_heads, head_dim]             the new token's query; it sits at position pos
        k_new, v_new  [num_kv_heads, head_dim]
        k_cache       [max_len, num_kv_heads, head_dim] one request's cache row (v_cache the same):
                      [0, pos)         the past, written by earlier steps
                      [pos]            write k_new / v_new here, in place
                      (pos, max_len)   stale numbers left by an earlier request: never read them
        out           [num_heads, head_dim]             attention over positions 0..pos

scale is always 1 / sqrt(head_dim), the value the engine passes.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

import torch

from minikv.attention.contiguous import ContiguousBackend
from minikv.attention.metadata import AttentionMetadata, ContiguousMetadata
from minikv.attention.naive import NaiveBackend
from minikv.cache.blocks.pool import RowPool
from minikv.checks.report import fail, first_difference, passed

OUT_DIMS = ("position", "head", "dim")
DECODE_OUT_DIMS = ("head", "dim")
CACHE_DIMS = ("position", "kv head", "dim")


@dataclass
class Case:
    index: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    seq_len: int  # 01: T, the sequence length; 02: pos + 1, the length after this step
    max_len: int = 0  # 02 only: positions in the cache row

    def describe(self) -> str:
        shape = f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
        if self.max_len:
            return f"case {self.index} (pos={self.seq_len - 1}, max_len={self.max_len}, {shape})"
        return f"case {self.index} (T={self.seq_len}, {shape})"

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5


def _random_shapes(num_cases: int, seed: int, fixed: list[tuple]) -> list[tuple[int, int, int, int]]:
    """(seq_len, num_heads, num_kv_heads, head_dim): small hand-picked cases first, then random ones."""
    rng = random.Random(seed)
    shapes = list(fixed[:num_cases])
    while len(shapes) < num_cases:
        kv, group = rng.choice([1, 2, 3, 4]), rng.choice([1, 2, 3, 4])
        shapes.append((rng.randint(1, 40), kv * group, kv, rng.choice([4, 8, 16, 32, 64])))
    return shapes


def plain_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_pos: torch.Tensor, scale: float,
                    mask: str = "causal", grouping: str = "interleave", softmax_over: str = "keys") -> torch.Tensor:
    """Attention in plain torch, with switches that reproduce common mistakes (used for the hints).

    q [Tq, H, D] at absolute positions q_pos [Tq]; keys/values [L, KV, D] at positions 0..L-1.
    mask: "causal" (key j <= query i), "none", "strict" (j < i), "ahead" (j <= i + 1).
    """
    H, KV = q.shape[1], keys.shape[1]
    if grouping == "interleave":  # query head h reads kv head h // (H // KV)
        k, v = keys.repeat_interleave(H // KV, dim=1), values.repeat_interleave(H // KV, dim=1)
    else:  # the classic bug: query head h reads kv head h % KV
        k, v = keys.repeat(1, H // KV, 1), values.repeat(1, H // KV, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [H, Tq, L]
    j, i = torch.arange(keys.shape[0]), q_pos[:, None]
    allowed = {"causal": j <= i, "none": j >= 0, "strict": j < i, "ahead": j <= i + 1}[mask]
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = scores.softmax(dim=-1 if softmax_over == "keys" else -2)
    return torch.einsum("hqk,khd->qhd", weights, v)


def _hint(got, variants: dict[str, torch.Tensor]) -> str | None:
    """The first known mistake whose output equals the learner's."""
    if not isinstance(got, torch.Tensor):
        return None
    for message, out in variants.items():
        # a row with no key to attend to is nan when masked, and 0 when sliced to nothing: accept both
        for form in (out, out.nan_to_num(0.0)):
            if form.shape == got.shape and torch.allclose(got.detach().float(), form, atol=1e-4, rtol=1e-4,
                                                          equal_nan=True):
                return message
    return None


# ---- exercise 01: causal attention over one sequence ---------------------------------------------

CAUSAL_CASES = [(1, 1, 1, 4), (4, 2, 2, 8), (5, 4, 2, 8), (3, 4, 1, 8), (6, 6, 2, 16), (12, 9, 3, 64)]


def reference_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The engine's rung-1 attention (NaiveBackend) on one sequence: q [T, H, D], k/v [T, KV, D] -> [T, H, D]."""
    meta = AttentionMetadata.build([q.shape[0]], [q.shape[0]])
    return NaiveBackend().forward(0, q, k, v, meta, scale)


def check_causal_attention(causal_attention: Callable, num_cases: int = 25, seed: int = 0) -> None:
    """Compare `causal_attention(q, k, v, scale)` with the engine on `num_cases` random sequences."""
    for index, (T, H, KV, D) in enumerate(_random_shapes(num_cases, seed, CAUSAL_CASES)):
        case = Case(index, H, KV, D, T)
        g = torch.Generator().manual_seed(seed * 10_000 + index)
        q, k, v = (torch.randn(T, h, D, generator=g) for h in (H, KV, KV))
        expected = reference_causal_attention(q, k, v, case.scale)
        got = causal_attention(q.clone(), k.clone(), v.clone(), case.scale)
        problem = first_difference(expected, got, OUT_DIMS)
        if problem is None:
            continue
        pos = torch.arange(T)
        variants = {
            "this is attention WITHOUT the scale: multiply q.k by `scale` (1/sqrt(head_dim)) before the softmax":
                plain_attention(q, k, v, pos, 1.0),
            "this is attention with NO causal mask: token i must not see the later tokens i+1..T-1":
                plain_attention(q, k, v, pos, case.scale, mask="none"),
            "the mask hides the token itself (j < i); token i attends to keys 0..i, INCLUDING i":
                plain_attention(q, k, v, pos, case.scale, mask="strict"),
            "the mask is off by one: token i also sees token i+1; allow key j only when j <= i":
                plain_attention(q, k, v, pos, case.scale, mask="ahead"),
            "query head h was paired with kv head h % num_kv_heads (torch .repeat); GQA pairs it with kv head "
            "h // (num_heads // num_kv_heads), which is what .repeat_interleave(group, dim=1) gives":
                plain_attention(q, k, v, pos, case.scale, grouping="repeat"),
            "the softmax ran over the queries; it must normalize over the keys (the last axis of the scores)":
                plain_attention(q, k, v, pos, case.scale, softmax_over="queries"),
        }
        fail(case.describe(), "the attention output [T, num_heads, head_dim] differs from the engine's", problem,
             _hint(got, variants))
    passed(num_cases, "causal_attention matches the engine's naive attention")


# ---- exercise 02: one decode step with a KV cache -------------------------------------------------

DECODE_CASES = [(1, 1, 1, 4, 4), (4, 2, 2, 8, 8), (6, 4, 2, 8, 8), (8, 4, 1, 8, 8), (11, 6, 2, 16, 16),
                (21, 9, 3, 64, 32)]  # (pos + 1, num_heads, num_kv_heads, head_dim, max_len)


def reference_decode_step(q, k_new, v_new, k_cache, v_cache, pos: int, scale: float) -> torch.Tensor:
    """The engine's rung-2 step (ContiguousBackend, one layer, one row); writes the caches in place, as the
    exercise does."""
    max_len, KV, D = k_cache.shape
    rows = RowPool(1, 1, max_len, KV, D, k_cache.dtype, k_cache.device)
    rows.k_cache[0, 0], rows.v_cache[0, 0] = k_cache, v_cache
    meta = ContiguousMetadata.build([1], [pos + 1], cache_rows=torch.tensor([0]))
    out = ContiguousBackend(rows).forward(0, q[None], k_new[None], v_new[None], meta, scale)[0]
    k_cache.copy_(rows.k_cache[0, 0])
    v_cache.copy_(rows.v_cache[0, 0])
    return out


def _decode_shapes(num_cases: int, seed: int) -> list[tuple[int, int, int, int, int]]:
    rng = random.Random(seed + 1)
    shapes = []
    for T, H, KV, D in _random_shapes(num_cases, seed, [c[:4] for c in DECODE_CASES]):
        max_len = DECODE_CASES[len(shapes)][4] if len(shapes) < len(DECODE_CASES) else T + rng.randint(0, 24)
        shapes.append((T, H, KV, D, max_len))
    return shapes


def check_decode_step(decode_step: Callable, num_cases: int = 25, seed: int = 0) -> None:
    """Compare `decode_step(q, k_new, v_new, k_cache, v_cache, pos, scale)` with the engine: first the cache
    writes, then the output."""
    for index, (T, H, KV, D, max_len) in enumerate(_decode_shapes(num_cases, seed)):
        case, pos = Case(index, H, KV, D, T, max_len), T - 1
        g = torch.Generator().manual_seed(seed * 10_000 + index)
        q = torch.randn(H, D, generator=g)
        k_new, v_new = torch.randn(KV, D, generator=g), torch.randn(KV, D, generator=g)
        # the row: the past at [0, pos), stale numbers from an earlier request everywhere else
        k_cache0, v_cache0 = (torch.randn(max_len, KV, D, generator=g) for _ in range(2))
        k_cache0[pos:] = 3 * torch.randn(max_len - pos, KV, D, generator=g) + 2
        v_cache0[pos:] = 3 * torch.randn(max_len - pos, KV, D, generator=g) - 2
        k_want, v_want = k_cache0.clone(), v_cache0.clone()
        expected = reference_decode_step(q, k_new, v_new, k_want, v_want, pos, case.scale)
        k_got, v_got = k_cache0.clone(), v_cache0.clone()
        got = decode_step(q.clone(), k_new.clone(), v_new.clone(), k_got, v_got, pos, case.scale)

        for name, want, have, new in (("k_cache", k_want, k_got, "k_new"), ("v_cache", v_want, v_got, "v_new")):
            problem = first_difference(want, have, CACHE_DIMS)
            if problem is None:
                continue
            if torch.equal(have, k_cache0 if name == "k_cache" else v_cache0):
                hint = (f"{name} was not changed: write {new} into {name}[pos] in place ({name}[pos] = {new}), "
                        "not into a copy")
            elif pos + 1 < max_len and torch.allclose(have[pos + 1], want[pos]):
                hint = (f"{new} was written at pos + 1; it belongs at pos (positions count from 0: a row holding "
                        "pos tokens has its next free slot at index pos)")
            else:
                hint = f"only {name}[pos] may change, and it must become {new}"
            fail(case.describe(), f"{name} after the call differs from the engine's", problem, hint)

        problem = first_difference(expected, got, DECODE_OUT_DIMS)
        if problem is None:
            continue
        at = torch.tensor([pos])
        variants = {
            "this is attention WITHOUT the scale: multiply q.k by `scale` (1/sqrt(head_dim)) before the softmax":
                plain_attention(q[None], k_want, v_want, at, 1.0)[0],
            "this attends over the WHOLE row [0, max_len), stale positions included; read only k_cache[:pos + 1]":
                plain_attention(q[None], k_want, v_want, at, case.scale, mask="none")[0],
            "this attends over [0, pos) and leaves out the new token; read k_cache[:pos + 1]":
                plain_attention(q[None], k_want, v_want, at, case.scale, mask="strict")[0],
            "this attends over the row BEFORE the new K/V were written; write first, then attend":
                plain_attention(q[None], k_cache0, v_cache0, at, case.scale)[0],
            "query head h was paired with kv head h % num_kv_heads (torch .repeat); GQA pairs it with kv head "
            "h // (num_heads // num_kv_heads), which is what .repeat_interleave(group, dim=1) gives":
                plain_attention(q[None], k_want, v_want, at, case.scale, grouping="repeat")[0],
        }
        fail(case.describe(), "the attention output [num_heads, head_dim] differs from the engine's", problem,
             _hint(got, variants))
    passed(num_cases, "decode_step writes the cache and attends like the engine's contiguous backend")


# ---- the learner's function inside the running engine ---------------------------------------------

def _compare_generation(llm, mine, prompt, max_tokens: int, what: str) -> None:
    """Greedy tokens of `mine` (the engine with the learner's function in its seam) against `llm`'s."""
    from minikv.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    got = mine.generate(prompt, params)[0]  # the learner's function first: an unfinished stub fails at once
    expected = llm.generate(prompt, params)[0]
    show = (lambda ids: repr(llm.tokenizer.decode(ids))) if llm.tokenizer is not None else str
    for i, (a, b) in enumerate(zip(expected.token_ids, got.token_ids)):
        if a != b:
            raise AssertionError(
                f"generated token {i} differs: the engine chose {a} ({show([a])}), with your {what} the model chose "
                f"{b} ({show([b])}); tokens 0..{i - 1} matched: {show(expected.token_ids[:i])}")
    text = show(got.token_ids)
    print(f"the engine generated the same {len(got.token_ids)} tokens with your {what}: {text}")


def check_causal_attention_in_engine(llm, causal_attention: Callable, prompt, max_tokens: int = 16) -> None:
    """Generate greedily with the learner's function in the engine's rung-1 seam,
    `LLM(..., kv_backend="naive", causal_attention=causal_attention)`, then with the engine's own
    attention; the tokens must be the same."""
    if llm.kv_backend != "naive":
        raise ValueError(f"this LLM uses kv_backend={llm.kv_backend!r}; build it with kv_backend='naive'")
    _compare_generation(llm, llm.derive(causal_attention=causal_attention), prompt, max_tokens, "causal_attention")


def check_decode_step_in_engine(llm, decode_step: Callable, prompt, max_tokens: int = 16) -> None:
    """Generate greedily with the learner's function in the engine's rung-2 seam,
    `LLM(..., kv_backend="contiguous", decode_step=decode_step)`, then with the engine's own decode
    steps; the tokens must be the same."""
    if llm.kv_backend != "contiguous":
        raise ValueError(f"this LLM uses kv_backend={llm.kv_backend!r}; build it with kv_backend='contiguous'")
    _compare_generation(llm, llm.derive(decode_step=decode_step), prompt, max_tokens, "decode_step")
