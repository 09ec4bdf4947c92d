"""Write this step's K/V into the pool: token t goes to slot `slot_mapping[t]`.

    k [T, num_kv_heads, head_dim]          k_cache [num_blocks, block_size, num_kv_heads, head_dim]
    slot s = block * block_size + offset   ->  k_cache[s // block_size, s % block_size]

One program per token copies its num_kv_heads x head_dim values: one contiguous row of a
token-major pool, or one head_dim row per KV head of a head-major one (the pool's strides say which).
A negative slot means "no slot" (a padding token) and is skipped.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kvcache_kernel(
    k_ptr, v_ptr,  # [T, num_kv_heads, head_dim]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], dim contiguous
    slot_mapping_ptr,  # [T]
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,  # the pool's strides: block, slot in the block, KV head
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_PAD)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h * stride_ch + d
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]  (one layer)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int, -1 = skip
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
    launch = {} if k.device.type != "cuda" else {"num_warps": 1 if num_kv_heads * head_dim <= 512 else 4}
    _store_kvcache_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1], NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_PAD=triton.next_power_of_2(head_dim),
        **launch,
    )
