"""Temperature and top-p sampling of whole rows on the GPU, with no sort and no host round trip.

The torch sampler (minikv/engine/sampler.py) draws a row's token as

    argmax over the allowed set S of   s_i + g_i,    s = logits / T,   g_i = Gumbel noise of (key, i)

and finds S, the top-p nucleus, among the row's most likely candidates; when S may reach past them (a
flat distribution) it has to ask the host, then sort the whole vocabulary. This kernel finds the same
token without knowing S in advance. Order the vocabulary by (s descending, id ascending); S is a prefix
of that order: token j is in S when the mass before it is below top_p. Then, with one noise draw:

    pivot = the end of the vocabulary
    repeat:  j = argmax of s_i + g_i over the tokens before pivot   (the next arrival of the race)
             if mass before j < top_p: answer j
             else: pivot = j    (j and everything after it are outside S; S lies before j)

Every token after a rejected j is outside S too, so j is the first token of S in the order of the
noise: argmax over S of s + g, the torch sampler's token, from softmax(s) renormalised on S. Each round
is one pass over the row; at top_p = 0.95 the first draw is accepted 95% of the time. Rows without
top-p (top_p = 1) take one pass and no probabilities. One program per row.

    logits    [B, V] any float dtype
    packed    [R, 5] int64, a row per draw (minikv/engine/sampler.py's `pack_draws`): the float32 bits of
              temperature and top_p, top_k (must be 0 here), the 63-bit draw key, the row of logits
    out       [R] int64, the drawn ids
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from minikv.kernels.interpreter import interpreted

_GOLDEN = tl.constexpr(0x9E3779B97F4A7C15)  # the constants of minikv.engine.sampler's hash
_M1 = tl.constexpr(0xBF58476D1CE4E5B9)
_M2 = tl.constexpr(0x94D049BB133111EB)


if interpreted():  # the interpreter has no libdevice
    @triton.jit
    def _log(x):
        return tl.log(x)
else:
    @triton.jit
    def _log(x):
        """The hardware's approximate log (lg2.approx, relative error ~2^-21); tl.log compiles to
        libdevice's logf, a call with branches per element (benchmarks/NOTES_sampler.md)."""
        return libdevice.fast_logf(x)


@triton.jit
def _scaled(logits_row, offs, vocab, inv_t):
    """s = logits / T for one tile, -inf past the vocabulary."""
    return tl.load(logits_row + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32) * inv_t


@triton.jit
def _scores(logits_row, offs, vocab, inv_t, key):
    """s = logits / T and s + Gumbel noise of (key, id) for one tile; the hash is minikv.engine.sampler's
    `uniform_noise`, in uint64 lanes."""
    valid = offs < vocab
    s = _scaled(logits_row, offs, vocab, inv_t)
    x = key ^ (offs.to(tl.uint64) * _GOLDEN)
    x = x + _GOLDEN
    x = (x ^ (x >> 30)) * _M1
    x = (x ^ (x >> 27)) * _M2
    x = x ^ (x >> 31)
    u = ((x >> 41).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    return s, valid, s - _log(-_log(u))


@triton.jit
def _sample_rows_kernel(
    logits_ptr, stride_b, packed_ptr, out_ptr,
    vocab,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    draw = packed_ptr + r * 5
    temperature = tl.load(draw).to(tl.int32).to(tl.float32, bitcast=True)
    top_p = tl.load(draw + 1).to(tl.int32).to(tl.float32, bitcast=True)
    key = tl.load(draw + 3).to(tl.uint64, bitcast=True)
    logits_row = logits_ptr + tl.load(draw + 4) * stride_b
    inv_t = 1.0 / temperature
    filtering = top_p < 1.0

    # Each lane keeps its own running values over the tiles; the lanes are combined once, after the
    # loop (a reduction per tile would cost more than the tile's arithmetic).
    lanes = tl.arange(0, BLOCK)
    lse = 0.0  # log-sum-exp of s, for the probabilities top-p compares
    if filtering:
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab, BLOCK):
            offs = start + lanes
            s = _scaled(logits_row, offs, vocab, inv_t)
            m_new = tl.maximum(m, s)
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a lane that has seen only -inf adds 0
            total = total * tl.exp(m - shift) + tl.exp(s - shift)
            m = m_new
        m_row = tl.max(m, 0)
        lse = m_row + tl.log(tl.sum(total * tl.exp(m - m_row), 0))

    pivot_s = float("-inf")  # tokens before the pivot: s > pivot_s, or s == pivot_s and id < pivot_id
    pivot_id = vocab
    best_id = 0
    searching = 1
    while searching == 1:
        lane_best = tl.full([BLOCK], float("-inf"), tl.float32)
        lane_id = tl.full([BLOCK], 0, tl.int32)
        lane_s = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in range(0, vocab, BLOCK):
            offs = start + lanes
            s, valid, score = _scores(logits_row, offs, vocab, inv_t, key)
            before = valid & ((s > pivot_s) | ((s == pivot_s) & (offs < pivot_id)))
            better = before & (score > lane_best)  # strict: a lane keeps its lowest id among equals
            lane_best = tl.where(better, score, lane_best)
            lane_id = tl.where(better, offs, lane_id)
            lane_s = tl.where(better, s, lane_s)
        best = tl.max(lane_best, 0)
        best_id = tl.min(tl.where(lane_best == best, lane_id, vocab), 0)
        best_s = tl.max(tl.where(lane_id == best_id, lane_s, float("-inf")), 0)
        searching = 0
        if filtering:
            mass = tl.zeros([BLOCK], tl.float32)  # probability of the tokens before best_id in the order
            for start in range(0, vocab, BLOCK):
                offs = start + lanes
                s = _scaled(logits_row, offs, vocab, inv_t)
                ahead = (s > best_s) | ((s == best_s) & (offs < best_id))
                mass += tl.where(ahead, tl.exp(s - lse), 0.0)
            if tl.sum(mass, 0) >= top_p:  # best_id lies outside the nucleus: so does everything after it
                pivot_s = best_s
                pivot_id = best_id
                searching = 1
    tl.store(out_ptr + r, best_id.to(tl.int64))


def sample_rows(logits: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """Draw one token for each row of `packed` (see the module's docstring) from `logits` [B, V]; top_k
    must be 0 for these rows. Returns int64 [R] on the logits' device."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [batch, vocab] with contiguous rows, got shape "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    if packed.dim() != 2 or packed.shape[1] != 5 or packed.dtype != torch.int64 or not packed.is_contiguous():
        raise ValueError(f"packed must be a contiguous [draws, 5] int64 tensor, got {tuple(packed.shape)} "
                         f"{packed.dtype}")
    if packed.device != logits.device:
        raise ValueError(f"packed is on {packed.device} and the logits on {logits.device}: the kernel reads both "
                         "on one device (packed.to(logits.device))")
    if logits.device.type != "cuda" and not interpreted():
        raise ValueError(f"the sampling kernel runs on a CUDA device, or on the CPU in Triton's interpreter "
                         f"(TRITON_INTERPRET=1 before triton is imported); the logits are on {logits.device}")
    out = torch.empty(packed.shape[0], dtype=torch.long, device=logits.device)
    if packed.shape[0] == 0:
        return out
    vocab = logits.shape[1]
    block = triton.next_power_of_2(vocab) if interpreted() else 2048
    launch = {} if interpreted() else {"num_warps": 8}
    _sample_rows_kernel[(packed.shape[0],)](logits, logits.stride(0), packed, out, vocab, BLOCK=block, **launch)
    return out
