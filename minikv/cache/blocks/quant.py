"""Quantized KV: 8 bits per value instead of 16 (or 32), with a scale (and, for int8, a zero point)
per token and KV head.

    kv_cache_dtype   stored as             values kept (one row = one token's head_dim values of one KV head)
    "auto"           the model's dtype     as computed                                          2 B / 4 B
    "int8"           torch.int8            q = round((x - zero) / scale), zero = (max + min) / 2,   1 B
                                           scale = (max - min) / 2 / 127; x ~ q * scale + zero
    "fp8"            torch.float8_e4m3fn   q = x / scale rounded to e4m3, scale = absmax / 448;     1 B
                                           x ~ q * scale

The pool keeps float32 scales (and int8's zero points) beside the blocks, indexed like the payload
less its last dimension:

    k_cache [num_layers, num_blocks, block_size, num_kv_heads, head_dim]  int8 / fp8
    k_scale [num_layers, num_blocks, block_size, num_kv_heads]            float32   (v the same)
    k_zero  [num_layers, num_blocks, block_size, num_kv_heads]            float32   (int8 only; v the same)

    one block of one layer and one KV head, block_size = 4, head_dim = 8:
      slot 0  [ q q q q q q q q ] s0 z0    x ~ q * s + z
      slot 1  [ q q q q q q q q ] s1 z1
      slot 2  [ q q q q q q q q ] s2 z2
      slot 3  [ . . . . . . . . ] .  .     not written yet: nothing to re-quantize when it is

Why per token: a token's K/V are final when stored, so each is quantized once, by the store
kernel, without reading back the rest of its block (a per-block or per-channel scale would have to
grow, and re-quantize the block, whenever a larger value arrives; KIVI keeps the unfinished group
in full precision for that reason). A paged pool fills one token at a time, so everything a
token's scale needs must be in its own row.

Why a zero point for int8: keys have outlier channels (the same few channels large in every
token, often of one sign). A symmetric grid spans [-absmax, absmax] and leaves half its levels on
values the row never takes; the grid from the row's min to its max (centred on its middle) has
up to twice the resolution for the same 255 levels, for 4 more bytes per row. fp8 keeps zero = 0:
its grid is densest near 0, and shifting a row by its middle would move its small values where
e4m3's steps are coarse. benchmarks/kv_quant_schemes.py measures the candidates (per-token and
per-group scales, symmetric and asymmetric, float16 scales, per-channel key scales per block) and
benchmarks/kv_quant_quality.py the result.

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
#   (x [..., head_dim] float, dtype) -> (q [..., head_dim] in dtype, scale [...] float32,
#                                        zero [...] float32 for int8, None for fp8)
Quantizer = Callable[[torch.Tensor, torch.dtype], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


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


def has_zero_point(dtype: torch.dtype) -> bool:
    """Does a pool of this dtype keep a zero point per row? int8 (a uniform grid, centred on each row)
    does; fp8 (a grid densest at 0) does not."""
    return dtype == torch.int8


def quantize_block(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [..., head_dim] -> (q [..., head_dim] in dtype, scale [...] float32, zero [...] float32 or None)
    with x ~ q * scale + zero (zero None, i.e. 0, for fp8).

    int8: the row's range [min, max] onto [-127, 127]: zero = (max + min) / 2, scale = (max - min) / 2 / 127,
    q = floor((x - zero) / scale + 0.5); a constant row gets scale 0 and is kept exactly by its zero.
    fp8: scale = absmax / 448 (the largest magnitude lands on +-448), rounded to nearest even by the
    conversion; a row of zeros gets scale 0. The store kernel computes the same, to the bit."""
    if dtype not in QMAX:
        raise ValueError(f"quantize_block stores int8 or float8_e4m3fn, got {dtype}")
    qmax = QMAX[dtype]
    xf = x.float()
    if has_zero_point(dtype):
        hi, lo = xf.amax(dim=-1), xf.amin(dim=-1)
        half, zero = (hi - lo) * 0.5, (hi + lo) * 0.5
        inv = torch.where(half > 0, qmax / half, torch.zeros_like(half))
        q = torch.floor((xf - zero[..., None]) * inv[..., None] + 0.5).clamp(-qmax, qmax).to(dtype)
        return q, half / qmax, zero
    absmax = xf.abs().amax(dim=-1)
    inv = torch.where(absmax > 0, qmax / absmax, torch.zeros_like(absmax))
    q = (xf * inv[..., None]).clamp(-qmax, qmax).to(dtype)
    return q, absmax / qmax, None


def dequantize_block(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [..., head_dim], scale and zero [...] -> q * scale + zero in dtype (what the attention kernels compute)."""
    x = q.float() * scale[..., None]
    if zero is not None:
        x = x + zero[..., None]
    return x.to(dtype)
