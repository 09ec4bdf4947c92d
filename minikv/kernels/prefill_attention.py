"""Paged prefill attention: causal attention of each sequence's new tokens over its paged context.

The new tokens of sequence b sit at the end of its context; their K/V are already in the pool:

    query_start_loc[b] .. query_start_loc[b+1]   its rows of q (q_len of them)
    [0, seq_len - q_len)        context already cached (earlier chunks, or a cached prefix)
    [seq_len - q_len, seq_len)  the new tokens; the one at position p attends over keys [0, p]

This one kernel covers a whole prompt, a chunk of a long prompt (chunked prefill), a prompt whose
prefix came from the prefix cache, and a decode row mixed into the batch (q_len = 1).

    grid = (num_heads, cdiv(T, BLOCK_M) + B)   one program = BLOCK_M query rows of one head

The query tiles are laid out flat, as in varlen FlashAttention: sequence b's tiles start at program
query_start_loc[b] // BLOCK_M + b (strictly increasing in b, and room for its cdiv(q_len, BLOCK_M)
tiles), so a program finds its sequence by a binary search over query_start_loc. The grid depends on
T and B only, never on the longest query: a CUDA graph recorded for T_b tokens and many padding rows
launches ~T_b / BLOCK_M + rows programs per head, not rows x T_b / BLOCK_M (most of which would return
at once, at a cost: a 300-token step in a bucket of 512 paid nearly 6x its eager attention). The graph's
padding rows, empty and last, each own one tile; its program sees that from two loads and returns before
the search (benchmarks/NOTES_step_profile.md has what each layout cost on an H200).

Each program streams key tiles [0, last position of its rows] through the block table with the
same online softmax as the decode kernel; a tile's mask is causal (key pos <= query pos) and, with
a sliding window, key pos > query pos - window or key pos < sinks (StreamingLLM's sink tokens, read
by a first loop over [0, sinks) before the window's tiles). A block the engine gave back because it
fell wholly outside every window (block table entry -1) is never read. A quantized pool's tiles are
dequantized as they are read (minikv/kernels/quant.py).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from minikv.kernels.decode_attention import check_paged_layout
from minikv.kernels.quant import load_kv_tiles, quant_args


@triton.jit(do_not_specialize=["num_seqs"])  # one compiled kernel for every number of sequences
def _prefill_kernel(
    q_ptr,  # [T, num_heads, head_dim]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    k_scale_ptr, v_scale_ptr,  # [num_blocks, block_size, num_kv_heads] fp32 when QUANT (else unused)
    k_zero_ptr, v_zero_ptr,  # the same shape, fp32 zero points when HAS_ZERO (int8; else unused)
    block_tables_ptr,  # [B, max_blocks]
    query_start_loc_ptr,  # [B+1]
    seq_lens_ptr,  # [B]
    out_ptr,  # [T, num_heads, head_dim]
    num_seqs,  # B
    scale_log2e,
    window,  # keys in (pos - window, pos] when SLIDING
    sinks,  # and keys [0, sinks) when SLIDING
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_sb, stride_ss, stride_sh,
    stride_bt,
    stride_ot, stride_oh,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SLIDING: tl.constexpr,
    QUANT: tl.constexpr,  # int8/fp8 values with scales: dequantize each tile as it is read
    HAS_ZERO: tl.constexpr,  # int8: x = q * scale + zero (fp8: q * scale)
):
    head = tl.program_id(0)  # heads vary fastest: programs running together read the same K/V tiles
    tile_id = tl.program_id(1)
    # A CUDA graph's padding rows hold no tokens and come last: their first tiles are T // BLOCK_M + b, and
    # each is its row's only tile. Such a program returns after two loads, not a binary search.
    num_tokens = tl.load(query_start_loc_ptr + num_seqs).to(tl.int32)
    tail = tile_id - num_tokens // BLOCK_M  # the row whose first tile this is, were the row to start at T
    tail_ok = (tail >= 0) & (tail < num_seqs)
    if tl.load(query_start_loc_ptr + tail, mask=tail_ok, other=-1).to(tl.int32) == num_tokens:
        return  # rows tail.. start at T: all empty, and this tile is row tail's
    # the last sequence b whose first tile, query_start_loc[b] // BLOCK_M + b, is at most tile_id
    lo_b: tl.int32 = 0
    hi_b: tl.int32 = num_seqs  # invariant: first_tile(lo_b) <= tile_id < first_tile(hi_b), first_tile(num_seqs) = inf
    while hi_b - lo_b > 1:
        mid = (lo_b + hi_b) // 2
        if tl.load(query_start_loc_ptr + mid).to(tl.int32) // BLOCK_M + mid <= tile_id:
            lo_b = mid
        else:
            hi_b = mid
    b = lo_b
    q_start = tl.load(query_start_loc_ptr + b).to(tl.int32)
    m_tile = tile_id - (q_start // BLOCK_M + b)
    q_len = tl.load(query_start_loc_ptr + b + 1).to(tl.int32) - q_start
    if m_tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    first = seq_len - q_len  # position of the first new token

    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # index among the new tokens
    row_ok = rows < q_len
    q_pos = first + rows  # absolute positions of this program's queries
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_DIM
    q_rows = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    kv_head = head // GROUP
    hi = tl.minimum(first + (m_tile + 1) * BLOCK_M, seq_len)  # keys [lo, hi) can be seen by some row
    lo = 0
    if SLIDING:  # the first row's window starts here; earlier tiles are seen by no row
        lo = (tl.maximum(first + m_tile * BLOCK_M - window + 1, 0) // BLOCK_N) * BLOCK_N
    # a finite start (not -inf): a row may see no key of a tile under a sliding window
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    sink_end = 0
    if SLIDING:
        sink_end = tl.minimum(sinks, lo)  # sinks before the window's first tile: [0, sink_end)
    for tile in range(0, sink_end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        valid = pos < sink_end
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        k, v = load_kv_tiles(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, k_zero_ptr, v_zero_ptr, block, pos,
                             kv_head, d, valid, d_ok, stride_kb, stride_ks, stride_kh, stride_sb, stride_ss,
                             stride_sh, BLOCK_SIZE, QUANT, HAS_ZERO)
        k, v = k.to(q.dtype), v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e
        s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    for tile in range(lo, hi, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        valid = pos < hi
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        valid = valid & (block >= 0)  # -1: a block given back (outside every window), never read
        k, v = load_kv_tiles(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, k_zero_ptr, v_zero_ptr, block, pos,
                             kv_head, d, valid, d_ok, stride_kb, stride_ks, stride_kh, stride_sb, stride_ss,
                             stride_sh, BLOCK_SIZE, QUANT, HAS_ZERO)
        k, v = k.to(q.dtype), v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e  # [BLOCK_M, BLOCK_N]
        see = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if SLIDING:
            see = see & ((pos[None, :] > q_pos[:, None] - window) | (pos[None, :] < sinks))
        s = tl.where(see, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i = 0 only on padding rows past q_len
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


# launch settings on a GPU (the interpreter ignores warps and stages)
PREFILL_CONFIG = {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2}


def paged_prefill_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]  the flattened new tokens of B sequences
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]  (one layer)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int
    query_start_loc: torch.Tensor,  # [B+1] offsets of each sequence's rows in q
    seq_lens: torch.Tensor,  # [B] context length after this step
    scale: float,
    sliding_window: int | None = None,
    sink_tokens: int = 0,  # with a sliding window: keys [0, sink_tokens) stay in sight (StreamingLLM)
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    out: torch.Tensor | None = None,  # [T, num_heads, head_dim] to write into (else a new tensor)
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] fp32: a quantized pool's scales
    v_scale: torch.Tensor | None = None,
    k_zero: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] fp32: an int8 pool's zero points
    v_zero: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal varlen attention of the new tokens over their paged context: [T, num_heads, head_dim]."""
    T, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, kd = k_cache.shape
    check_paged_layout(q, k_cache, v_cache)
    k_scale, v_scale, k_zero, v_zero, stride_sb, stride_ss, stride_sh, quant, has_zero = quant_args(
        k_scale, v_scale, k_cache, k_zero, v_zero)
    B = seq_lens.shape[0]
    if query_start_loc.shape[0] != B + 1 or block_tables.shape[0] != B:
        raise ValueError(f"query_start_loc needs B+1 = {B + 1} entries and block_tables B rows")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} must be shaped like q {tuple(q.shape)}, head_dim contiguous")
    if T == 0:
        return out
    interp = q.device.type != "cuda"
    block_m = block_m or PREFILL_CONFIG["block_m"]
    block_n = block_n or PREFILL_CONFIG["block_n"]
    launch = {} if interp else {"num_warps": num_warps or PREFILL_CONFIG["num_warps"],
                                "num_stages": num_stages or PREFILL_CONFIG["num_stages"]}
    grid = (num_heads, triton.cdiv(T, block_m) + B)  # flat query tiles (top of the file)
    _prefill_kernel[grid](
        q, k_cache, v_cache, k_scale, v_scale, k_zero, v_zero, block_tables, query_start_loc, seq_lens, out, B,
        scale * math.log2(math.e), sliding_window or 0, sink_tokens if sliding_window else 0,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        stride_sb, stride_ss, stride_sh,
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        BLOCK_SIZE=block_size, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        HEAD_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None, SLIDING=bool(sliding_window),
        QUANT=quant, HAS_ZERO=has_zero, **launch,
    )
    return out
