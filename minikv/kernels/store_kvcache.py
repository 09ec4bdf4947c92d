"""Write this step's K/V into the pool: token t goes to slot `slot_mapping[t]`.

    k [T, num_kv_heads, head_dim]          k_cache [num_blocks, block_size, num_kv_heads, head_dim]
    slot s = block * block_size + offset   ->  k_cache[s // block_size, s % block_size]

One program per token copies its num_kv_heads x head_dim values: one contiguous row of a
token-major pool, or one head_dim row per KV head of a head-major one (the pool's strides say which).
A negative slot means "no slot" (a padding token) and is skipped.

Into a quantized pool (int8 or fp8, minikv/cache/blocks/quant.py) each KV head's row is quantized on the
way, from that row alone: int8 maps the row's [min, max] onto [-127, 127] (zero = the middle, scale
= half the range / 127, both kept beside the blocks, round((x - zero) / scale) to the slot); fp8
keeps scale = absmax / 448 and x / scale rounded to e4m3. `quantize_block` there is this kernel's
torch twin, to the bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from minikv.cache.blocks.quant import QMAX, has_zero_point
from minikv.kernels.quant import quant_args


@triton.jit
def _store_kvcache_kernel(
    k_ptr, v_ptr,  # [T, num_kv_heads, head_dim]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], dim contiguous
    k_scale_ptr, v_scale_ptr,  # [num_blocks, block_size, num_kv_heads] fp32 (QUANT only)
    k_zero_ptr, v_zero_ptr,  # the same shape, fp32 zero points (int8 only)
    slot_mapping_ptr,  # [T]
    qmax,  # the largest stored magnitude (QUANT only): 127 for int8, 448 for fp8 e4m3
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,  # the pool's strides: block, slot in the block, KV head
    stride_sb, stride_ss, stride_sh,  # the scales' strides
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    QUANT: tl.constexpr,  # 0: store as is, 1: int8 with zero points (round half up), 2: fp8 (the conversion rounds)
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_PAD)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h * stride_ch + d
    if QUANT:
        s_dst = (slot // BLOCK_SIZE) * stride_sb + (slot % BLOCK_SIZE) * stride_ss + h * stride_sh  # [HEADS_PAD, 1]
        d_ok = d < HEAD_DIM
        k, k_scale, k_zero = _quantize_rows(k, d_ok, qmax, QUANT)
        v, v_scale, v_zero = _quantize_rows(v, d_ok, qmax, QUANT)
        tl.store(k_scale_ptr + s_dst, k_scale, mask=h < NUM_KV_HEADS)
        tl.store(v_scale_ptr + s_dst, v_scale, mask=h < NUM_KV_HEADS)
        if QUANT == 1:
            tl.store(k_zero_ptr + s_dst, k_zero, mask=h < NUM_KV_HEADS)
            tl.store(v_zero_ptr + s_dst, v_zero, mask=h < NUM_KV_HEADS)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_rows(x, d_ok, qmax, QUANT: tl.constexpr):
    """x [HEADS_PAD, HEAD_PAD] (zeros where masked), d_ok [1, HEAD_PAD] the real channels ->
    (values on the 8-bit grid as fp32, scale [HEADS_PAD, 1], zero [HEADS_PAD, 1] (0 for fp8))."""
    x = x.to(tl.float32)
    if QUANT == 1:  # int8: the row's [min, max] onto [-qmax, qmax], centred on its middle
        hi = tl.max(tl.where(d_ok, x, float("-inf")), axis=1, keep_dims=True)
        lo = tl.min(tl.where(d_ok, x, float("inf")), axis=1, keep_dims=True)
        half = (hi - lo) * 0.5
        zero = (hi + lo) * 0.5
        inv = qmax / tl.where(half > 0, half, 1.0)
        inv = tl.where(half > 0, inv, 0.0)  # a constant row: q = 0, kept exactly by its zero point
        y = tl.floor((x - zero) * inv + 0.5)
        scale = half / qmax
    else:  # fp8: symmetric, absmax onto +-qmax
        absmax = tl.max(tl.abs(x), axis=1, keep_dims=True)
        inv = qmax / tl.where(absmax > 0, absmax, 1.0)  # a row of zeros stays zeros (scale 0)
        y = x * inv
        # round to e4m3's grid here (to nearest, ties to even) so that the conversion is exact:
        # the interpreter's own fp32 -> fp8 rounding drops the carry into the exponent (125.5 -> 64)
        pow2 = (tl.abs(y).to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)  # 2^floor(log2|y|)
        ulp = tl.maximum(pow2 * 0.125, 0.001953125)  # 3 mantissa bits; subnormal spacing 2^-9 below 2^-6
        r = ((y / ulp + 12582912.0) - 12582912.0) * ulp  # + 1.5 * 2^23 rounds y / ulp to an integer
        y = tl.where(r == 0.0, y * 0.0, r)  # keep the sign of a value that rounds to zero (-0.0), as torch does
        scale = absmax / qmax
        zero = absmax * 0.0
    y = tl.minimum(tl.maximum(y, -qmax), qmax)
    return y, scale, zero


def store_kvcache(
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]  (one layer)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int, -1 = skip
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] fp32: a quantized pool's scales
    v_scale: torch.Tensor | None = None,
    k_zero: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] fp32: an int8 pool's zero points
    v_zero: torch.Tensor | None = None,
) -> None:
    T, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    if k_cache.shape[2:] != (num_kv_heads, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(f"caches {tuple(k_cache.shape)} do not hold [.., .., {num_kv_heads}, {head_dim}] rows")
    if k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache need one layout with a contiguous head_dim (stride 1)")
    if slot_mapping.shape != (T,):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} needs one slot per token ({T})")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v need a contiguous head_dim (stride 1)")
    if T == 0:
        return
    k_scale, v_scale, k_zero, v_zero, stride_sb, stride_ss, stride_sh, quant, has_zero = quant_args(
        k_scale, v_scale, k_cache, k_zero, v_zero)
    qmax = QMAX.get(k_cache.dtype, 0.0)
    if quant != bool(qmax):
        raise ValueError(f"a pool of {k_cache.dtype} {'needs' if qmax else 'takes no'} scales (k_scale, v_scale); "
                         "quantized pools hold int8 or float8_e4m3fn values with float32 scales")
    if has_zero != has_zero_point(k_cache.dtype):
        raise ValueError(f"a pool of {k_cache.dtype} {'needs' if has_zero_point(k_cache.dtype) else 'takes no'} "
                         "zero points (k_zero, v_zero): int8 pools keep one per row, fp8 pools none")
    launch = {} if k.device.type != "cuda" else {"num_warps": 1 if num_kv_heads * head_dim <= 512 else 4}
    _store_kvcache_kernel[(T,)](
        k, v, k_cache, v_cache, k_scale, v_scale, k_zero, v_zero, slot_mapping, qmax,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        stride_sb, stride_ss, stride_sh,
        BLOCK_SIZE=k_cache.shape[1], NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_PAD=triton.next_power_of_2(head_dim),
        QUANT=0 if not quant else 1 if k_cache.dtype == torch.int8 else 2,
        **launch,
    )
