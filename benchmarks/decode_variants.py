"""What limits the paged decode kernel on a GPU: one run that checks, times and prints a table.

The decode benchmark (minikv/bench/decode_attention.py) measures the kernel against its baselines;
this script asks why it lands where it does. Each question is answered in the same run on the same
card, at the benchmark's shapes and a long context (32 x 32768, 512 MiB of K/V), block size 16:

    previous (--previous FILE) an earlier minikv/kernels/decode_attention.py timed beside the kernel as it
             is, on the same values: what did a change to the kernel gain?
    layout   the pool stored token-major ([blocks, block_size, kv_heads, D] in memory: a program
             reads 128-byte rows 256 bytes apart) or head-major ([blocks, kv_heads, block_size, D],
             the engine's Triton backend; read through strides), and SDPA on contiguous K/V stored
             both ways: does the layout, or the kernel, cost the bandwidth?
    layout+  also the pool's blocks laid out in sequence order (paging without scattering)
    pdl      the merge launched as a programmatic dependent of the split kernel, or not
    wide     a variant split kernel defined here: programs ordered with the KV head varying fastest,
             and one program serving two KV heads (both halves of each 256-byte row together)
    merge    the split phase alone, and the merge of its partial results as it is (one round of
             loads) and as it was (the sequence length first, then the partials)
    ahead    a variant that issues the next tile's loads by hand (block table two tiles ahead, K/V
             into registers one tile ahead)
    regs     a variant that loads the split's block-table entries once, before the loop, so that
             the compiler can prefetch K/V (its PTX then waits with cp.async.wait_group 2, not 0);
             the kernel itself now does this a chunk of the table at a time
    streams  a variant with several online softmaxes per program, one per warp, joined in the
             program: one split without a merge kernel
    dsplit   a variant with the output's head_dim cut D_SPLIT ways: each program reads every key but
             only its slice of the values, so one split can fill the card without a merge
    ticket   the same variant with the merge done by the last split to finish (an atomic ticket per
             sequence, KV head and slice): no merge kernel, no grid-wide wait
    warm     the kernel and SDPA with K/V cold but q, the block tables and the lengths in L2, as in
             the engine (every layer reads the same tables; q is the previous kernel's output)
    splits   (--splits) every split count x launch setting per shape: does any choice reach SDPA?

VARIANTS holds the latest run's questions; the JSON of each earlier run records the ones it asked.
The notes in benchmarks/NOTES_decode.md keep what this script and its earlier forms found (flush,
fused merge, launch settings), each with its prediction.

Every variant is checked against a float32 reference before it is timed.

    python benchmarks/decode_variants.py --out benchmarks/ [--splits] [--previous OLD_decode_attention.py]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if __name__ == "__main__":  # run as a script: minikv from this checkout, installed or not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import minikv.kernels  # noqa: E402, F401, I001  (before triton: on a CPU it switches Triton to its interpreter)
import minikv.kernels.decode_attention as dec  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from minikv.bench import environment  # noqa: E402
from minikv.bench.decode_attention import (HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, SHAPES, TOL, Clock,  # noqa: E402
                                           contiguous_kv, copy_bandwidth, decode_case, fp32_decode_reference,
                                           kernel_time, rel_err)

LOG2E = 1.4426950408889634  # log2(e): the kernels' exponentials are base 2
PREVIOUS = None  # an earlier version of the kernel's module (--previous), timed beside the current one


@triton.jit
def _split_range(seq_lens_ptr, b, split, num_splits, BLOCK_N: tl.constexpr):
    """Split `split`'s key range [start, end) of sequence b in whole tiles, as in the kernel (no window)."""
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    return start, tl.minimum(start + chunk, seq_len)


@triton.jit
def _group_query(q_ptr, b, kv_head, stride_qb, stride_qh, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                 HEAD_DIM: tl.constexpr):
    """The query rows of every query head of one KV head, padded to GROUP_PAD rows, as in the kernel:
    (heads, head_ok, d, q [GROUP_PAD, HEAD_DIM])."""
    g = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + g
    head_ok = g < GROUP
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=head_ok[:, None], other=0.0)
    return heads, head_ok, d, q


@triton.jit
def _first_table_chunk(block_tables_ptr, b, split, split_len, table_width, stride_bt, BLOCK_SIZE: tl.constexpr,
                       TABLE_CHUNK: tl.constexpr):
    """A split's start, as in the kernel (no window), and the first chunk of its block-table entries:
    (table, start, base, t, blocks)."""
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    start = split * split_len
    base = start // BLOCK_SIZE
    t = tl.arange(0, TABLE_CHUNK)
    blocks = tl.load(table + base + t, mask=base + t < table_width, other=0)
    return table, start, base, t, blocks


@triton.jit
def _write_split(out_ptr, part_out_ptr, part_lse_ptr, b, split, num_splits, heads, row_ok, d, acc, l_i, m_i,
                 empty, stride_ob, stride_oh, NUM_HEADS: tl.constexpr, SINGLE_SPLIT: tl.constexpr):
    """A split's result: the output itself when it is the only split, else its normalised partial and
    its lse; an empty split writes only an lse of -inf (weight 0 in the merge)."""
    part = (b * NUM_HEADS + heads) * num_splits + split
    if empty:
        if not SINGLE_SPLIT:
            tl.store(part_lse_ptr + part, tl.full(heads.shape, float("-inf"), tl.float32), mask=row_ok)
    else:
        out = acc / l_i[:, None]
        if SINGLE_SPLIT:
            tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            tl.store(part_out_ptr + part[:, None] * d.shape[0] + d[None, :], out, mask=row_ok[:, None])
            tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=row_ok)


