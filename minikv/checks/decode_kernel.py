"""Checker for exercise 08a: the inner loop of the paged decode kernel, in Triton's interpreter.

    @triton.jit
    def online_softmax_block(q, k, v, valid, m_i, l_i, acc, scale_log2e, DOT_PRECISION: tl.constexpr):
        q      [GROUP_PAD, D]   the query heads of one KV head      k, v  [BLOCK_N, D]  one tile of keys/values
        valid  [BLOCK_N]        False where the tile runs past the sequence (or the split)
        m_i    [GROUP_PAD]      running max of the scores, in log2 units (starts at -inf)
        l_i    [GROUP_PAD]      running sum of exp2(score - m_i)        (starts at 0)
        acc    [GROUP_PAD, D]   running sum of exp2(score - m_i) * v    (starts at 0)
        returns the updated (m_i, l_i, acc); the kernel divides acc by l_i at the end

Three stages, each stopping at the first problem with a message that says where:
  1. one call on random inputs (a first tile, a later tile that raises the max, a part-masked tile),
     compared with the same formulas in float64; known mistakes are named
  2. the whole decode kernel with your loop on random paged batches (ragged lengths, GQA, split-K),
     compared with the torch paged reference: which sequence, which block, max error
  3. (check_decode_kernel_in_engine) the engine generates with your loop; the tokens must match rung 4's
The kernel reads one pool block per tile here (BLOCK_N = block_size = 16), so "tile" and "block" agree.

Your function enters each stage the way it enters the engine: as an argument, never by replacing
minikv's own (`paged_decode_attention(..., inner_loop=fn)`, `LLM(..., decode_inner_loop=fn)`).
"""
from __future__ import annotations

import functools
import math
import os

import torch

from minikv.checks.report import fail, first_difference, passed

BLOCK = 16  # tokens per pool block, and per tile of the inner loop, in these checks


def _require_interpreter() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise RuntimeError("this check runs the kernel in Triton's interpreter: set "
                           "os.environ['TRITON_INTERPRET'] = '1' in the first cell, before anything imports triton, "
                           "and restart the kernel")


def _as_jit(fn):
    """`fn` as a Triton function (the learner's cell decorates it with @triton.jit; a plain one is wrapped)."""
    _require_interpreter()
    import minikv.kernels  # noqa: F401, I001  (before triton: on a CPU it switches Triton to its interpreter)
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    return fn if isinstance(fn, InterpretedFunction) else triton.jit(fn)


def _run_kernel(call):
    """Run a kernel launch; turn the interpreter's wrapped errors back into what the learner raised."""
    from triton.runtime.errors import InterpreterError

    try:
        return call()
    except InterpreterError as e:
        text = str(e)
        if "NotImplementedError" in text:
            raise NotImplementedError("online_softmax_block still raises NotImplementedError: write its body") from None
        raise AssertionError(f"the kernel failed inside your online_softmax_block:\n{text[:600]}") from None


# ---- stage 1: one call of the inner loop --------------------------------------------------------

@functools.cache
def _one_step_kernel():
    """One call of an inner loop (the constexpr STEP) on tensors loaded whole, its results stored."""
    import triton
    import triton.language as tl

    @triton.jit
    def one_step(q_ptr, k_ptr, v_ptr, valid_ptr, m_ptr, l_ptr, acc_ptr, m_out, l_out, acc_out, scale_log2e,
                 STEP: tl.constexpr, G: tl.constexpr, N: tl.constexpr, D: tl.constexpr):
        g = tl.arange(0, G)
        n = tl.arange(0, N)
        d = tl.arange(0, D)
        q = tl.load(q_ptr + g[:, None] * D + d[None, :])
        k = tl.load(k_ptr + n[:, None] * D + d[None, :])
        v = tl.load(v_ptr + n[:, None] * D + d[None, :])
        valid = tl.load(valid_ptr + n) != 0
        m = tl.load(m_ptr + g)
        l = tl.load(l_ptr + g)
        acc = tl.load(acc_ptr + g[:, None] * D + d[None, :])
        m, l, acc = STEP(q, k, v, valid, m, l, acc, scale_log2e, "ieee")
        tl.store(m_out + g, m)
        tl.store(l_out + g, l)
        tl.store(acc_out + g[:, None] * D + d[None, :], acc)

    return one_step


def reference_step(q, k, v, valid, m, l, acc, scale_log2e, mistake: str | None = None):
    """The inner loop in float64 torch; `mistake` reproduces a common error (for the hints)."""
    q, k, v, m, l, acc = (t.double() for t in (q, k, v, m, l, acc))
    s = q @ k.T * (1.0 if mistake == "no_scale" else scale_log2e)
    if mistake != "no_mask":
        s = s.masked_fill(~valid[None, :], float("-inf"))
    exp = torch.exp if mistake == "natural_exp" else torch.exp2
    m_new = torch.maximum(m, s.max(dim=1).values)
    alpha = exp(m - m_new)
    p = exp(s - m_new[:, None])
    if mistake == "no_rescale":
        alpha = torch.ones_like(alpha)
    if mistake == "old_max":  # rescaled with the max of this tile only
        p = exp(s - s.max(dim=1).values[:, None])
    return m_new, l * alpha + p.sum(dim=1), acc * alpha[:, None] + p @ v


