"""SwiGLU's activation in one kernel: SiLU of the gate times the up projection.

With the gate and up projections merged into one matmul, their outputs lie side by side in each row:

    gate_up [T, 2 * I]   row t:  [ gate_t (I values) | up_t (I values) ]
    out     [T, I]       out_t = silu(gate_t) * up_t,   silu(g) = g * sigmoid(g)

torch needs a SiLU kernel and a multiply (and, unmerged, two matmuls); here each value of gate_up
is read once and each output written once. Rounding as torch's `F.silu(g) * u`: SiLU in float32,
rounded to the model's dtype, then the product, rounded again.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from minikv.kernels.interpreter import interpreted


@triton.jit(do_not_specialize=["num_rows"])  # one compiled kernel for every batch size
def _silu_and_mul_kernel(
    gate_up_ptr,  # [T, 2 * INTER], row stride stride_g
    out_ptr,  # [T, INTER], contiguous
    num_rows, stride_g,
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,  # columns per program
    ROWS: tl.constexpr,  # rows per program
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]  # [ROWS, 1]
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]
    mask = (rows < num_rows) & (cols < INTER)
    rows = rows.to(tl.int64)
    gate = tl.load(gate_up_ptr + rows * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + rows * stride_g + INTER + cols, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + rows * INTER + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 * I] (gate first, then up) -> silu(gate) * up  [T, I]."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"gate_up must be [T, 2 * intermediate] with contiguous rows, got shape "
                         f"{tuple(gate_up.shape)} strides {gate_up.stride()}")
    T, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(T, inter, dtype=gate_up.dtype, device=gate_up.device)
    if T == 0:
        return out
    if interpreted():  # few, large programs: the interpreter pays per program
        block = triton.next_power_of_2(inter)
        rows = max(1, min(16, 32768 // block))
        launch = {}
    else:
        block, rows, launch = min(1024, triton.next_power_of_2(inter)), 1, {"num_warps": 4}
    grid = (triton.cdiv(T, rows), triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](gate_up, out, T, gate_up.stride(0), INTER=inter, BLOCK=block, ROWS=rows, **launch)
    return out
