"""Paged attention of a step of few new tokens per sequence: a prefix hit's suffix, a chunk's tail,
a handful of decodes beside a short prompt. Split-K like decode, but the query rows of one sequence
share their K/V reads.

Such a step has a long context and few queries: 32 new tokens after an 8,192-token cached prefix.
The prefill kernel gives it one program per (sequence, head), walking the whole context alone; the
decode kernel, one row per token, cuts the context into splits across the GPU but reads every K/V
tile once per query row (32 times, mostly from L2). Here one program takes up to ROWS consecutive
query rows of one sequence and all the query heads of one KV head, so each K/V tile it loads serves
ROWS x group query vectors in one tensor-core product:

    grid = (about T / ROWS, num_kv_heads, num_splits)       T: the step's query rows

    a group: up to ROWS consecutive query rows of one sequence; the groups are numbered in order of
    the sequences, and program g of axis 0 takes groups g, g + grid[0], ... (found in
    query_start_loc on the device: a sequence row without tokens costs no program)
    q tile [ROWS * GROUP_PAD, head_dim]: row m = (query row r, query head h) = (m // GROUP_PAD, m % GROUP_PAD)
    query row r sits at position p_r = seq_len - query_len + r0 + r and sees keys [0, p_r]: causal
    within the new tokens, everything before them. The group's keys are [0, p_last], cut into
    num_splits ranges of whole tiles; a split past some rows' positions leaves those rows empty
    (lse -inf, weight 0 in the merge), as a short sequence leaves a decode split empty.

The splits' partial results are joined by the decode kernel's merge (one program per token row and
query head). Nothing is read on the host: the grid depends on T alone and the groups are found on the device,
so a CUDA graph can capture the step (minikv/engine/cuda_graph.py's StepGraphs pass a bucket's
buffers: more sequence rows than hold tokens, and max_seq_len the model's limit).

Limits: no sliding window (those steps keep the decode kernel's row-per-token path, which has one);
the pool in any storage order with a contiguous head_dim; a quantized pool is dequantized tile by
tile as the decode kernel does (minikv/kernels/quant.py). fp16 and bf16 on a GPU, fp32 too (exact
dot); in the interpreter fp32 and fp16.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from minikv.kernels.decode_attention import _decode_merge_kernel, _num_sms, check_paged_layout, supports_pdl
from minikv.kernels.quant import load_kv_tiles, quant_args


@triton.jit
def _query_rows_split_kernel(
    q_ptr,  # [T, num_heads, head_dim]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], any strides
    k_scale_ptr, v_scale_ptr, k_zero_ptr, v_zero_ptr,  # a quantized pool's scales / zeros (QUANT, HAS_ZERO)
    block_tables_ptr,  # [B, table_width]
    query_start_loc_ptr,  # [B + 1]
    seq_lens_ptr,  # [B] context after this step, the new tokens included
    out_ptr,  # [T, num_heads, head_dim]   written directly when SINGLE_SPLIT
    part_out_ptr,  # [T, num_heads, num_splits, HEAD_PAD] fp32
    part_lse_ptr,  # [T, num_heads, num_splits] fp32 (log2 units)
    scale_log2e,
    num_seqs,  # B
    num_splits,
    table_width,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_sb, stride_ss, stride_sh,
    stride_bt,
    stride_ot, stride_oh,
    SINGLE_SPLIT: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    ROWS: tl.constexpr,  # query rows per group (a power of two)
    SEQS_PAD: tl.constexpr,  # a power of two >= B
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # a power of two, ROWS * GROUP_PAD >= 16
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
    QUANT: tl.constexpr,
    HAS_ZERO: tl.constexpr,
):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP
    # The groups: each sequence's query rows cut into runs of ROWS, numbered in order. Every program
    # reads the whole query_start_loc and finds its groups there (g = program_id(0), then every
    # num_programs(0)-th): a padding sequence or one without tokens has no group, so the grid needs
    # no program per sequence row (a graph's step buffers hold many), only about T / ROWS.
    s_idx = tl.arange(0, SEQS_PAD)
    s_ok = s_idx < num_seqs
    q_starts = tl.load(query_start_loc_ptr + s_idx, mask=s_ok, other=0)
    q_lens = tl.load(query_start_loc_ptr + s_idx + 1, mask=s_ok, other=0) - q_starts
    runs = (q_lens + ROWS - 1) // ROWS
    runs_end = tl.cumsum(runs, 0)  # groups of sequences [0, s]
    m = tl.arange(0, ROWS * GROUP_PAD)
    r, h = m // GROUP_PAD, m % GROUP_PAD
    head = kv_head * GROUP + h
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_DIM
    for g in range(tl.program_id(0), tl.sum(runs, 0), tl.num_programs(0)):
        seq = tl.sum((runs_end <= g).to(tl.int32), 0)  # the sequence whose groups hold g
        this = s_idx == seq
        r0 = (g - tl.sum(tl.where(this, runs_end - runs, 0), 0)) * ROWS
        q_start = tl.sum(tl.where(this, q_starts, 0), 0)
        query_len = tl.sum(tl.where(this, q_lens, 0), 0).to(tl.int32)
        seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
        num_rows = tl.minimum(query_len - r0, ROWS)
        first = seq_len - query_len + r0  # position of this group's first query row
        span = first + num_rows  # keys [0, span): what its last row sees
        split_len = tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N
        start = split * split_len
        end = tl.where(split == num_splits - 1, span, tl.minimum(start + split_len, span))
        m_ok = (r < num_rows) & (h < GROUP)
        token = (q_start + r0 + r).to(tl.int64)  # each row's index in q (and out)
        pos_q = first + r  # each row's own position: it sees keys <= pos_q
        part = (token * num_heads + head) * num_splits + split
        q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        m_i = tl.full([ROWS * GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS * GROUP_PAD], tl.float32)
        acc = tl.zeros([ROWS * GROUP_PAD, HEAD_PAD], tl.float32)
        for tile in range(start, end, BLOCK_N):  # none when the split lies past every row's keys
            pos = tile + tl.arange(0, BLOCK_N)
            valid = pos < end
            block = tl.load(table + pos // BLOCK_SIZE, mask=valid & (pos // BLOCK_SIZE < table_width), other=0)
            k, v = load_kv_tiles(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, k_zero_ptr, v_zero_ptr,
                                 block.to(tl.int64), pos, kv_head, d, valid, d_ok, stride_kb, stride_ks, stride_kh,
                                 stride_sb, stride_ss, stride_sh, BLOCK_SIZE, QUANT, HAS_ZERO)
            k, v = k.to(q.dtype), v.to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e  # [M, BLOCK_N] log2 units
            s = tl.where(valid[None, :] & (pos[None, :] <= pos_q[:, None]), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: exp2(-inf) = 0, not NaN
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        if SINGLE_SPLIT:  # every row sees key 0 at least: l_i > 0
            tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                     (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
        else:  # a row with no key in this split (or an empty split): o 0, lse -inf, weight 0 in the merge
            seen = l_i > 0
            l_safe = tl.where(seen, l_i, 1.0)
            tl.store(part_out_ptr + part[:, None] * HEAD_PAD + d[None, :], acc / l_safe[:, None],
                     mask=m_ok[:, None])
            tl.store(part_lse_ptr + part, tl.where(seen, m_i + tl.log2(l_safe), float("-inf")), mask=m_ok)


# launch settings on a GPU and the split heuristic. Measured on an H100 (benchmarks/query_rows_gpu.py and
# query_rows_step_gpu.py, a hit's 32 rows over 2k to 8k keys): groups of 8 rows (a 64-row tile with
# 7 heads a row) beat 16 and 32 at every length, 4 warps; about 2 programs per SM, no split under 64
# positions (8 splits over 2,080 keys took 13.3 us, 16-64 splits 9.4-10.2).
QUERY_ROWS_CONFIG = {"rows": 8, "block_n": 32, "num_warps": 4, "num_stages": 2}
QUERY_ROWS_PROGRAMS_PER_SM = 2
QUERY_ROWS_MIN_SPLIT = 64  # positions


def query_rows_num_splits(groups: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Splits for about QUERY_ROWS_PROGRAMS_PER_SM programs per SM over `groups` row groups, none shorter
    than QUERY_ROWS_MIN_SPLIT positions (each split writes ROWS x group partial rows for the merge)."""
    if device.type != "cuda":
        return max(1, min(2, max_seq_len // QUERY_ROWS_MIN_SPLIT))  # the interpreter: few programs
    want = math.ceil(QUERY_ROWS_PROGRAMS_PER_SM * _num_sms(device) / max(groups * num_kv_heads, 1))
    return max(1, min(want, max_seq_len // QUERY_ROWS_MIN_SPLIT, 128))


def paged_query_rows_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]  the flattened new tokens of B sequences
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]  (one layer)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int
    query_start_loc: torch.Tensor,  # [B + 1] offsets of each sequence's rows in q
    seq_lens: torch.Tensor,  # [B] context after this step (its new tokens' K/V already stored)
    scale: float,
    max_seq_len: int,  # host bound of the longest context (sets the split count only; the groups and their
    #   ranges are read on the device, so no bound of the query runs is needed)
    num_splits: int | None = None,
    rows: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    out: torch.Tensor | None = None,
    pdl: bool | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    k_zero: torch.Tensor | None = None,
    v_zero: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context, split-K, the query rows of
    one sequence sharing their K/V reads: [T, num_heads, head_dim] (the same as paged_prefill_attention)."""
    T, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, kd = k_cache.shape
    check_paged_layout(q, k_cache, v_cache)
    B = seq_lens.shape[0]
    if query_start_loc.shape[0] != B + 1 or block_tables.shape[0] != B:
        raise ValueError(f"query_start_loc {tuple(query_start_loc.shape)} needs B + 1 entries and block_tables "
                         f"{tuple(block_tables.shape)} B rows, for the B = {B} entries of seq_lens")
    k_scale, v_scale, k_zero, v_zero, stride_sb, stride_ss, stride_sh, quant, has_zero = quant_args(
        k_scale, v_scale, k_cache, k_zero, v_zero)
    group = num_heads // num_kv_heads
    rows = triton.next_power_of_2(rows or QUERY_ROWS_CONFIG["rows"])
    block_n = block_n or QUERY_ROWS_CONFIG["block_n"]
    group_pad = triton.next_power_of_2(group)
    if rows * group_pad < 16:  # the tensor-core product wants 16 rows at least
        rows = triton.next_power_of_2(triton.cdiv(16, group_pad))
    groups = max(1, triton.cdiv(T, rows))  # programs along axis 0: about the groups a step of T rows fills
    if num_splits is None:
        num_splits = query_rows_num_splits(groups, num_kv_heads, max_seq_len, q.device)
    head_pad = max(16, triton.next_power_of_2(head_dim))
    if out is None:
        out = torch.empty_like(q)
    if num_splits > 1:
        part_out = torch.empty(T, num_heads, num_splits, head_pad, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(T, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    interp = q.device.type != "cuda"
    pdl = num_splits > 1 and supports_pdl(q.device) and (True if pdl is None else pdl)
    launch = {} if interp else {"num_warps": num_warps or QUERY_ROWS_CONFIG["num_warps"],
                                "num_stages": num_stages or QUERY_ROWS_CONFIG["num_stages"]}
    _query_rows_split_kernel[(groups, num_kv_heads, num_splits)](
        q, k_cache, v_cache, k_scale, v_scale, k_zero, v_zero, block_tables, query_start_loc, seq_lens, out,
        part_out, part_lse, scale * math.log2(math.e), B, num_splits, block_tables.shape[1],
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        stride_sb, stride_ss, stride_sh,
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        SINGLE_SPLIT=num_splits == 1, BLOCK_SIZE=block_size, ROWS=rows, SEQS_PAD=triton.next_power_of_2(B),
        GROUP=group, GROUP_PAD=group_pad,
        HEAD_DIM=head_dim, HEAD_PAD=head_pad, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None, USE_PDL=pdl, QUANT=quant, HAS_ZERO=has_zero,
        **launch,
    )
    if num_splits > 1:
        _decode_merge_kernel[(T, num_heads)](
            out, part_out, part_lse, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_PAD=head_pad, SPLITS_PAD=triton.next_power_of_2(num_splits), USE_PDL=pdl,
            **({} if interp else {"num_warps": max(1, min(8, triton.next_power_of_2(num_splits) * head_pad // 1024)),
                                  "launch_pdl": pdl}),
        )
    return out