HINTS = {
    "no_rescale": "when the max grows, what you summed so far was measured against the old max: multiply l_i and "
                  "acc by alpha = exp2(m_i - m_new) before adding this tile",
    "no_mask": "positions where `valid` is False must not count: set their scores to -inf before the max",
    "no_scale": "multiply the scores q.k by scale_log2e (the softmax scale times log2(e))",
    "natural_exp": "the scores are in log2 units (scale_log2e carries log2(e)): use tl.exp2, not tl.exp",
    "old_max": "take p = exp2(s - m_new) against the NEW running max, the same one you rescale l_i and acc to",
}


def _step_cases(seed: int):
    g = torch.Generator().manual_seed(seed)
    G, N, D = 16, BLOCK, 32
    scale_log2e = D**-0.5 * math.log2(math.e)
    q, k, v = (torch.randn(r, D, generator=g) for r in (G, N, N))
    first = ("a first tile (m_i = -inf, l_i = 0, acc = 0)", q, k, v, torch.ones(N, dtype=torch.bool),
             torch.full((G,), float("-inf")), torch.zeros(G), torch.zeros(G, D))
    # a later tile whose scores beat the running max on some heads and not on others
    m0 = torch.randn(G) * 2
    later = ("a later tile that raises the running max of some heads", q * 2, k, v, torch.ones(N, dtype=torch.bool),
             m0, torch.rand(G) * 5 + 1, torch.randn(G, D, generator=g))
    valid = torch.arange(N) < 5
    masked = ("a tile where only the first 5 of 16 positions are valid", q, k, v, valid, m0, torch.rand(G) + 1,
              torch.randn(G, D, generator=g))
    return [first, later, masked], scale_log2e


def check_online_softmax_block(fn, seed: int = 0) -> None:
    """Stage 1: one call of `fn`, on three kinds of tile, against the same formulas in float64."""
    step = _as_jit(fn)
    kernel = _one_step_kernel()
    cases, scale_log2e = _step_cases(seed)
    for name, q, k, v, valid, m, l, acc in cases:
        G, D = acc.shape
        outs = [torch.full_like(t, float("nan")) for t in (m, l, acc)]
        _run_kernel(lambda: kernel[(1,)](q, k, v, valid.to(torch.int8), m, l, acc, *outs, scale_log2e,
                                         STEP=step, G=G, N=k.shape[0], D=D))
        want = reference_step(q, k, v, valid, m, l, acc, scale_log2e)
        for label, have, expect, dims in zip(("m_i", "l_i", "acc"), outs, want,
                                             (("head",), ("head",), ("head", "dim"))):
            problem = first_difference(expect.float(), have, dims, atol=1e-4, rtol=1e-4)
            if problem:
                hint = None
                for mistake, text in HINTS.items():
                    alt = reference_step(q, k, v, valid, m, l, acc, scale_log2e, mistake)
                    if all(torch.allclose(a.float(), h, atol=1e-4, rtol=1e-4) for a, h in zip(alt, outs)):
                        hint = text
                        break
                fail(f"one call on {name}", f"the {label} you return is wrong", problem, hint)
    passed(len(cases), "online_softmax_block matches the float64 formulas on a first, a later and a "
                       "part-masked tile")


# ---- stage 2: the whole kernel -------------------------------------------------------------------

def scattered_block_tables(seq_lens, block_size: int, spare_blocks: int, g: torch.Generator):
    """A pool of sum(blocks needed) + spare_blocks blocks handed out in a shuffled order: (num_blocks,
    tables [num_seqs, most blocks needed], -1 padded). The blocks of a sequence are never contiguous."""
    need = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(need) + spare_blocks
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(seq_lens), max(need)), -1, dtype=torch.long)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = order[used:used + n]
        used += n
    return num_blocks, tables


def _paged_case(seq_lens, group, num_kv_heads, head_dim, seed):
    g = torch.Generator().manual_seed(seed)
    num_blocks, tables = scattered_block_tables(seq_lens, BLOCK, 4, g)
    k_cache = torch.randn(num_blocks, BLOCK, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, BLOCK, num_kv_heads, head_dim, generator=g)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=g)
    return q, k_cache, v_cache, tables


def torch_decode_reference(q, k_cache, v_cache, tables, seq_lens) -> torch.Tensor:
    """Rung 4's paged attention for one query token per sequence, in float64."""
    from minikv.attention.common import attend
    from minikv.attention.metadata import AttentionMetadata

    B, L = len(seq_lens), max(seq_lens)
    meta = AttentionMetadata.build([1] * B, list(seq_lens))
    t = tables.clamp(min=0)
    keys = k_cache[t].reshape(B, -1, *k_cache.shape[2:])[:, :L].double()
    values = v_cache[t].reshape(B, -1, *v_cache.shape[2:])[:, :L].double()
    return attend(q.double(), keys, values, meta, q.shape[-1] ** -0.5)


