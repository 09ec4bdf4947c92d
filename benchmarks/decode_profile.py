"""Look inside the decode kernel on a GPU: what the compiler made of it, and what Nsight Compute sees.

Writes the split kernel's PTX and Triton GPU IR (does it load with cp.async, 16-byte vectors, tensor
cores?), then runs the kernel and SDPA on contiguous K/V once per case between
cudaProfilerStart/Stop, so that Nsight Compute profiles exactly those launches:

    ncu --profile-from-start off --clock-control none --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \\
        python benchmarks/decode_profile.py --out $OUT

(--clock-control none leaves the card's clocks as they are.) Cases: 64 x 1024 with the default
split count, and with one split (one program per sequence and KV head, no merge; SDPA runs one
kernel there too) in big and small tiles, and 32 x 32768 (512 MiB of K/V); block size 16, bf16,
the pool stored as the engine stores it.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if __name__ == "__main__":  # run as a script: minikv from this checkout, installed or not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import minikv.kernels  # noqa: E402, F401, I001  (before triton: on a CPU it switches Triton to its interpreter)
import minikv.kernels.decode_attention as dec  # noqa: E402
from minikv.bench.decode_attention import (HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, TOL, contiguous_kv,  # noqa: E402
                                           decode_case, fp32_decode_reference, rel_err)

# (batch, context, splits (None = default), launch settings beyond the defaults)
CASES = [(64, 1024, None, {}), (64, 1024, 1, {"block_n": 128, "num_warps": 4, "num_stages": 3}),
         (64, 1024, 1, {"block_n": 32, "num_warps": 1, "num_stages": 4}), (32, 32768, None, {})]


def instruction_counts(text: str) -> dict:
    """How often the instructions that matter for a streaming kernel appear in PTX."""
    patterns = {"cp.async (async copy to shared)": r"cp\.async\.(?:ca|cg)", "cp.async.bulk (TMA)": r"cp\.async\.bulk",
                "ld.global 16-byte": r"ld\.global[\w.]*\.v4\.(?:b32|u32|f32)", "ld.global any": r"ld\.global",
                "mma.sync (tensor cores)": r"mma\.sync", "wgmma": r"wgmma\.mma_async",
                "ldmatrix": r"ldmatrix", "bar.sync": r"bar\.sync"}
    return {name: len(re.findall(p, text)) for name, p in patterns.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this profile needs a CUDA GPU (and Nsight Compute to read the counters)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    heads = (NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)
    runs = []
    for B, L, splits, launch in CASES:
        c = decode_case(B, L, 16, torch.bfloat16, device, heads)
        n = splits or dec.default_num_splits(B, NUM_KV_HEADS, L, device)
        kc = contiguous_kv(c["k_cache"], c["tables"], L).contiguous()
        vc = contiguous_kv(c["v_cache"], c["tables"], L).contiguous()
        q4 = c["q"][:, :, None, :]

        def kernel(c=c, n=n, L=L, launch=launch):
            return dec.paged_decode_attention(c["q"], c["k_cache"], c["v_cache"], c["tables"], c["seq_lens"],
                                              c["scale"], max_seq_len=L, num_splits=n, **launch)

        def sdpa(q4=q4, kc=kc, vc=vc, c=c):
            return F.scaled_dot_product_attention(q4, kc, vc, scale=c["scale"], enable_gqa=True)

        ref = fp32_decode_reference(c["q"], kc, vc, c["scale"])
        errs = (rel_err(kernel(), ref), rel_err(sdpa().reshape(ref.shape), ref))
        assert max(errs) <= TOL, (B, L, n, errs)
        runs.append((f"{B}x{L} splits {n} {launch}", kernel, sdpa, (c, kc, vc)))
        print(f"case {B}x{L}, {n} splits: rel err kernel {errs[0]:.1e}, sdpa {errs[1]:.1e}", flush=True)
    torch.cuda.synchronize()
    for name, kernel, sdpa, _ in runs:  # one profiled launch of each, in order: kernel (split, merge), sdpa
        torch.cuda.cudart().cudaProfilerStart()
        kernel()
        sdpa()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print("profiled:", name, flush=True)

    for caches in dec._decode_split_kernel.device_caches.values():
        for i, compiled in enumerate(caches[0].values()):
            for kind in ("ptx", "ttgir"):
                if kind in compiled.asm:
                    (out / f"decode_split_{i}.{kind}").write_text(compiled.asm[kind])
            print(f"compiled split kernel {i}: {compiled.n_regs} registers, {compiled.n_spills} spills, "
                  f"{compiled.metadata.shared} B shared, {compiled.metadata.num_warps} warps, "
                  f"{compiled.metadata.num_stages} stages")
            print("  PTX:", instruction_counts(compiled.asm.get("ptx", "")))


if __name__ == "__main__":
    main()
