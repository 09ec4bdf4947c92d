"""Paged decode attention: one new token per sequence attends over its whole cached context.

Decode is memory-bound: every step reads each sequence's K and V once and does ~2 FLOPs per byte
read, so the kernel's one job is to stream the pool at the card's bandwidth. It reads K/V in place
through the block table (no gather into a contiguous copy) and keeps everything else in registers.

    grid = (batch, num_kv_heads, num_splits)   one program = one KV head of one sequence, one split

    GQA: a program serves all `group = num_heads // num_kv_heads` query heads of its KV head, so
    each K/V byte is read once for the whole group (never repeated per query head).

    split-K: the batch's longest context is cut into `num_splits` ranges of whole tiles, read by
    separate programs, so a small batch still fills the GPU (a shorter sequence leaves its last
    splits empty). Each split writes a partial result normalised by its own softmax sum plus its
    log-sum-exp (-inf for an empty split); a second kernel merges the splits.

    sequence b, seq_len = 70, the longest, block_size = 16, num_splits = 2, tile BLOCK_N = 32:
    positions   [0 ............ 31 | 32 ........... 63]  [64 .. 69]
    split 0:    tiles [0, 32) [32, 64)                   split 1: tile [64, 70) (rest masked)
    each tile's token p lives at  k_cache[block_table[b, p // block_size], p % block_size, kv_head]

Inner loop (online softmax): for each tile, with scores s = q . k * scale, keep per query head a
running max m, a running sum l = sum exp(s - m) and an accumulator acc = sum exp(s - m) v; when a
tile raises the max, rescale l and acc by exp(m_old - m_new). The result is acc / l.
Exponentials are base 2 (exp2 is one instruction on a GPU): scores carry a factor log2(e).

Keeping the copies in flight (benchmarks/NOTES_decode.md, runs 7-16):
- a program holds the block-table entries of ~TABLE_CHUNK_POSITIONS positions in registers and
  takes each tile's blocks from them (tl.gather). No K/V address then waits on a load made in the
  same iteration, so the compiler can fetch the next tiles' K/V while this one's math runs
  (num_stages > 2); with the table read inside the loop it waited for every copy first.
- a split's range comes from the longest span, known on the host: without a sliding window the
  first table entries, q and the sequence length are loaded at once (one memory latency, not two).
  Under a CUDA graph the host knows only a bound (max_model_len); there `split_per_seq` cuts each
  sequence's own length instead, paying that second latency so that no split is empty or overlong.
- on compute capability 9+ the merge is launched as a programmatic dependent: its programs are
  scheduled while the split kernel drains, and wait for its results (gdc_wait).

Limits: head_dim any (padded to a power of two), block_size any >= 1 (the engine uses powers of
two), any context length, group size any (padded to 16 rows for the tensor-core dot), the pool in
any storage order with a contiguous head_dim (token- or head-major: only strides are read). fp16
and bf16 on a GPU, fp32 too (exact dot); in the interpreter fp32 and fp16. A quantized pool (int8
or fp8 with per token and head scales, minikv/cache/blocks/quant.py) is dequantized tile by tile as it is
read (minikv/kernels/quant.py), before the inner loop: the seam below sees K/V in q's dtype either way.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from minikv.kernels.quant import load_kv_tiles, quant_args


@triton.jit
def online_softmax_block(q, k, v, valid, m_i, l_i, acc, scale_log2e, DOT_PRECISION: tl.constexpr):
    """Fold one tile of keys/values into the running softmax of every query head of the group.

    q [GROUP_PAD, D]  k, v [BLOCK_N, D]  valid [BLOCK_N] (False: beyond the range, masked)
    m_i, l_i [GROUP_PAD] fp32: running max (log2 units) and sum;  acc [GROUP_PAD, D] fp32
    DOT_PRECISION: "ieee" for fp32 inputs (a GPU would round them to TF32), None otherwise
    """
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e  # [GROUP_PAD, BLOCK_N] log2 units
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)  # how much the old max overstated: rescale what we have
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_split_kernel(
    q_ptr,  # [B, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], any strides (token- or head-major storage)
    v_cache_ptr,  # same layout and strides as k_cache
    k_scale_ptr, v_scale_ptr,  # [num_blocks, block_size, num_kv_heads] fp32 when QUANT (else unused)
    k_zero_ptr, v_zero_ptr,  # the same shape, fp32 zero points when HAS_ZERO (int8; else unused)
    block_tables_ptr,  # [B, table_width] physical block ids (-1 = none, never read)
    seq_lens_ptr,  # [B]
    out_ptr,  # [B, num_heads, head_dim]   written directly when SINGLE_SPLIT
    part_out_ptr,  # [B, num_heads, num_splits, HEAD_PAD] fp32  each split's normalised output
    part_lse_ptr,  # [B, num_heads, num_splits] fp32            each split's log2-sum-exp2
    trace_ptr,  # [B, num_kv_heads, table_width] int32: which split read each block (TRACE only)
    scale_log2e,
    window,  # sliding window (keys in (pos - window, pos]); used when HAS_WINDOW
    sinks,  # sink tokens: keys [0, sinks) are seen too, read by split 0 before its range; used when HAS_SINKS
    num_splits,
    split_len,  # positions per split, whole tiles: the longest span in the batch cut num_splits ways
    #             (SPLIT_PER_SEQ: unused, each program cuts its own sequence's span instead)
    table_width,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_sb, stride_ss, stride_sh,
    stride_bt,
    stride_ob, stride_oh,
    stride_trace,
    SINGLE_SPLIT: tl.constexpr,  # num_splits == 1: write the output directly, no merge
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per pool block
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,  # tokens per tile of the inner loop
    CHUNK_N: tl.constexpr,  # positions whose block-table entries are held in registers at once
    TABLE_CHUNK: tl.constexpr,  # entries that covers (a power of two)
    DOT_PRECISION: tl.constexpr,
    TRACE: tl.constexpr,
    USE_PDL: tl.constexpr,  # the merge is launched as a programmatic dependent (GPU, compute capability >= 9)
    INNER_LOOP: tl.constexpr,  # the @triton.jit function that folds one tile in (online_softmax_block's signature)
    QUANT: tl.constexpr,  # the pool holds int8/fp8 values and scales: dequantize each tile as it is read
    HAS_ZERO: tl.constexpr,  # int8: x = q * scale + zero (fp8: q * scale)
    SPLIT_PER_SEQ: tl.constexpr = False,  # ranges cut from this sequence's own length (loaded first)
):
    if USE_PDL:  # the merge's programs may start now and wait (gdc_wait) for this grid's results
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_kv_heads = tl.num_programs(1)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    t = tl.arange(0, TABLE_CHUNK)

    # This split's range [start, end). Without a window its start needs no load, so the first
    # block-table entries, q and the length are fetched at once: one memory latency, not two.
    if HAS_WINDOW:
        seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
        if SPLIT_PER_SEQ:
            span = tl.maximum(tl.minimum(seq_len, window), 1)
            split_len = tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N
        start = tl.maximum(seq_len - window, 0) + split * split_len
    elif SPLIT_PER_SEQ:  # one more latency before the first loads, but no split is empty or overlong
        seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
        split_len = tl.cdiv(tl.cdiv(tl.maximum(seq_len, 1), num_splits), BLOCK_N) * BLOCK_N
        start = split * split_len
    else:
        start = split * split_len
    base = start // BLOCK_SIZE
    blocks = tl.load(table + base + t, mask=base + t < table_width, other=0)  # entries of [start, start + CHUNK_N)
    heads = kv_head * GROUP + tl.arange(0, GROUP_PAD)  # the query heads of this KV head
    head_ok = tl.arange(0, GROUP_PAD) < GROUP
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=head_ok[:, None] & d_ok[None, :], other=0.0)
    if not HAS_WINDOW and not SPLIT_PER_SEQ:
        seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    end = tl.where(split == num_splits - 1, seq_len, tl.minimum(start + split_len, seq_len))  # the last takes any rest
    if start >= end:  # a shorter sequence leaves its last splits empty: an lse of -inf gives them weight 0
        if not SINGLE_SPLIT:
            part = (b * (num_kv_heads * GROUP) + heads) * num_splits + split
            tl.store(part_lse_ptr + part, tl.full([GROUP_PAD], float("-inf"), tl.float32), mask=head_ok)
        return

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
    if HAS_SINKS:  # split 0 also folds in the sinks [0, sinks) that lie before the window (start = its start)
        sink_end = tl.where(split == 0, tl.minimum(sinks, start), 0)
        for tile in range(0, sink_end, BLOCK_N):
            pos = tile + tl.arange(0, BLOCK_N)
            valid = pos < sink_end
            block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            k, v = load_kv_tiles(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, k_zero_ptr, v_zero_ptr, block, pos,
                                 kv_head, d, valid, d_ok, stride_kb, stride_ks, stride_kh, stride_sb, stride_ss,
                                 stride_sh, BLOCK_SIZE, QUANT, HAS_ZERO)
            k, v = k.to(q.dtype), v.to(q.dtype)
            m_i, l_i, acc = INNER_LOOP(q, k, v, valid, m_i, l_i, acc, scale_log2e, DOT_PRECISION)
            if TRACE:
                tl.store(trace_ptr + (b * num_kv_heads + kv_head) * stride_trace + pos // BLOCK_SIZE,
                         split.to(tl.int32) + tl.zeros([BLOCK_N], tl.int32), mask=valid)
    for chunk in range(start, end, CHUNK_N):
        chunk_end = tl.minimum(chunk + CHUNK_N, end)
        # The tiles of this chunk take their physical blocks from registers (tl.gather): no K/V
        # address waits on a load of the same iteration, so the compiler can fetch the next tile's
        # K/V (num_stages > 2) while this tile's math runs.
        for tile in range(chunk, chunk_end, BLOCK_N):
            pos = tile + tl.arange(0, BLOCK_N)  # token positions of this tile
            valid = pos < chunk_end
            block = tl.gather(blocks, pos // BLOCK_SIZE - base, axis=0).to(tl.int64)  # physical blocks
            k, v = load_kv_tiles(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, k_zero_ptr, v_zero_ptr, block, pos,
                                 kv_head, d, valid, d_ok, stride_kb, stride_ks, stride_kh, stride_sb, stride_ss,
                                 stride_sh, BLOCK_SIZE, QUANT, HAS_ZERO)
            k, v = k.to(q.dtype), v.to(q.dtype)
            m_i, l_i, acc = INNER_LOOP(q, k, v, valid, m_i, l_i, acc, scale_log2e, DOT_PRECISION)
            if TRACE:
                tl.store(trace_ptr + (b * num_kv_heads + kv_head) * stride_trace + pos // BLOCK_SIZE,
                         split.to(tl.int32) + tl.zeros([BLOCK_N], tl.int32), mask=valid)
        base = chunk_end // BLOCK_SIZE  # the next chunk's entries (none needed after the last)
        blocks = tl.load(table + base + t, mask=(base + t < table_width) & (base + t <= (end - 1) // BLOCK_SIZE),
                         other=0)

    out = acc / l_i[:, None]
    if SINGLE_SPLIT:
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & d_ok[None, :])
    else:
        part = (b * (num_kv_heads * GROUP) + heads) * num_splits + split  # [GROUP_PAD] rows
        tl.store(part_out_ptr + part[:, None] * HEAD_PAD + d[None, :], out, mask=head_ok[:, None])
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=head_ok)


@triton.jit
def _decode_merge_kernel(
    out_ptr,  # [B, num_heads, head_dim]
    part_out_ptr,  # [B, num_heads, num_splits, HEAD_PAD] fp32
    part_lse_ptr,  # [B, num_heads, num_splits] fp32  (-inf: an empty split)
    num_splits,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - max lse): the splits' softmaxes joined.
    One program per (sequence, query head). Every split wrote its lse, so both loads leave at once;
    an empty split's weight is 0 and its unwritten o is dropped by a where (a product would keep a
    NaN: 0 * NaN = NaN)."""
    if USE_PDL:  # launched before the split kernel ended: wait until its partials are written
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < num_splits
    d = tl.arange(0, HEAD_PAD)
    rows = (b * tl.num_programs(1) + head) * num_splits + s
    lse = tl.load(part_lse_ptr + rows, mask=s_ok, other=float("-inf"))
    o = tl.load(part_out_ptr + rows[:, None] * HEAD_PAD + d[None, :], mask=s_ok[:, None], other=0.0)
    w = tl.exp2(lse - tl.max(lse, axis=0))
    o = tl.where(w[:, None] > 0, o, 0.0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + b * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


# launch settings on a GPU (the interpreter ignores warps and stages), and the split-K heuristic:
# aim for PROGRAMS_PER_SM programs per SM, none shorter than MIN_TOKENS_PER_SPLIT positions.
# Tuned with Triton 3.6 on an H100 and on an H200 (benchmarks/decode_attention_gpu.json and
# decode_attention_gpu_h200.json, "tuning"): both chose 32-position tiles, 1 warp, 3 stages and
# 4 programs per SM; 64 positions on 2 warps with 2 stages (the earlier defaults) summed 9% slower.
DECODE_CONFIG = {"block_n": 32, "num_warps": 1, "num_stages": 3}
PROGRAMS_PER_SM = 4
MIN_TOKENS_PER_SPLIT = 128
DECODE_PDL = True  # launch the merge as a programmatic dependent of the split kernel where the card can
TABLE_CHUNK_POSITIONS = 1024  # a program holds the block-table entries of about this many positions at once


def table_chunk(block_size: int, block_n: int) -> tuple[int, int]:
    """(entries, positions) of one chunk of the block table held in registers: a power of two of
    entries, and the most whole tiles whose blocks they always cover, wherever the chunk starts in a block."""
    entries = triton.next_power_of_2(max(2, triton.cdiv(TABLE_CHUNK_POSITIONS, block_size)))
    while (entries - 1) * block_size + 1 < block_n:
        entries *= 2
    return entries, ((entries - 1) * block_size + 1) // block_n * block_n


def check_inner_loop(fn):
    """The decode kernel's inner loop: `fn`, or online_softmax_block when None; it must be a Triton function."""
    if fn is None:
        return online_softmax_block
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if not isinstance(fn, (JITFunction, InterpretedFunction)):
        raise TypeError(f"the decode inner loop must be a Triton function, got {fn!r}: decorate it with @triton.jit "
                        "(same signature as minikv.kernels.decode_attention.online_softmax_block)")
    return fn


def check_paged_layout(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """What every paged attention kernel reads: q [..., num_heads, head_dim] and the caches
    [num_blocks, block_size, num_kv_heads, head_dim] of one layout, num_kv_heads dividing num_heads,
    head_dim contiguous. A ValueError naming the mismatch otherwise."""
    num_heads, head_dim = q.shape[-2:]
    num_kv_heads, kd = k_cache.shape[2:]
    if kd != head_dim or v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError(f"k_cache {tuple(k_cache.shape)} / v_cache {tuple(v_cache.shape)} must share one "
                         f"[num_blocks, block_size, num_kv_heads, {head_dim}] layout")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if k_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q and the caches need a contiguous head_dim (stride 1)")


@functools.lru_cache(maxsize=None)
def supports_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch: a kernel may start while the one before it finishes (Hopper on,
    and a Triton that has the griddepcontrol helpers)."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
            and hasattr(tl.extra.cuda, "gdc_wait"))


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device,
                       programs_per_sm: int | None = None) -> int:
    """Enough splits that batch x kv_heads x splits programs keep every SM busy with several programs
    (memory latency is hidden by having many loads in flight), but no split so short that the merge
    costs more than it saves. Any count is correct: the longest span is cut into that many ranges."""
    if device.type != "cuda":
        return 1  # the interpreter runs one program at a time: fewer is faster there
    want = math.ceil((programs_per_sm or PROGRAMS_PER_SM) * _num_sms(device) / max(batch * num_kv_heads, 1))
    return max(1, min(want, max_seq_len // MIN_TOKENS_PER_SPLIT, 128))


def paged_decode_attention(
    q: torch.Tensor,  # [B, num_heads, head_dim]  the one new query token of each sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]  (one layer)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int
    seq_lens: torch.Tensor,  # [B] context length including the new token (its K/V already stored)
    scale: float,
    num_splits: int | None = None,
    sliding_window: int | None = None,
    sink_tokens: int = 0,  # with a sliding window: keys [0, sink_tokens) stay in sight (StreamingLLM)
    max_seq_len: int | None = None,  # host copy of seq_lens.max(), saves a device sync (a smaller value
    #   stays correct: the last split reads whatever lies past the others)
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    trace: torch.Tensor | None = None,  # [B, num_kv_heads, max_blocks] int32: filled with split ids
    out: torch.Tensor | None = None,  # [B, num_heads, head_dim] to write into (else a new tensor)
    pdl: bool | None = None,  # merge launched as a programmatic dependent (default DECODE_PDL, where supported)
    inner_loop=None,  # a @triton.jit function with online_softmax_block's signature (None: that function)
    merge=None,  # a torch function (part_out [B, H, S, D], part_lse [B, H, S]) -> [B, H, D]: replaces the merge kernel
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] fp32: a quantized pool's scales
    v_scale: torch.Tensor | None = None,
    k_zero: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] fp32: an int8 pool's zero points
    v_zero: torch.Tensor | None = None,
    split_per_seq: bool = False,  # each sequence's span cut num_splits ways on the device, not the longest
    #   one (max_seq_len) on the host: for CUDA graphs, whose max_seq_len is only a bound
) -> torch.Tensor:
    """Attention of each sequence's new token over its paged K/V: returns [B, num_heads, head_dim].

    `inner_loop` is the seam of exercise 08a (`LLM(..., decode_inner_loop=fn)` passes it down): it is a
    compile-time argument of the split kernel, so each function compiles its own kernel once. `merge` is
    the seam of exercise 08b: with num_splits > 1 it joins the splits' partial results (fp32, lse in log2
    units, -inf for an empty split whose part_out is never written) instead of `_decode_merge_kernel`."""
    B, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, kd = k_cache.shape
    check_paged_layout(q, k_cache, v_cache)
    if block_tables.shape[0] != B or seq_lens.shape[0] != B:
        raise ValueError(f"block_tables {tuple(block_tables.shape)} and seq_lens {tuple(seq_lens.shape)} "
                         f"need one row per sequence ({B})")
    inner_loop = check_inner_loop(inner_loop)
    k_scale, v_scale, k_zero, v_zero, stride_sb, stride_ss, stride_sh, quant, has_zero = quant_args(
        k_scale, v_scale, k_cache, k_zero, v_zero)
    group = num_heads // num_kv_heads
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    window = sliding_window or 0
    sinks = sink_tokens if window > 0 else 0
    span = min(max_seq_len, window) if window > 0 else max_seq_len
    if num_splits is None:
        num_splits = default_num_splits(B, num_kv_heads, span, q.device)
    interp = q.device.type != "cuda"
    block_n = block_n or DECODE_CONFIG["block_n"]
    head_pad = max(16, triton.next_power_of_2(head_dim))
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} must be shaped like q {tuple(q.shape)}, head_dim contiguous")
    if num_splits > 1:
        part_out = torch.empty(B, num_heads, num_splits, head_pad, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(B, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    if trace is None:
        trace_arg, trace_stride = out, 0
    else:
        trace_arg, trace_stride = trace, trace.stride(1)
    launch = {} if interp else {"num_warps": num_warps or DECODE_CONFIG["num_warps"],
                                "num_stages": num_stages or DECODE_CONFIG["num_stages"]}
    pdl = num_splits > 1 and merge is None and supports_pdl(q.device) and (DECODE_PDL if pdl is None else pdl)
    split_len = triton.cdiv(triton.cdiv(max(span, 1), num_splits), block_n) * block_n
    table_entries, chunk_n = table_chunk(block_size, block_n)
    _decode_split_kernel[(B, num_kv_heads, num_splits)](
        q, k_cache, v_cache, k_scale, v_scale, k_zero, v_zero, block_tables, seq_lens, out, part_out, part_lse,
        trace_arg,
        scale * math.log2(math.e), window, sinks, num_splits, split_len, block_tables.shape[1],
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        stride_sb, stride_ss, stride_sh,
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        trace_stride,
        SINGLE_SPLIT=num_splits == 1, HAS_WINDOW=window > 0, HAS_SINKS=sinks > 0, BLOCK_SIZE=block_size,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, HEAD_PAD=head_pad, BLOCK_N=block_n, CHUNK_N=chunk_n, TABLE_CHUNK=table_entries,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None, TRACE=trace is not None, USE_PDL=pdl,
        INNER_LOOP=inner_loop, QUANT=quant, HAS_ZERO=has_zero, SPLIT_PER_SEQ=split_per_seq, **launch,
    )
    if num_splits > 1 and merge is not None:
        merged = merge(part_out[..., :head_dim], part_lse)
        if not isinstance(merged, torch.Tensor) or merged.shape != out.shape:
            raise ValueError(f"merge returned {getattr(merged, 'shape', type(merged).__name__)}; expected a tensor "
                             f"of shape {tuple(out.shape)} [batch, num_heads, head_dim]")
        out.copy_(merged)
    elif num_splits > 1:
        _decode_merge_kernel[(B, num_heads)](
            out, part_out, part_lse, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_PAD=head_pad, SPLITS_PAD=triton.next_power_of_2(num_splits), USE_PDL=pdl,
            **({} if interp else {"num_warps": max(1, min(8, triton.next_power_of_2(num_splits) * head_pad // 1024)),
                                  "launch_pdl": pdl}),
        )
    return out
