"""RMSNorm with the residual add folded in: one kernel where torch launches about eight.

A decoder layer adds each block's output to the residual stream and normalizes the sum before the
next block. In plain torch that is an add, a cast to float32, a square, a mean, an rsqrt, two
multiplies and casts back: each a kernel that reads and writes all T x hidden values. Fused
(vLLM's `fused_add_rms_norm`), each row is read once and written once:

    x        [T, hidden]   the block's output (or the embeddings, with no residual yet)
    residual [T, hidden]   the residual stream so far
        s = x + residual                        (rounded to the model's dtype: the new residual)
        out = weight * (s / sqrt(mean(s^2) + eps))
    returns (out [T, hidden], s [T, hidden])

The arithmetic is the torch reference's (`RMSNorm` in minikv/model/llama.py), rounding included:
the sum is rounded to the model's dtype before it is normalized, the normalized row is rounded
before the weight multiplies it. Only the order of the mean's additions differs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from minikv.kernels.interpreter import interpreted


@triton.jit(do_not_specialize=["num_rows"])  # one compiled kernel for every batch size
def _add_rms_norm_kernel(
    x_ptr, residual_ptr,  # [T, hidden] inputs (residual unused without HAS_RESIDUAL)
    weight_ptr,  # [hidden]
    out_ptr, new_residual_ptr,  # [T, hidden] outputs, contiguous
    num_rows, eps,
    stride_x, stride_r,  # row strides of the inputs
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,  # HIDDEN rounded up to a power of two
    ROWS: tl.constexpr,  # rows per program
    HAS_RESIDUAL: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]  # [ROWS, 1]
    cols = tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]
    mask = (rows < num_rows) & (cols < HIDDEN)
    rows = rows.to(tl.int64)
    x = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(residual_ptr + rows * stride_r + cols, mask=mask, other=0.0)  # in the model's dtype
        tl.store(new_residual_ptr + rows * HIDDEN + cols, x, mask=mask)
    s = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(s * s, axis=1, keep_dims=True) / HIDDEN + eps)  # [ROWS, 1]
    normed = (s * inv_rms).to(x_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + cols, mask=cols < HIDDEN, other=0.0)
    out = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + rows * HIDDEN + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def fused_add_rms_norm(
    x: torch.Tensor,  # [T, hidden]
    residual: torch.Tensor | None,  # [T, hidden], or None: plain RMSNorm, x itself is the residual
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual) in one launch. Without a residual: (RMSNorm(x) *
    weight, x). The output has the dtype of `weight` times the normed row, as torch's RMSNorm gives."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, hidden] with contiguous rows, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}; call .contiguous() first")
    T, hidden = x.shape
    if weight.shape != (hidden,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match hidden size {hidden}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} "
                         f"{x.dtype} with contiguous rows")
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    new_residual = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else x
    if T == 0:
        return out, new_residual
    block = triton.next_power_of_2(hidden)
    # compiled: one row per program (T programs fill the GPU); interpreted: fewer, larger programs
    rows = max(1, min(16, 16384 // block)) if interpreted() else 1
    launch = {} if interpreted() else {"num_warps": max(1, min(8, block // 256))}
    _add_rms_norm_kernel[(triton.cdiv(T, rows),)](
        x, residual if residual is not None else x, weight, out, new_residual, T, eps,
        x.stride(0), residual.stride(0) if residual is not None else 0,
        HIDDEN=hidden, BLOCK=block, ROWS=rows, HAS_RESIDUAL=residual is not None, **launch,
    )
    return out, new_residual
