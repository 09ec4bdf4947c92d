"""The decode step's matmuls on a GPU: how far each is from the bytes it must read, cuBLAS (F.linear) against a
Triton GEMM for few rows (all of a step's rows in one tile, so each weight is read once; split over K where the
output is too narrow to fill the card).

    python3 benchmarks/decode_gemm_gpu.py --out benchmarks/decode_gemm_gpu.json     (a CUDA device; ~3 minutes)
    python3 benchmarks/decode_gemm_gpu.py --smoke                                    (a CPU: the kernel's check)

Why: at 218 sequences a decode step of Qwen2.5-0.5B shapes was busy 2.01 ms against a bytes floor of 0.735 ms
(ratios_gpu.py, H200, 2026-11-28); its matmuls took 0.83 ms where their weights alone take 0.24 at the copy
bandwidth. This script says which matmul loses how much, and whether a kernel shaped for few rows gets closer.

Qwen2.5-0.5B's matmuls at --rows rows (218: the decode part of ratios_gpu.py): qkv (N = 1,152, with bias),
o (896), gate_up (9,728), down (896 from K = 4,864), each with 24 layers' own random bf16 weights, so that, as
in a step, every call reads its weights from memory and not from the 50 MB L2. A CUDA graph of the 24 calls is
timed (events, median; `minikv.bench.decode_attention.kernel_time`), per call = replay / 24. The floor of a call: its
weight, input and output bytes at the card's copy bandwidth (`measure_limits`, the throughput floor's).
1. correctness first: every candidate against float32 torch on the same inputs; one that is off by more than
   bf16's rounding is reported and not timed;
2. cuBLAS per matmul: microseconds a call, and over its floor;
3. the Triton GEMM: each configuration (BLOCK_N, BLOCK_K, SPLIT_K, num_warps) that launches enough programs,
   its time; the best per matmul against cuBLAS.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if __name__ == "__main__":  # run as a script: minikv from this checkout, installed or not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import minikv.kernels  # noqa: E402, F401, I001  (first: on a CPU it switches Triton to its interpreter)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# name -> (N, K, bias): Qwen2.5-0.5B, hidden 896, 14 query heads and 2 KV heads of 64, intermediate 4,864
SHAPES = {"qkv": (1152, 896, True), "o": (896, 896, False), "gate_up": (9728, 896, False), "down": (896, 4864, False)}
LAYERS = 24


@triton.jit
def _few_rows_gemm_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                          k_per_split, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """out[M, N] = x[M, K] @ w[N, K]^T (+ bias), every row in one BLOCK_M tile: a program reads its BLOCK_N
    rows of w over its share of K once. SPLIT_K > 1: float32 partials [SPLIT_K, M, N], summed by the next kernel."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = pid_k * k_per_split
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_start + k_per_split, BLOCK_K):
        rk = k + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        a = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=(rn[:, None] < N) & k_ok[None, :], other=0.0)
        acc += tl.dot(a, tl.trans(b))
    ok = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(out_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :], acc, mask=ok)


