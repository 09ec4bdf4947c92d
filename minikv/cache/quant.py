"""Quantized KV: 8 bits per value instead of 16 (or 32), and one scale per token and KV head.

    kv_cache_dtype   stored as             values kept                       per value
    "auto"           the model's dtype     as computed                       2 B (bf16/fp16), 4 B (fp32)
    "int8"           torch.int8            round(x / scale), scale = absmax / 127      1 B
    "fp8"            torch.float8_e4m3fn   x / scale rounded to e4m3, scale = absmax / 448   1 B

Granularity: one float32 scale per (token, KV head), taken over that head's head_dim values when
the token is stored. The pool keeps the scales beside the blocks, indexed like the payload less
its last dimension:

    k_cache [num_layers, num_blocks, block_size, num_kv_heads, head_dim]  int8 / fp8
    k_scale [num_layers, num_blocks, block_size, num_kv_heads]            float32   (v the same)

    one block of one layer and one KV head, block_size = 4, head_dim = 8:
      slot 0  [ q q q q q q q q ] s0     x ~ q * s   (s = absmax of the row / qmax)
      slot 1  [ q q q q q q q q ] s1
      slot 2  [ q q q q q q q q ] s2
      slot 3  [ . . . . . . . . ] .      not written yet: nothing to re-quantize when it is

Why per token: a token's K/V are final when stored, so each is quantized once, by the store
kernel, without reading back the rest of its block (a per-block scale would have to grow, and
re-quantize the block, whenever a larger value arrives). The cost is 4 bytes per head_dim values:
3% of an int8 row at head_dim 128, 6% at 64. What it does not handle: a few channels of the keys
that are large in every token (outlier channels; KIVI and KVQuant quantize keys per channel for
that reason) set each row's scale, and the other channels of that row lose resolution.
benchmarks/kv_quant_quality.py measures this choice against a per-block scale.

`quantize_block` / `dequantize_block` are the torch reference (and the twin of the Triton store
kernel, minikv/kernels/store_kvcache.py): they work on any [..., head_dim] tensor, one block or
one step's new tokens alike.
"""
from __future__ import annotations

from typing import Callable

import torch

KV_CACHE_DTYPES = ("auto", "int8", "fp8")
# the largest magnitude each 8-bit format stores (e4m3fn: 448 = 1.75 * 2^8, no infinities)
QMAX = {torch.int8: 127.0}
if hasattr(torch, "float8_e4m3fn"):
    QMAX[torch.float8_e4m3fn] = 448.0

# A kv_quantizer (the seam of exercise 09a):
#   (x [..., head_dim] float, dtype) -> (q [..., head_dim] in dtype, scale [...] float32)
Quantizer = Callable[[torch.Tensor, torch.dtype], tuple[torch.Tensor, torch.Tensor]]


def fp8_supported(device: torch.device) -> str | None:
    """None when this torch and device can hold and convert float8_e4m3fn values; else why not."""
    if not hasattr(torch, "float8_e4m3fn"):
        return f"torch {torch.__version__} has no float8_e4m3fn type (it came with torch 2.1)"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        return (f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) has no fp8 conversions; "
                "they start with compute capability 8.9 (Ada, Hopper)")
    return None


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the pool stores K/V in: "auto" -> the model's, "int8" -> int8, "fp8" -> float8_e4m3fn."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "int8":
        return torch.int8
    if kv_cache_dtype == "fp8":
        return torch.float8_e4m3fn
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QMAX


def quantize_block(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (q [..., head_dim] in dtype, scale [...] float32) with x ~ q * scale.

    scale = absmax over head_dim / qmax, so the largest value of each row lands on +-qmax; a row of
    zeros gets scale 0 (and dequantizes to zeros). int8 rounds half up (floor(y + 0.5)), as the store
    kernel does; fp8 rounds to nearest even, as every fp8 conversion does."""
    if dtype not in QMAX:
        raise ValueError(f"quantize_block stores int8 or float8_e4m3fn, got {dtype}")
    qmax = QMAX[dtype]
    xf = x.float()
    absmax = xf.abs().amax(dim=-1)
    inv = torch.where(absmax > 0, qmax / absmax, torch.zeros_like(absmax))
    y = xf * inv[..., None]
    if dtype == torch.int8:
        q = torch.floor(y + 0.5).clamp(-qmax, qmax).to(torch.int8)
    else:
        q = y.clamp(-qmax, qmax).to(dtype)
    return q, absmax / qmax


def dequantize_block(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [..., head_dim], scale [...] -> q * scale in dtype (what the attention kernels compute)."""
    return (q.float() * scale[..., None]).to(dtype)