def _decode(step, q, k_cache, v_cache, tables, seq_lens, num_splits):
    from minikv.kernels import paged_decode_attention

    out = torch.full_like(q, float("nan"))
    _run_kernel(lambda: paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(seq_lens), q.shape[-1] ** -0.5,
                                               num_splits=num_splits, block_n=BLOCK, out=out, inner_loop=step))
    return out


def check_decode_kernel(fn, seed: int = 0) -> None:
    """Stage 2: minikv's decode kernel with `fn` as its inner loop vs the torch paged reference."""
    cases = [  # (seq_lens, group, num_kv_heads, head_dim, num_splits)
        ([1, 16, 40], 1, 2, 16, 1),
        ([33, 5, 64], 3, 2, 32, 1),
        ([100, 17, 1], 4, 1, 16, 3),
    ]
    step = _as_jit(fn)
    for i, (lens, group, kvh, D, splits) in enumerate(cases):
        q, k_cache, v_cache, tables = _paged_case(lens, group, kvh, D, seed + i)
        out = _decode(step, q, k_cache, v_cache, tables, lens, splits)
        want = torch_decode_reference(q, k_cache, v_cache, tables, lens).float()
        for b, L in enumerate(lens):
            problem = first_difference(want[b], out[b], ("head", "dim"), atol=1e-4, rtol=1e-4)
            if problem is None:
                continue
            where = _first_wrong_block(step, q, k_cache, v_cache, tables, lens, b, splits)
            desc = (f"case {i} ({len(lens)} sequences of lengths {lens}, {group} query heads per KV head, "
                    f"{splits} split{'s' if splits > 1 else ''}): sequence {b} (length {L}, blocks "
                    f"{tables[b, :math.ceil(L / BLOCK)].tolist()})")
            fail(desc, f"the output of sequence {b} is wrong", f"{where}\n{problem}",
                 "run check_online_softmax_block first; once it passes, look at what differs between tiles: "
                 "the masked tail of the last block, or the state carried from one call to the next")
    passed(len(cases), "the decode kernel with your inner loop equals the torch paged reference "
                       "(ragged lengths, GQA, split-K)")


def _first_wrong_block(step, q, k_cache, v_cache, tables, lens, b, splits) -> str:
    """Shorten sequence b block by block to find the first prefix the kernel gets wrong."""
    for n in range(1, math.ceil(lens[b] / BLOCK) + 1):
        prefix = list(lens)
        prefix[b] = min(n * BLOCK, lens[b])
        out = _decode(step, q, k_cache, v_cache, tables, prefix, splits)
        want = torch_decode_reference(q, k_cache, v_cache, tables, prefix).float()
        err = (out[b] - want[b]).abs().max().item()
        if not err <= 1e-4:  # NaN counts as wrong
            return (f"first wrong after reading {n} block{'s' if n > 1 else ''} (logical block {n - 1}, pool block "
                    f"{int(tables[b, n - 1])}, positions [{(n - 1) * BLOCK}, {prefix[b]})): max error {err:.3g}")
    return "every prefix is right on its own: the problem shows only with the whole batch"


# ---- stage 3: in the engine ----------------------------------------------------------------------

def check_decode_kernel_in_engine(fn, max_tokens: int = 6) -> None:
    """Stage 3: tiny-random generates through the Triton backend with your inner loop; the greedy
    tokens must equal the torch paged backend's (rung 4)."""
    from minikv.engine.llm import LLM
    from minikv.engine.sampling_params import SamplingParams

    prompts = [list(range(10, 40)), [7, 8, 9], list(range(100, 117))]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    kw = dict(device="cpu", kv_backend="paged", block_size=BLOCK, num_blocks=32, max_num_batched_tokens=64)
    want = [o.token_ids for o in LLM("tiny-random", attention="torch", **kw).generate(prompts, params)]
    llm = LLM("tiny-random", attention="triton", decode_inner_loop=_as_jit(fn), **kw)
    have = [o.token_ids for o in _run_kernel(lambda: llm.generate(prompts, params))]
    for i, (w, h) in enumerate(zip(want, have)):
        if w != h:
            j = next(k for k, (a, c) in enumerate(zip(w, h)) if a != c)
            fail(f"request {i} (prompt of {len(prompts[i])} tokens)", "the generated tokens differ",
                 f"token {j}: the engine with your inner loop says {h[j]}, rung 4 says {w[j]}\n"
                 f"yours: {h}\nrung 4: {w}")
    passed(len(prompts), f"tiny-random generates the same {max_tokens} greedy tokens with your inner loop "
                         "as with rung 4")