@triton.jit
def _wide_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    scale_log2e, num_splits,
    stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
    KV_PER_PROG: tl.constexpr, HEAD_FASTEST: tl.constexpr,
):
    """The decode kernel's split phase, with KV_PER_PROG KV heads per program and a choice of program order.
    Rows r of the program's query block: KV head (r // GROUP_PAD) of the program, query head r % GROUP_PAD of it."""
    if HEAD_FASTEST:
        head_group = tl.program_id(0)
        b = tl.program_id(1)
    else:
        b = tl.program_id(0)
        head_group = tl.program_id(1)
    split = tl.program_id(2)
    start, end = _split_range(seq_lens_ptr, b, split, num_splits, BLOCK_N)
    ROWS: tl.constexpr = KV_PER_PROG * GROUP_PAD
    r = tl.arange(0, ROWS)
    r_head = r // GROUP_PAD
    r_ok = (r % GROUP_PAD) < GROUP
    heads = (head_group * KV_PER_PROG + r_head) * GROUP + r % GROUP_PAD
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=r_ok[:, None], other=0.0)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    for tile in range(start, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        valid = pos < end
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        row = block * stride_kb + (pos % BLOCK_SIZE) * stride_ks + head_group * KV_PER_PROG * stride_kh
        s = tl.zeros([ROWS, BLOCK_N], tl.float32)
        for h in tl.static_range(KV_PER_PROG):
            k = tl.load(k_cache_ptr + row[:, None] + h * stride_kh + d[None, :], mask=valid[:, None], other=0.0)
            s += tl.where(r_head[:, None] == h, tl.dot(q, tl.trans(k)), 0.0)
        s = tl.where(valid[None, :], s * scale_log2e, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pv = tl.zeros([ROWS, HEAD_DIM], tl.float32)
        for h in tl.static_range(KV_PER_PROG):
            v = tl.load(v_cache_ptr + row[:, None] + h * stride_kh + d[None, :], mask=valid[:, None], other=0.0)
            pv += tl.where(r_head[:, None] == h, tl.dot(p.to(v.dtype), v), 0.0)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    _write_split(out_ptr, part_out_ptr, part_lse_ptr, b, split, num_splits, heads, r_ok, d, acc, l_i, m_i,
                 start >= end, stride_ob, stride_oh, NUM_HEADS, SINGLE_SPLIT)


@triton.jit
def _ahead_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    scale_log2e, num_splits,
    stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
    TABLE_AHEAD: tl.constexpr, KV_AHEAD: tl.constexpr,
):
    """The decode kernel's split phase with the next tile's loads issued by hand before this tile's math.

    TABLE_AHEAD: block-table entries are loaded two tiles ahead, so no K/V address waits on a load.
    KV_AHEAD: the next tile's K and V are loaded into registers before this tile's softmax, so their
    latency hides behind it (the compiler's own pipelining of these gathered loads waits on all copies
    at each iteration: cp.async.wait_group 0 in its PTX)."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    start, end = _split_range(seq_lens_ptr, b, split, num_splits, BLOCK_N)
    heads, head_ok, d, q = _group_query(q_ptr, b, kv_head, stride_qb, stride_qh, GROUP, GROUP_PAD, HEAD_DIM)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    head_off = kv_head * stride_kh
    n = tl.arange(0, BLOCK_N)

    pos = start + n
    valid = pos < end
    block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    if TABLE_AHEAD:
        pos1 = pos + BLOCK_N
        block1 = tl.load(table + pos1 // BLOCK_SIZE, mask=pos1 < end, other=0).to(tl.int64)
    if KV_AHEAD:
        row = block * stride_kb + (pos % BLOCK_SIZE) * stride_ks + head_off
        k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    for tile in range(start, end, BLOCK_N):
        pos_next = tile + BLOCK_N + n
        valid_next = pos_next < end
        if TABLE_AHEAD:
            block_next = block1
            pos2 = pos_next + BLOCK_N
            block1 = tl.load(table + pos2 // BLOCK_SIZE, mask=pos2 < end, other=0).to(tl.int64)
        else:
            block_next = tl.load(table + pos_next // BLOCK_SIZE, mask=valid_next, other=0).to(tl.int64)
        if KV_AHEAD:
            row_next = block_next * stride_kb + (pos_next % BLOCK_SIZE) * stride_ks + head_off
            k_next = tl.load(k_cache_ptr + row_next[:, None] + d[None, :], mask=valid_next[:, None], other=0.0)
            v_next = tl.load(v_cache_ptr + row_next[:, None] + d[None, :], mask=valid_next[:, None], other=0.0)
        else:
            row = block * stride_kb + (pos % BLOCK_SIZE) * stride_ks + head_off
            k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        m_i, l_i, acc = dec.online_softmax_block(q, k, v, valid, m_i, l_i, acc, scale_log2e, None)
        if KV_AHEAD:
            k = k_next
            v = v_next
        pos = pos_next
        valid = valid_next
        block = block_next
    _write_split(out_ptr, part_out_ptr, part_lse_ptr, b, split, num_splits, heads, head_ok, d, acc, l_i, m_i,
                 start >= end, stride_ob, stride_oh, NUM_HEADS, SINGLE_SPLIT)


@triton.jit
def _table_in_registers_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    scale_log2e, num_splits,
    stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_SPLIT: tl.constexpr, MAX_TBL: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """The decode kernel's split phase with the split's block-table entries loaded once, before the loop.

    Inside the loop a tile's physical blocks come from registers (tl.gather), so no K/V address waits
    on a load made in the same iteration: the compiler is free to fetch the next tile's K/V while this
    tile's math runs. MAX_TBL (a power of two) bounds the blocks one split touches. USE_PDL: the merge
    is launched as a programmatic dependent, as in the kernel."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    start, end = _split_range(seq_lens_ptr, b, split, num_splits, BLOCK_N)
    heads, head_ok, d, q = _group_query(q_ptr, b, kv_head, stride_qb, stride_qh, GROUP, GROUP_PAD, HEAD_DIM)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    first = start // BLOCK_SIZE
    t = tl.arange(0, MAX_TBL)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    blocks = tl.load(table + first + t, mask=first + t <= (end - 1) // BLOCK_SIZE, other=0)  # [MAX_TBL]
    head_off = kv_head * stride_kh
    for tile in range(start, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        valid = pos < end
        local = tl.minimum(pos // BLOCK_SIZE - first, MAX_TBL - 1)  # past the end: any entry, masked below
        block = tl.gather(blocks, local, axis=0).to(tl.int64)
        row = block * stride_kb + (pos % BLOCK_SIZE) * stride_ks + head_off
        k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        m_i, l_i, acc = dec.online_softmax_block(q, k, v, valid, m_i, l_i, acc, scale_log2e, None)
    _write_split(out_ptr, part_out_ptr, part_lse_ptr, b, split, num_splits, heads, head_ok, d, acc, l_i, m_i,
                 start >= end, stride_ob, stride_oh, NUM_HEADS, SINGLE_SPLIT)


@triton.jit
def _streams_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    scale_log2e, num_splits, split_len, table_width,
    stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
    STREAMS: tl.constexpr, CHUNK_N: tl.constexpr, TABLE_CHUNK: tl.constexpr, USE_PDL: tl.constexpr,
):
    """The kernel's split phase with STREAMS independent online softmaxes per program (a batched dot
    puts one stream on each warp), merged once at the end: the latency hiding of STREAMS one-warp
    split programs, without a merge kernel when one split per sequence fills the card.

    A super-tile of STREAMS x BLOCK_N positions gives stream s its s-th BLOCK_N positions."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    table, start, base, t, blocks = _first_table_chunk(block_tables_ptr, b, split, split_len, table_width, stride_bt,
                                                       BLOCK_SIZE, TABLE_CHUNK)
    heads, head_ok, d, q = _group_query(q_ptr, b, kv_head, stride_qb, stride_qh, GROUP, GROUP_PAD, HEAD_DIM)
    q3 = tl.broadcast_to(q[None, :, :], (STREAMS, GROUP_PAD, HEAD_DIM))
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    end = tl.where(split == num_splits - 1, seq_len, tl.minimum(start + split_len, seq_len))
    m_i = tl.full([STREAMS, GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([STREAMS, GROUP_PAD], tl.float32)
    acc = tl.zeros([STREAMS, GROUP_PAD, HEAD_DIM], tl.float32)
    lane = tl.arange(0, STREAMS)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]  # [STREAMS, BLOCK_N]
    for chunk in range(start, end, CHUNK_N):
        chunk_end = tl.minimum(chunk + CHUNK_N, end)
        blocks2 = tl.broadcast_to(blocks[None, :], (STREAMS, TABLE_CHUNK))
        for tile in range(chunk, chunk_end, STREAMS * BLOCK_N):
            pos = tile + lane
            valid = pos < chunk_end
            block = tl.gather(blocks2, pos // BLOCK_SIZE - base, axis=1).to(tl.int64)
            row = block * stride_kb + (pos % BLOCK_SIZE) * stride_ks + kv_head * stride_kh  # [STREAMS, BLOCK_N]
            k = tl.load(k_cache_ptr + row[:, :, None] + d[None, None, :], mask=valid[:, :, None], other=0.0)
            v = tl.load(v_cache_ptr + row[:, :, None] + d[None, None, :], mask=valid[:, :, None], other=0.0)
            sc = tl.dot(q3, tl.permute(k, (0, 2, 1))) * scale_log2e  # [STREAMS, GROUP_PAD, BLOCK_N]
            sc = tl.where(valid[:, None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=2))
            m_use = tl.where(m_new > float("-inf"), m_new, 0.0)  # a stream with no key yet: no NaN from -inf - -inf
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(sc - m_use[:, :, None])
            l_i = l_i * alpha + tl.sum(p, axis=2)
            acc = acc * alpha[:, :, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        base = chunk_end // BLOCK_SIZE
        blocks = tl.load(table + base + t, mask=(base + t < table_width) & (base + t <= (end - 1) // BLOCK_SIZE),
                         other=0)
    m = tl.max(m_i, axis=0)  # [GROUP_PAD]: the streams' softmaxes joined, as the merge kernel joins splits
    m_safe = tl.where(m > float("-inf"), m, 0.0)
    w = tl.exp2(m_i - m_safe[None, :])
    l_sum = tl.sum(l_i * w, axis=0)
    acc_sum = tl.sum(acc * w[:, :, None], axis=0)
    _write_split(out_ptr, part_out_ptr, part_lse_ptr, b, split, num_splits, heads, head_ok, d, acc_sum, l_sum, m,
                 start >= end, stride_ob, stride_oh, NUM_HEADS, SINGLE_SPLIT)


@triton.jit
def _dsplit_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr, ticket_ptr,
    scale_log2e, num_splits, split_len, table_width,
    stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
    D_SPLIT: tl.constexpr, TICKET: tl.constexpr, CHUNK_N: tl.constexpr, TABLE_CHUNK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """The kernel's split phase with the output's head_dim cut D_SPLIT ways: a program still reads
    every key (the scores need all of q . k) but only its slice of each value row, so one program per
    (sequence, KV head, slice) streams less, and one split can fill the card without a merge. The
    programs of one (sequence, KV head) read the same K: the second read should come from L2.

    TICKET: with several splits, the last split of each (sequence, KV head, slice) to finish (an
    atomic ticket) merges the partials itself, looping over the splits: no merge kernel."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    kv_head = tl.program_id(1) // D_SPLIT
    part_d = tl.program_id(1) % D_SPLIT
    split = tl.program_id(2)
    DV: tl.constexpr = HEAD_DIM // D_SPLIT
    table, start, base, t, blocks = _first_table_chunk(block_tables_ptr, b, split, split_len, table_width, stride_bt,
                                                       BLOCK_SIZE, TABLE_CHUNK)
    heads, head_ok, d, q = _group_query(q_ptr, b, kv_head, stride_qb, stride_qh, GROUP, GROUP_PAD, HEAD_DIM)
    dv = part_d * DV + tl.arange(0, DV)  # this program's slice of the output
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    end = tl.where(split == num_splits - 1, seq_len, tl.minimum(start + split_len, seq_len))
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DV], tl.float32)
    for chunk in range(start, end, CHUNK_N):
        chunk_end = tl.minimum(chunk + CHUNK_N, end)
        for tile in range(chunk, chunk_end, BLOCK_N):
            pos = tile + tl.arange(0, BLOCK_N)
            valid = pos < chunk_end
            block = tl.gather(blocks, pos // BLOCK_SIZE - base, axis=0).to(tl.int64)
            row = block * stride_kb + (pos % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
            k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            v = tl.load(v_cache_ptr + row[:, None] + dv[None, :], mask=valid[:, None], other=0.0)
            m_i, l_i, acc = dec.online_softmax_block(q, k, v, valid, m_i, l_i, acc, scale_log2e, None)
        base = chunk_end // BLOCK_SIZE
        blocks = tl.load(table + base + t, mask=(base + t < table_width) & (base + t <= (end - 1) // BLOCK_SIZE),
                         other=0)
    part = (b * NUM_HEADS + heads) * num_splits + split
    if SINGLE_SPLIT:
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + dv[None, :],
                 (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
    else:
        lse = tl.where(start < end, m_i + tl.log2(l_i), float("-inf"))
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dv[None, :], acc / l_i[:, None],
                 mask=head_ok[:, None])  # an empty split's (NaN) partial is dropped by its lse of -inf
        tl.store(part_lse_ptr + part, lse, mask=head_ok)
        if TICKET:
            tl.debug_barrier()  # every thread's partial is written before the ticket is taken
            ticket = ticket_ptr + b * tl.num_programs(1) + tl.program_id(1)
            if tl.atomic_add(ticket, 1, sem="acq_rel") == num_splits - 1:  # the last to finish merges
                m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
                w_sum = tl.zeros([GROUP_PAD], tl.float32)
                o = tl.zeros([GROUP_PAD, DV], tl.float32)
                rows = (b * NUM_HEADS + heads) * num_splits
                for s in range(num_splits):
                    lse_s = tl.load(part_lse_ptr + rows + s, mask=head_ok, other=float("-inf"), cache_modifier=".cg")
                    o_s = tl.load(part_out_ptr + (rows + s)[:, None] * HEAD_DIM + dv[None, :],
                                  mask=head_ok[:, None] & (lse_s > float("-inf"))[:, None], other=0.0,
                                  cache_modifier=".cg")
                    m_new = tl.maximum(m, lse_s)
                    m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
                    alpha = tl.exp2(m - m_use)
                    w = tl.exp2(lse_s - m_use)
                    w_sum = w_sum * alpha + w
                    o = o * alpha[:, None] + w[:, None] * o_s
                    m = m_new
                tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + dv[None, :],
                         (o / w_sum[:, None]).to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
                tl.atomic_xchg(ticket, 0)  # ready for the next call


def _merge(out, part_out, part_lse, num_splits, pdl=False):
    """The kernel's own merge of the partials into out (nothing to do for one split)."""
    if num_splits == 1:
        return out
    B, H, D = out.shape
    splits_pad = triton.next_power_of_2(num_splits)
    gpu = {"num_warps": max(1, min(8, splits_pad * D // 1024)), "launch_pdl": pdl}
    dec._decode_merge_kernel[(B, H)](
        out, part_out, part_lse, num_splits, out.stride(0), out.stride(1), HEAD_DIM=D, HEAD_PAD=D,
        SPLITS_PAD=splits_pad, USE_PDL=pdl, **({} if out.device.type != "cuda" else gpu))
    return out


def _split_outputs(q, num_splits):
    """The output [B, H, D] and each split's partial result [B, H, splits, D] and lse [B, H, splits]."""
    B, H, D = q.shape
    return (torch.empty_like(q), torch.empty(B, H, num_splits, D, dtype=torch.float32, device=q.device),
            torch.empty(B, H, num_splits, dtype=torch.float32, device=q.device))


def _sdpa_inputs(c):
    """q as SDPA's one query position, and K/V gathered into contiguous [B, kv_heads, L, D]."""
    kc = contiguous_kv(c["k_cache"], c["tables"], c["L"]).contiguous()
    vc = contiguous_kv(c["v_cache"], c["tables"], c["L"]).contiguous()
    return c["q"][:, :, None, :], kc, vc


def _run_variant(kernel, grid, q, k_cache, v_cache, tables, seq_lens, scale, num_splits, block_n, num_warps,
                 num_stages, pdl=False, **constexprs):
    """Launch one of the variant split kernels above (same arguments as each other), then merge."""
    B, H, D = q.shape
    _, block_size, kvh, _ = k_cache.shape
    out, part_out, part_lse = _split_outputs(q, num_splits)
    launch = {} if q.device.type != "cuda" else {"num_warps": num_warps, "num_stages": num_stages}
    kernel[grid](
        q, k_cache, v_cache, tables, seq_lens, out, part_out, part_lse, scale * LOG2E, num_splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
        out.stride(0), out.stride(1),
        NUM_HEADS=H, BLOCK_SIZE=block_size, GROUP=H // kvh, GROUP_PAD=max(16, triton.next_power_of_2(H // kvh)),
        HEAD_DIM=D, BLOCK_N=block_n, SINGLE_SPLIT=num_splits == 1, **constexprs, **launch)
    return _merge(out, part_out, part_lse, num_splits, pdl)


def wide_decode(q, k_cache, v_cache, tables, seq_lens, scale, num_splits, kv_per_prog=1, head_fastest=False,
                block_n=64, num_warps=2, num_stages=2):
    """The wide variant (head_dim a power of two >= 16)."""
    B, kvh = q.shape[0], k_cache.shape[2]
    groups = kvh // kv_per_prog
    grid = (groups, B, num_splits) if head_fastest else (B, groups, num_splits)
    return _run_variant(_wide_split_kernel, grid, q, k_cache, v_cache, tables, seq_lens, scale, num_splits, block_n,
                        num_warps, num_stages, KV_PER_PROG=kv_per_prog, HEAD_FASTEST=head_fastest)


def ahead_decode(q, k_cache, v_cache, tables, seq_lens, scale, num_splits, table_ahead=True, kv_ahead=True,
                 block_n=64, num_warps=4, num_stages=1):
    """The prefetching variant (head_dim a power of two >= 16)."""
    grid = (q.shape[0], k_cache.shape[2], num_splits)
    return _run_variant(_ahead_split_kernel, grid, q, k_cache, v_cache, tables, seq_lens, scale, num_splits, block_n,
                        num_warps, num_stages, TABLE_AHEAD=table_ahead, KV_AHEAD=kv_ahead)


def table_in_registers_decode(q, k_cache, v_cache, tables, seq_lens, scale, num_splits, max_seq_len,
                              block_n=64, num_warps=2, num_stages=2, pdl=False):
    """The table-in-registers variant (head_dim a power of two >= 16); pdl: the merge as a programmatic
    dependent (GPU only)."""
    pdl = pdl and num_splits > 1 and dec.supports_pdl(q.device)
    chunk_max = triton.cdiv(triton.cdiv(max_seq_len, num_splits), block_n) * block_n
    max_tbl = triton.next_power_of_2(triton.cdiv(chunk_max, k_cache.shape[1]) + 1)
    grid = (q.shape[0], k_cache.shape[2], num_splits)
    return _run_variant(_table_in_registers_kernel, grid, q, k_cache, v_cache, tables, seq_lens, scale, num_splits,
                        block_n, num_warps, num_stages, pdl, MAX_TBL=max_tbl, USE_PDL=pdl)


def streams_decode(q, k_cache, v_cache, tables, seq_lens, scale, num_splits, max_seq_len, streams=4, block_n=32,
                   num_warps=None, num_stages=3, pdl=True):
    """The streams variant (head_dim a power of two >= 16)."""
    pdl = pdl and num_splits > 1 and dec.supports_pdl(q.device)
    super_n = streams * block_n
    split_len = triton.cdiv(triton.cdiv(max_seq_len, num_splits), super_n) * super_n
    entries, chunk_n = dec.table_chunk(k_cache.shape[1], super_n)
    B, H, D = q.shape
    _, block_size, kvh, _ = k_cache.shape
    out, part_out, part_lse = _split_outputs(q, num_splits)
    launch = {} if q.device.type != "cuda" else {"num_warps": num_warps or streams, "num_stages": num_stages}
    _streams_split_kernel[(B, kvh, num_splits)](
        q, k_cache, v_cache, tables, seq_lens, out, part_out, part_lse, scale * LOG2E, num_splits, split_len,
        tables.shape[1], q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        tables.stride(0), out.stride(0), out.stride(1),
        NUM_HEADS=H, BLOCK_SIZE=block_size, GROUP=H // kvh, GROUP_PAD=max(16, triton.next_power_of_2(H // kvh)),
        HEAD_DIM=D, BLOCK_N=block_n, SINGLE_SPLIT=num_splits == 1, STREAMS=streams, CHUNK_N=chunk_n,
        TABLE_CHUNK=entries, USE_PDL=pdl, **launch)
    return _merge(out, part_out, part_lse, num_splits, pdl)


_TICKETS = {}


def dsplit_decode(q, k_cache, v_cache, tables, seq_lens, scale, num_splits, max_seq_len, d_split=2, ticket=False,
                  block_n=32, num_warps=1, num_stages=3, pdl=True):
    """The split-D variant (head_dim a power of two, D_SPLIT slices of at least 16)."""
    B, H, D = q.shape
    _, block_size, kvh, _ = k_cache.shape
    ticket = ticket and num_splits > 1
    pdl = pdl and num_splits > 1 and not ticket and dec.supports_pdl(q.device)
    split_len = triton.cdiv(triton.cdiv(max_seq_len, num_splits), block_n) * block_n
    entries, chunk_n = dec.table_chunk(block_size, block_n)
    out, part_out, part_lse = _split_outputs(q, num_splits)
    key = (B, kvh * d_split, q.device)
    if key not in _TICKETS:  # zeros once; the merging program resets its ticket
        _TICKETS[key] = torch.zeros(B, kvh * d_split, dtype=torch.int32, device=q.device)
    launch = {} if q.device.type != "cuda" else {"num_warps": num_warps, "num_stages": num_stages}
    _dsplit_kernel[(B, kvh * d_split, num_splits)](
        q, k_cache, v_cache, tables, seq_lens, out, part_out, part_lse, _TICKETS[key], scale * LOG2E, num_splits,
        split_len, tables.shape[1], q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), tables.stride(0), out.stride(0), out.stride(1),
        NUM_HEADS=H, BLOCK_SIZE=block_size, GROUP=H // kvh, GROUP_PAD=max(16, triton.next_power_of_2(H // kvh)),
        HEAD_DIM=D, BLOCK_N=block_n, SINGLE_SPLIT=num_splits == 1, D_SPLIT=d_split, TICKET=ticket,
        CHUNK_N=chunk_n, TABLE_CHUNK=entries, USE_PDL=pdl, **launch)
    return out if ticket else _merge(out, part_out, part_lse, num_splits, pdl)


@triton.jit
def _merge_with_lengths_kernel(out_ptr, part_out_ptr, part_lse_ptr, seq_lens_ptr, num_splits, stride_ob, stride_oh,
                               HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """The merge as it was: it first loads the sequence's length to work out which splits had tokens,
    and only then their lse and outputs (two dependent rounds of loads instead of one)."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    used = tl.cdiv(seq_len, chunk)
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < used
    d = tl.arange(0, HEAD_DIM)
    rows = (b * tl.num_programs(1) + head) * num_splits + s
    lse = tl.load(part_lse_ptr + rows, mask=s_ok, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, axis=0))
    o = tl.load(part_out_ptr + rows[:, None] * HEAD_DIM + d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + b * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def merge_costs(c, clock) -> dict:
    """The split phase of the kernel alone, then each merge alone on its partial results (CUDA-graph us)."""
    q, k_cache, v_cache, tables, seq_lens = c["q"], c["k_cache"], c["v_cache"], c["tables"], c["seq_lens"]
    B, H, D = q.shape
    _, block_size, kvh, _ = k_cache.shape
    n = max(2, dec.default_num_splits(B, kvh, c["L"], q.device))
    block_n = dec.DECODE_CONFIG["block_n"]
    part_out = torch.empty(B, H, n, D, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(B, H, n, dtype=torch.float32, device=q.device)
    out_new, out_old = torch.empty_like(q), torch.empty_like(q)
    gpu = q.device.type == "cuda"
    split_len = triton.cdiv(triton.cdiv(c["L"], n), block_n) * block_n
    entries, chunk_n = dec.table_chunk(block_size, block_n)

    def split_phase():  # the same launch as paged_decode_attention's, merge left out
        dec._decode_split_kernel[(B, kvh, n)](
            q, k_cache, v_cache, k_cache, v_cache, k_cache, v_cache, tables, seq_lens, out_new, part_out, part_lse,
            out_new,
            c["scale"] * LOG2E, 0, 0, n, split_len, tables.shape[1], q.stride(0), q.stride(1), k_cache.stride(0),
            k_cache.stride(1), k_cache.stride(2), 0, 0, 0, tables.stride(0), out_new.stride(0), out_new.stride(1), 0,
            SINGLE_SPLIT=False, HAS_WINDOW=False, HAS_SINKS=False, BLOCK_SIZE=block_size, GROUP=H // kvh,
            GROUP_PAD=max(16, triton.next_power_of_2(H // kvh)),
            HEAD_DIM=D, HEAD_PAD=D, BLOCK_N=block_n, CHUNK_N=chunk_n, TABLE_CHUNK=entries,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else None, TRACE=False, USE_PDL=False,
            INNER_LOOP=dec.online_softmax_block, QUANT=False, HAS_ZERO=False,
            **({"num_warps": dec.DECODE_CONFIG["num_warps"], "num_stages": dec.DECODE_CONFIG["num_stages"]}
               if gpu else {}))

    pad = triton.next_power_of_2(n)
    warps = {"num_warps": max(1, min(8, pad * D // 1024))} if gpu else {}

    def merge_new():
        dec._decode_merge_kernel[(B, H)](out_new, part_out, part_lse, n, out_new.stride(0), out_new.stride(1),
                                         HEAD_DIM=D, HEAD_PAD=D, SPLITS_PAD=pad, USE_PDL=False, **warps)

    def merge_old():
        _merge_with_lengths_kernel[(B, H)](out_old, part_out, part_lse, seq_lens, n, out_old.stride(0),
                                           out_old.stride(1), HEAD_DIM=D, SPLITS_PAD=pad, BLOCK_N=block_n, **warps)

    split_phase()
    merge_new()
    merge_old()
    kc = contiguous_kv(k_cache, tables, c["L"])
    ref = fp32_decode_reference(q, kc, contiguous_kv(v_cache, tables, c["L"]), c["scale"])
    row = {"splits": n, "rel_err_new": rel_err(out_new, ref), "rel_err_old": rel_err(out_old, ref)}
    for name, fn in (("split_phase", split_phase), ("merge_new", merge_new), ("merge_with_lengths", merge_old)):
        row[name + "_us"] = round(kernel_time(clock, fn), 2)
    return row


SHAPES_HERE = SHAPES + [(32, 32768)]  # the benchmark's shapes and a long-context one (512 MiB of K/V)


def warm_metadata(c, clock) -> dict:
    """The kernel and SDPA with K/V cold but the small inputs in L2, as inside the engine: q is the
    previous kernel's output, and every layer reads the same block tables and lengths. The usual
    clock flushes all of it, which charges the paged kernel a memory latency for its table that a
    decode step in the engine does not pay (SDPA loads q and K at once either way)."""
    import copy

    q, scale, L = c["q"], c["scale"], c["L"]
    q4, kc, vc = _sdpa_inputs(c)
    k_pool, v_pool = swap_storage(c["k_cache"]), swap_storage(c["v_cache"])  # head-major, as the engine stores it
    out = {}
    for name, fn, touch in (
        ("kernel", lambda: dec.paged_decode_attention(q, k_pool, v_pool, c["tables"], c["seq_lens"], scale,
                                                      max_seq_len=L), (q, c["tables"], c["seq_lens"])),
        ("sdpa_contiguous", lambda: F.scaled_dot_product_attention(q4, kc, vc, scale=scale, enable_gqa=True), (q,))):
        warm = copy.copy(clock)  # the same flush buffer, then the small inputs read back into L2
        warm.flush_l2 = lambda touch=touch: (clock.flush_l2(), [t.float().sum() for t in touch])
        out[name] = {"cold_us": round(kernel_time(clock, fn), 2), "metadata_warm_us": round(kernel_time(warm, fn), 2)}
    return out


def swap_storage(x: torch.Tensor) -> torch.Tensor:
    """The same values in the same shape, with dims -3 and -2 swapped in memory: a token-major pool
    [blocks, block_size, kv_heads, D] becomes head-major storage, and head-major K/V token-major."""
    return x.transpose(-3, -2).contiguous().transpose(-3, -2)


def time_variants(c, clock, variants) -> dict:
    """{variant name: {"us": time, "rel_err": e, "splits": n}} for one decode case."""
    B, L = c["B"], c["L"]
    q, scale = c["q"], c["scale"]
    q4, kc, vc = _sdpa_inputs(c)  # kc, vc: [B, kv_heads, L, D]
    ref = fp32_decode_reference(q, kc, vc, scale)
    ki, vi = swap_storage(kc), swap_storage(vc)
    tables = {"nhd": c["tables"], "hnd": c["tables"]}  # sequential layouts get their own below
    pools = {"nhd": (c["k_cache"], c["v_cache"])}
    layouts = {kw.get("layout") for kw in variants.values()}
    if "hnd" in layouts:
        pools["hnd"] = (swap_storage(c["k_cache"]), swap_storage(c["v_cache"]))
    if layouts & {"sequential", "sequential_hnd"}:  # each sequence's blocks side by side, in order
        order = c["tables"].flatten()
        ks, vs = c["k_cache"][order], c["v_cache"][order]
        in_order = torch.arange(order.numel(), device=order.device).view_as(c["tables"])
        pools["sequential"], tables["sequential"] = (ks, vs), in_order
        pools["sequential_hnd"], tables["sequential_hnd"] = (swap_storage(ks), swap_storage(vs)), in_order
    fns = {
        "sdpa_contiguous": lambda: F.scaled_dot_product_attention(q4, kc, vc, scale=scale, enable_gqa=True),
        # the same values with a token's heads side by side in memory, as the pool stores them
        "sdpa_tokens_major": lambda: F.scaled_dot_product_attention(q4, ki, vi, scale=scale, enable_gqa=True),
    }
    splits_of = {}
    for name, kw in variants.items():
        kw = dict(kw)
        if f"{B}x{L}" not in kw.pop("shapes", [f"{B}x{L}"]):
            continue
        pps = kw.pop("programs_per_sm", dec.PROGRAMS_PER_SM)
        previous = kw.pop("previous", False)
        wide = kw.pop("wide", None)
        ahead = kw.pop("ahead", None)
        in_regs = kw.pop("table_in_registers", None)
        streams = kw.pop("streams", None)
        dsplit = kw.pop("dsplit", None)
        layout = kw.pop("layout", "nhd")
        kcache, vcache = pools[layout]
        table = tables[layout]
        per_prog = wide.get("kv_per_prog", 1) if wide else 1
        per_prog /= dsplit.get("d_split", 2) if dsplit else 1  # D_SPLIT programs per KV head
        splits = kw.pop("splits", None) or dec.default_num_splits(B, int(c["heads"][1] / per_prog), L, q.device, pps)
        splits_of[name] = splits
        if dsplit is not None:
            def fn(dsplit=dsplit, splits=splits, kcache=kcache, vcache=vcache, table=table):
                return dsplit_decode(q, kcache, vcache, table, c["seq_lens"], scale, splits, L, **dsplit)
        elif streams is not None:
            def fn(streams=streams, splits=splits, kcache=kcache, vcache=vcache, table=table):
                return streams_decode(q, kcache, vcache, table, c["seq_lens"], scale, splits, L, **streams)
        elif previous:
            if PREVIOUS is None:
                continue

            def fn(kw=kw, splits=splits, kcache=kcache, vcache=vcache, table=table):
                return PREVIOUS.paged_decode_attention(q, kcache, vcache, table, c["seq_lens"], scale,
                                                       max_seq_len=L, num_splits=splits, **kw)
        elif in_regs is not None:
            def fn(in_regs=in_regs, splits=splits, kcache=kcache, vcache=vcache, table=table):
                return table_in_registers_decode(q, kcache, vcache, table, c["seq_lens"], scale, splits, L, **in_regs)
        elif ahead is not None:
            def fn(ahead=ahead, splits=splits, kcache=kcache, vcache=vcache, table=table):
                return ahead_decode(q, kcache, vcache, table, c["seq_lens"], scale, splits, **ahead)
        elif wide is None:
            def fn(kw=kw, splits=splits, kcache=kcache, vcache=vcache, table=table):
                return dec.paged_decode_attention(q, kcache, vcache, table, c["seq_lens"], scale,
                                                  max_seq_len=L, num_splits=splits, **kw)
        else:
            def fn(wide=wide, splits=splits, kcache=kcache, vcache=vcache, table=table):
                return wide_decode(q, kcache, vcache, table, c["seq_lens"], scale, splits, **wide)
        fns[name] = fn
    row = {"kv_bytes": c["kv_bytes"]}
    for name, fn in fns.items():
        try:
            err = rel_err(fn().reshape(ref.shape), ref)
            if q.device.type == "cuda":
                torch.cuda.synchronize()  # a fault shows up here, named, not in a later variant
        except Exception as e:
            row[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            print(f"{B}x{L} {name}: {row[name]['error']}", flush=True)
            if "illegal" in str(e) or "unspecified launch" in str(e):
                raise  # the CUDA context is lost: nothing after this can run
            continue
        row[name] = {"rel_err": err, "splits": splits_of.get(name)}
        if err <= TOL:
            try:
                row[name]["us"] = round(kernel_time(clock, fn), 2)
            except Exception as e:  # e.g. a launch that a CUDA graph cannot capture
                row[name]["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return row


def compiled_resources() -> list[dict]:
    """Registers, spills and shared memory of every compiled split kernel (where this Triton exposes them)."""
    found = []
    for kern in (dec._decode_split_kernel, _wide_split_kernel, _ahead_split_kernel, _table_in_registers_kernel,
                 _streams_split_kernel, _dsplit_kernel):
        for caches in getattr(kern, "device_caches", {}).values():
            for compiled in caches[0].values():
                meta = getattr(compiled, "metadata", None)
                ptx = getattr(compiled, "asm", {}).get("ptx", "")
                found.append({"kernel": kern.__name__, "n_regs": getattr(compiled, "n_regs", None),
                              "n_spills": getattr(compiled, "n_spills", None),
                              "shared": getattr(meta, "shared", None), "num_warps": getattr(meta, "num_warps", None),
                              "num_stages": getattr(meta, "num_stages", None),
                              "cp_async": len(re.findall(r"cp\.async\.c[ag]\.", ptx)),
                              "wait_groups": re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx)})
    return found


SPLIT_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 33, 48, 66)
LAUNCH_GRID = ({"block_n": 32, "num_warps": 1, "num_stages": 3}, {"block_n": 32, "num_warps": 1, "num_stages": 4},
               {"block_n": 64, "num_warps": 2, "num_stages": 3}, {"block_n": 64, "num_warps": 4, "num_stages": 4},
               {"block_n": 128, "num_warps": 4, "num_stages": 3})


def split_grid(c, clock, splits=SPLIT_GRID, launches=LAUNCH_GRID) -> dict:
    """Every (split count, launch setting) on one case (head-major pool), with SDPA: does any choice match it?"""
    B, L = c["B"], c["L"]
    q, scale = c["q"], c["scale"]
    q4, kc, vc = _sdpa_inputs(c)
    ref = fp32_decode_reference(q, kc, vc, scale)
    sdpa = round(kernel_time(
        clock, lambda: F.scaled_dot_product_attention(q4, kc, vc, scale=scale, enable_gqa=True)), 2)
    k_pool, v_pool = swap_storage(c["k_cache"]), swap_storage(c["v_cache"])  # head-major, as the engine stores it
    grid = []
    for n in splits:
        if n > 1 and L // n < 64:
            continue
        for launch in launches:
            def fn(n=n, launch=launch):
                return dec.paged_decode_attention(q, k_pool, v_pool, c["tables"], c["seq_lens"], scale,
                                                  max_seq_len=L, num_splits=n, **launch)
            try:
                err = rel_err(fn().reshape(ref.shape), ref)
                us = round(kernel_time(clock, fn), 2) if err <= TOL else None
                grid.append({"splits": n, **launch, "rel_err": err, "us": us})
            except Exception as e:
                grid.append({"splits": n, **launch, "error": f"{type(e).__name__}: {str(e)[:200]}"})
    timed = [g for g in grid if g.get("us")]
    best = min(timed, key=lambda g: g["us"]) if timed else None
    default = dec.default_num_splits(B, c["heads"][1], L, q.device)
    return {"sdpa_contiguous": sdpa, "default_splits": default, "best": best, "grid": grid}


ONLY_SHORT = ["32x4096", "64x1024"]  # one split reads a whole context per program: too long elsewhere


def _streams(n, block_n, stages, **more):
    return {"layout": "hnd", "streams": {"streams": n, "block_n": block_n, "num_stages": stages}, **more}


def _dsplit(d_split, block_n=32, num_warps=1, num_stages=3, ticket=False, **more):
    return {"layout": "hnd", "dsplit": {"d_split": d_split, "ticket": ticket, "block_n": block_n,
                                        "num_warps": num_warps, "num_stages": num_stages}, **more}


VARIANTS = {
    "kernel": {"layout": "hnd"},
    "kernel_1split_n64_w4_s4": {"layout": "hnd", "splits": 1, "block_n": 64, "num_warps": 4, "num_stages": 4,
                                "shapes": ONLY_SHORT},
    # the output's head_dim cut D_SPLIT ways (_dsplit_kernel), one split: no merge
    "dsplit2_n32_w1_s3_1split": _dsplit(2, splits=1, shapes=ONLY_SHORT),
    "dsplit2_n32_w1_s4_1split": _dsplit(2, 32, 1, 4, splits=1, shapes=ONLY_SHORT),
    "dsplit2_n64_w2_s3_1split": _dsplit(2, 64, 2, 3, splits=1, shapes=ONLY_SHORT),
    "dsplit2_n64_w4_s4_1split": _dsplit(2, 64, 4, 4, splits=1, shapes=ONLY_SHORT),
    "dsplit2_n128_w4_s3_1split": _dsplit(2, 128, 4, 3, splits=1, shapes=ONLY_SHORT),
    "dsplit4_n32_w1_s3_1split": _dsplit(4, splits=1, shapes=ONLY_SHORT),
    # (4 slices of 16 on 2 warps and 64-position tiles: an illegal memory access with Triton 3.6, H100)
    # with splits (merge kernel as a programmatic dependent), programs per SM counted with the slices
    "dsplit2_pps4": _dsplit(2),
    "dsplit2_pps2": _dsplit(2, programs_per_sm=2),
    "dsplit2_pps8": _dsplit(2, programs_per_sm=8),
    "dsplit4_pps4": _dsplit(4),
    # the last split to finish merges (atomic ticket), no merge kernel
    "ticket_pps4": _dsplit(1, ticket=True),
    "ticket_pps2": _dsplit(1, ticket=True, programs_per_sm=2),
    "ticket_dsplit2_pps4": _dsplit(2, ticket=True),
    "ticket_dsplit2_pps2": _dsplit(2, ticket=True, programs_per_sm=2),
}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on any device (checks the script itself)")
    ap.add_argument("--splits", action="store_true", help="also time every split count x launch setting per shape")
    ap.add_argument("--previous", help="an earlier decode_attention.py, timed as the 'previous' variants")
    args = ap.parse_args(argv)
    global PREVIOUS
    if args.previous:
        spec = importlib.util.spec_from_file_location("decode_attention_previous", args.previous)
        PREVIOUS = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(PREVIOUS)
    t0 = time.time()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        raise SystemExit("this script needs a CUDA GPU; use --smoke to try it on a CPU")
    heads, shapes, dtype, variants = (NUM_HEADS, NUM_KV_HEADS, HEAD_DIM), SHAPES_HERE, torch.bfloat16, VARIANTS
    if os.environ.get("VARIANTS"):  # a comma-separated subset, e.g. to find the one that faults
        variants = {k: v for k, v in VARIANTS.items() if k in os.environ["VARIANTS"].split(",")}
    clock = Clock(device, args.reps, 10, flush="read")
    if args.smoke:
        heads, shapes, dtype = (6, 2, 16), [(2, 40), (3, 17)], torch.float32 if device.type != "cuda" else dtype
        variants = {"previous": {"previous": True}, "kernel": VARIANTS["kernel"],
                    "streams4_n16_1split": _streams(4, 16, 4, splits=1),
                    "dsplit2_1split": _dsplit(2, 16, splits=1), "dsplit2_2splits": _dsplit(2, 16, splits=2),
                    "ticket_dsplit2_3splits": _dsplit(2, 16, ticket=True, splits=3),
                    "ticket_1split_equiv": _dsplit(1, 16, ticket=True, splits=2),
                    "streams2_n16_2splits": _streams(2, 16, 3, splits=2),
                    "regs_pps4_w2_s3_pdl": {"table_in_registers": {"num_stages": 3, "pdl": True}},
                    "kernel_sequential_hnd": {"layout": "sequential_hnd"},
                    "table_regs_1split": {"splits": 1, "table_in_registers": {}},
                    "wide2_w4": {"wide": {"kv_per_prog": 2, "num_warps": 4}},
                    "kv_ahead_w4": {"ahead": {"num_warps": 4}}, "hnd": {"layout": "hnd"}}
        clock = Clock(device, 1, 0)
    if PREVIOUS is None:
        variants = {k: v for k, v in variants.items() if not v.get("previous")}
    record = {"env": {**environment(device), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")},
              "copy_bandwidth_GBps": round(copy_bandwidth(clock, 2**30 if not args.smoke else 2**20), 1),
              "decode_config": dict(dec.DECODE_CONFIG), "programs_per_sm": dec.PROGRAMS_PER_SM,
              "variants": variants, "shapes": {}}
    out_path = Path(args.out) / "decode_variants_gpu.json"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    for B, L in shapes:
        c = decode_case(B, L, 16, dtype, device, heads, kv_layout="nhd")  # the layouts below start from token-major
        record["shapes"][f"{B}x{L}"] = time_variants(c, clock, variants)
        record.setdefault("merge", {})[f"{B}x{L}"] = merge_costs(c, clock)
        record.setdefault("metadata_warm", {})[f"{B}x{L}"] = warm_metadata(c, clock)
        print(f"{B}x{L} metadata warm:", record["metadata_warm"][f"{B}x{L}"], flush=True)
        print(f"{B}x{L} merge:", record["merge"][f"{B}x{L}"], flush=True)
        if args.splits:
            grid = split_grid(c, clock) if not args.smoke else split_grid(c, clock, (1, 2), LAUNCH_GRID[:1])
            record.setdefault("split_grid", {})[f"{B}x{L}"] = grid
            print(f"{B}x{L}: SDPA {grid['sdpa_contiguous']} us, best {grid['best']}, default splits "
                  f"{grid['default_splits']}", flush=True)
        out_path.write_text(json.dumps(record, indent=1))
        del c
        if device.type == "cuda":
            torch.cuda.empty_cache()
    record["compiled"] = compiled_resources()
    record["elapsed_s"] = round(time.time() - t0, 1)
    out_path.write_text(json.dumps(record, indent=1))

    print(f"{record['env']['device']}: copy bandwidth (read + write) {record['copy_bandwidth_GBps']} GB/s")
    print("decode, block size 16, CUDA-graph time us / K+V GB/s (read flush)")
    names = list(dict.fromkeys(n for row in record["shapes"].values() for n in row if n != "kv_bytes"))
    print(f"{'':>22}" + "".join(f"{s:>18}" for s in record["shapes"]))
    for name in names:
        cells = []
        for row in record["shapes"].values():
            e = row.get(name, {"error": "-"})
            cells.append(f"{e['us']:8.1f} /{row['kv_bytes'] / e['us'] / 1e3:6.0f}" if "us" in e else
                         f"{'err ' + str(e.get('rel_err', e.get('error')))[:12]:>15}")
        print(f"{name:>22}" + "".join(f"{x:>18}" for x in cells))
    print("compiled:", record["compiled"])
    print(f"wrote {out_path} ({record['elapsed_s']} s)")
    return record


if __name__ == "__main__":
    main()
