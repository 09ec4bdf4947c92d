"""Rotary embedding of q and k in one kernel, straight out of the merged q/k/v projection.

The merged projection gives each token one row holding its query heads, then its K heads, then its
V heads:

    qkv [T, (num_heads + 2 * num_kv_heads) * head_dim]
        row t: [ q head 0 | ... | q head H-1 | k head 0 | ... | k head KV-1 | v head 0 | ... ]
                 <- head_dim ->

One program per token reads that row once and writes q and k rotated and v as it is, each to its
own contiguous tensor, the layout attention and the KV store expect:

    q [T, num_heads, head_dim]   k [T, num_kv_heads, head_dim]   v [T, num_kv_heads, head_dim]

The angles come from the token's position and the inverse frequencies (Llama-3 scaling already
folded in, see `rope_inv_freq` in minikv/model/llama.py), computed in the kernel: no [T, head_dim]
cos/sin tables are built. Each head's two halves rotate as pairs (Hugging Face's convention):

    angle_i = position * inv_freq[i]                  i < head_dim / 2
    out[i]            = x[i] cos(angle_i) - x[i + half] sin(angle_i)
    out[i + half]     = x[i + half] cos(angle_i) + x[i] sin(angle_i)

Where torch rounds cos and sin to the model's dtype and each product on its way, the kernel keeps
float32 until the single rounding of the result: in float32 the two agree to a few units in the
last place, in 16-bit types the kernel is the more exact of the two.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from minikv.kernels.interpreter import interpreted


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, t, stride_src, first_head, cos, sin,
                  NUM: tl.constexpr, NUM_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                  T_MASK, ROTATE: tl.constexpr):
    """Heads [first_head, first_head + NUM) of rows t [ROWS, 1, 1] -> dst [T, NUM, 2 * HALF], rotated or copied."""
    h = tl.arange(0, NUM_PAD)[None, :, None]
    d = tl.arange(0, HALF_PAD)[None, None, :]
    mask = T_MASK & (h < NUM) & (d < HALF)
    src = src_ptr + t * stride_src + (first_head + h) * (2 * HALF) + d
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    dst = dst_ptr + (t * NUM + h) * (2 * HALF) + d
    if ROTATE:
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        x1, x2 = a * cos - b * sin, b * cos + a * sin
    tl.store(dst, x1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, x2.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_rows"])  # one compiled kernel for every batch size
def _rotary_qkv_kernel(
    qkv_ptr,  # [T, (H + 2 KV) * D], row stride stride_qkv
    positions_ptr,  # [T] int
    inv_freq_ptr,  # [D / 2] float32
    q_ptr, k_ptr, v_ptr,  # outputs, contiguous: [T, H, D], [T, KV, D], [T, KV, D]
    num_rows, stride_qkv,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr,  # head_dim / 2, and rounded up to a power of two
    ROWS: tl.constexpr,  # tokens per program
):
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None, None]  # [ROWS, 1, 1]
    t_mask = t < num_rows
    t = t.to(tl.int64)
    d = tl.arange(0, HALF_PAD)[None, None, :]
    pos = tl.load(positions_ptr + t, mask=t_mask, other=0).to(tl.float32)
    angle = pos * tl.load(inv_freq_ptr + d, mask=d < HALF, other=0.0)  # [ROWS, 1, HALF_PAD]
    # into [-pi, pi] first: a position of 30,000 is 30,000 radians in the first pair, where cos and sin
    # need a long argument reduction (or, approximated, lose accuracy). 2 pi = 6.28125 + a small rest:
    # k * 6.28125 is exact in float32 for k < 2^16 (positions up to ~400,000); only the rest's rounding remains.
    k = tl.floor(angle * 0.15915494309189535 + 0.5)  # the nearest multiple of 2 pi
    angle = (angle - k * 6.28125) - k * 0.0019353071795864769
    cos, sin = tl.cos(angle), tl.sin(angle)
    _rotate_heads(qkv_ptr, q_ptr, t, stride_qkv, 0, cos, sin, NUM_HEADS, HEADS_PAD, HALF, HALF_PAD, t_mask, True)
    _rotate_heads(qkv_ptr, k_ptr, t, stride_qkv, NUM_HEADS, cos, sin, NUM_KV_HEADS, KV_HEADS_PAD, HALF, HALF_PAD,
                  t_mask, True)
    _rotate_heads(qkv_ptr, v_ptr, t, stride_qkv, NUM_HEADS + NUM_KV_HEADS, cos, sin, NUM_KV_HEADS, KV_HEADS_PAD,
                  HALF, HALF_PAD, t_mask, False)


def rotary_qkv(
    qkv: torch.Tensor,  # [T, (num_heads + 2 * num_kv_heads) * head_dim]
    positions: torch.Tensor,  # [T] int
    inv_freq: torch.Tensor,  # [head_dim / 2] float32
    num_heads: int,
    num_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the merged projection into q [T, H, D], k [T, KV, D], v [T, KV, D] (contiguous), with the
    rotary embedding of each token's position applied to q and k. One launch."""
    half = inv_freq.numel()
    head_dim = 2 * half
    T = qkv.shape[0]
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(-1) != 1:
        raise ValueError(f"qkv must be [T, (num_heads + 2 * num_kv_heads) * head_dim] = [T, {width}] with contiguous "
                         f"rows, got shape {tuple(qkv.shape)} strides {qkv.stride()}")
    if positions.shape != (T,):
        raise ValueError(f"positions {tuple(positions.shape)} needs one position per token ({T})")
    if inv_freq.dtype != torch.float32 or inv_freq.device != qkv.device:
        raise ValueError(f"inv_freq must be float32 on {qkv.device} (the angles are computed in float32), got "
                         f"{inv_freq.dtype} on {inv_freq.device}")
    q = torch.empty(T, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(T, num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    v = torch.empty_like(k)
    if T == 0:
        return q, k, v
    heads_pad = triton.next_power_of_2(num_heads)
    half_pad = triton.next_power_of_2(half)
    # compiled: one token per program; interpreted: fewer, larger programs
    rows = max(1, min(16, 4096 // (heads_pad * half_pad))) if interpreted() else 1
    launch = {} if interpreted() else {"num_warps": max(1, min(8, heads_pad * half_pad // 512))}
    _rotary_qkv_kernel[(triton.cdiv(T, rows),)](
        qkv, positions, inv_freq, q, k, v, T, qkv.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEADS_PAD=heads_pad,
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads), HALF=half, HALF_PAD=half_pad, ROWS=rows, **launch,
    )
    return q, k, v