@triton.jit
def _sum_splits_kernel(part_ptr, bias_ptr, out_ptr, M, N, stride_om, HAS_BIAS: tl.constexpr,
                       SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(part_ptr + s * M * N + offs, mask=ok, other=0.0)
    n = offs % N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + (offs // N) * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=ok)


class FewRowsGemm:
    """F.linear(x, w, bias) for x of at most 256 rows, with one configuration; its float32 partials are kept
    so that a CUDA graph can replay it."""

    def __init__(self, M: int, N: int, K: int, block_n: int, block_k: int, split_k: int, num_warps: int,
                 device: torch.device):
        if M > 256:
            raise ValueError(f"{M} rows: this GEMM keeps every row in one tile of at most 256")
        self.M, self.N, self.K = M, N, K
        self.block_m = max(16, triton.next_power_of_2(M))
        self.block_n, self.block_k, self.split_k, self.num_warps = block_n, block_k, split_k, num_warps
        self.k_per_split = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
        self.partials = torch.empty(split_k, M, N, dtype=torch.float32, device=device) if split_k > 1 else None

    @property
    def programs(self) -> int:
        return triton.cdiv(self.N, self.block_n) * self.split_k

    def __call__(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
        launch = {} if x.device.type != "cuda" else {"num_warps": self.num_warps, "num_stages": 3}
        target = out if self.split_k == 1 else self.partials
        has_bias = bias is not None
        _few_rows_gemm_kernel[(triton.cdiv(self.N, self.block_n), self.split_k)](
            x, w, bias if has_bias else w, target, self.M, self.N, self.K, x.stride(0), w.stride(0), out.stride(0),
            self.k_per_split, HAS_BIAS=has_bias, BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_K=self.block_k,
            SPLIT_K=self.split_k, **launch)
        if self.split_k > 1:
            block = 1024
            _sum_splits_kernel[(triton.cdiv(self.M * self.N, block),)](
                self.partials, bias if has_bias else w, out, self.M, self.N, out.stride(0), HAS_BIAS=has_bias,
                SPLIT_K=self.split_k, BLOCK=block)


def configs(N: int, K: int, min_programs: int):
    """The configurations worth timing: enough programs to fill the card, splits that leave each a share of K."""
    for block_n, block_k, split_k, warps in itertools.product((32, 64, 128), (64, 128), (1, 2, 4, 8), (4, 8)):
        if triton.cdiv(N, block_n) * split_k >= min_programs and K // split_k >= block_k:
            yield block_n, block_k, split_k, warps


def smoke() -> int:
    """The kernel against torch in float32 on tiny shapes (Triton's interpreter on a CPU): with and without bias,
    with and without splits, rows and columns that do not fill their tiles."""
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for (M, N, K), bias, (block_n, block_k, split_k) in itertools.product(
            [(5, 48, 64), (17, 40, 96)], (False, True), [(16, 32, 1), (32, 32, 2), (16, 16, 3)]):
        x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
        b = torch.randn(N, generator=g) if bias else None
        out = torch.full((M, N), float("nan"))
        FewRowsGemm(M, N, K, block_n, block_k, split_k, 4, torch.device("cpu"))(x, w, b, out)
        err = (out.double() - F.linear(x.double(), w.double(), None if b is None else b.double())).abs().max().item()
        worst = max(worst, err)
        if not err < 1e-4:
            print(f"[gemm] WRONG: M {M} N {N} K {K} bias {bias} tiles {block_n}x{block_k} split {split_k}: {err:.2e}")
            return 1
    print(f"[gemm] smoke: 12 cases against float64, worst error {worst:.1e}")
    return 0


def measure(rows: int, reps: int) -> dict:
    from minikv.bench import environment
    from minikv.bench.decode_attention import Clock, kernel_time
    from minikv.bench.throughput import measure_limits

    dev = torch.device("cuda")
    clock = Clock(dev, reps=reps, warmup=3)
    bw = measure_limits("cuda")["copy_bytes_per_s"]
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    record = {"benchmark": "decode_gemm_gpu", **environment("cuda"), "rows": rows, "layers": LAYERS,
              "copy_bandwidth_bytes_s": round(bw), "shapes": {}}
    g = torch.Generator(device=dev).manual_seed(0)
    for name, (N, K, has_bias) in SHAPES.items():
        ws = [torch.randn(N, K, generator=g, device=dev, dtype=torch.bfloat16) * K ** -0.5 for _ in range(LAYERS)]
        bs = [torch.randn(N, generator=g, device=dev, dtype=torch.bfloat16) if has_bias else None for _ in ws]
        x = torch.randn(rows, K, generator=g, device=dev, dtype=torch.bfloat16)
        outs = [torch.empty(rows, N, device=dev, dtype=torch.bfloat16) for _ in ws]
        want = F.linear(x.float(), ws[0].float(), None if bs[0] is None else bs[0].float())
        tol = 4 * want.abs().max().item() * 2 ** -8  # a few bf16 roundings of the largest output
        floor_us = (N * K + rows * K + rows * N) * 2 / bw * 1e6

        def timed(call) -> float:  # the 24 layers' calls replayed from one CUDA graph, per call
            return kernel_time(clock, lambda: [call(x, w, b, o) for w, b, o in zip(ws, bs, outs)]) / LAYERS

        cublas = timed(cublas_linear)
        row = {"N": N, "K": K, "bias": has_bias, "floor_us": round(floor_us, 2), "cublas_us": round(cublas, 2),
               "candidates": []}
        for block_n, block_k, split_k, warps in configs(N, K, sms // 2):
            gemm = FewRowsGemm(rows, N, K, block_n, block_k, split_k, warps, dev)
            cand = {"block_n": block_n, "block_k": block_k, "split_k": split_k, "num_warps": warps,
                    "programs": gemm.programs}
            row["candidates"].append(cand)
            try:
                gemm(x, ws[0], bs[0], outs[0])
            except Exception as e:  # e.g. Triton's OutOfResources: tiles past the shared memory
                cand["error"] = f"{type(e).__name__}: {str(e)[:120]}"
                continue
            cand["max_err"] = err = (outs[0].float() - want).abs().max().item()
            if err <= tol:
                cand["us"] = round(timed(gemm), 2)
        timed_ok = [c for c in row["candidates"] if "us" in c]
        row["wrong"] = sum("max_err" in c and "us" not in c for c in row["candidates"])
        row["failed"] = sum("error" in c for c in row["candidates"])
        row["best"] = min(timed_ok, key=lambda c: c["us"]) if timed_ok else None
        record["shapes"][name] = row
        best = row["best"]
        print(f"[gemm] {name:8s} N {N:5d} K {K:5d}: floor {floor_us:6.2f} us, cuBLAS {cublas:6.2f} us "
              f"({cublas / floor_us:.2f}x)" + (f", Triton best {best['us']:6.2f} us ({best['us'] / floor_us:.2f}x; "
                                               f"{best['block_n']}x{best['block_k']}, split {best['split_k']}, "
                                               f"{best['num_warps']} warps)" if best else ", no Triton candidate right")
              + (f", {row['wrong']} wrong" if row["wrong"] else "")
              + (f", {row['failed']} did not launch" if row["failed"] else ""), flush=True)
    return record


def cublas_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """F.linear into `out`: the cuBLAS calls F.linear makes (addmm with a bias, mm without)."""
    if bias is None:
        torch.mm(x, w.t(), out=out)
    else:
        torch.addmm(bias, x, w.t(), out=out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="a .json path for the figures")
    ap.add_argument("--rows", type=int, default=218, help="rows of each matmul (sequences decoding; at most 256)")
    ap.add_argument("--reps", type=int, default=30, help="replays timed per figure (median)")
    ap.add_argument("--smoke", action="store_true", help="only the kernel's check on tiny shapes (any machine)")
    args = ap.parse_args(argv)
    if args.smoke:
        return smoke()
    if not torch.cuda.is_available():
        print("error: no CUDA device; this script times the decode matmuls on a GPU (--smoke checks the kernel "
              "anywhere)", file=sys.stderr)
        return 2
    record = measure(args.rows, args.reps)
    if args.out:
        args.out.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
