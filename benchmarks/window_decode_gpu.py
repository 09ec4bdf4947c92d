"""Sliding window with sink tokens on a GPU: the compiled Triton kernels equal the torch reference,
never read a block the engine gave back, and decode reads only the sinks and the window.

    python benchmarks/window_decode_gpu.py [--out DIR]      (a CUDA device; a few seconds)

1. correctness, fp16 and bf16: decode (1 and several splits) and prefill on ragged lengths, with the
   blocks outside every window set to -1 in the table (as the engine leaves them)
2. timing (CUDA events, median of 30): decode attention of 32 sequences x 32k tokens, full context
   against a window of 4,096 + 4 sinks, same pool, same run; the baseline is the full-context kernel
Writes window_decode_gpu.json (device, versions, figures) into --out.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess

import torch

from minikv.attention.common import attend
from minikv.attention.metadata import AttentionMetadata
from minikv.cache.blocks.window import NO_BLOCK, window_free_rule
from minikv.kernels import paged_decode_attention, paged_prefill_attention


def pool_and_tables(seq_lens, block_size, kv_heads, head_dim, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(s / block_size) for s in seq_lens]
    order = torch.randperm(sum(need) + 3, generator=g)
    tables = torch.full((len(seq_lens), max(need)), -1, dtype=torch.long)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = order[used:used + n]
        used += n
    shape = (sum(need) + 3, block_size, kv_heads, head_dim)
    k = torch.randn(shape, generator=g).to(dtype).to(device)
    v = torch.randn(shape, generator=g).to(dtype).to(device)
    return k, v, tables.to(device)


def give_back(tables, meta, window, sinks, block_size):
    tables = tables.clone().cpu()
    for b in range(meta.num_seqs):
        first_q = meta.seq_lens_list[b] - meta.query_lens_list[b]
        n = int((tables[b] >= 0).sum())
        for i in window_free_rule(tables[b, :n].tolist(), first_q, block_size, window, sinks):
            tables[b, i] = NO_BLOCK
    return tables


def reference(q, k_cache, v_cache, tables, meta, scale, window, sinks):
    B, L = meta.num_seqs, meta.max_seq_len
    t = tables.clamp(min=0)
    keys = k_cache[t].reshape(B, -1, *k_cache.shape[2:])[:, :L].float()
    values = v_cache[t].reshape(B, -1, *v_cache.shape[2:])[:, :L].float()
    return attend(q.float(), keys, values, meta, scale, window, sinks)


def correctness(device) -> list[dict]:
    rows = []
    scale = 128 ** -0.5
    for dtype in (torch.float16, torch.bfloat16):
        for bs, window, sinks in ((16, 256, 4), (16, 100, 17)):
            seq_lens = [1, 40, 300, 1000, 5000]
            k, v, tables = pool_and_tables(seq_lens, bs, 2, 128, dtype, device, seed=bs + window)
            meta = AttentionMetadata.build([1] * len(seq_lens), seq_lens, device=device)
            q = torch.randn(len(seq_lens), 8, 128, device=device).to(dtype)
            want = reference(q, k, v, tables, meta, scale, window, sinks)
            freed = give_back(tables, meta, window, sinks, bs).to(device)
            for splits in (1, 4):
                out = paged_decode_attention(q, k, v, freed, meta.seq_lens, scale, num_splits=splits,
                                             sliding_window=window, sink_tokens=sinks)
                rows.append({"kernel": "decode", "dtype": str(dtype), "window": window, "sinks": sinks,
                             "splits": splits, "max_abs_err": (out.float() - want).abs().max().item()})
            query_lens, seq_lens = [300, 1, 700], [2000, 900, 700]
            k, v, tables = pool_and_tables(seq_lens, bs, 2, 128, dtype, device, seed=window)
            meta = AttentionMetadata.build(query_lens, seq_lens, device=device)
            q = torch.randn(sum(query_lens), 8, 128, device=device).to(dtype)
            want = reference(q, k, v, tables, meta, scale, window, sinks)
            freed = give_back(tables, meta, window, sinks, bs).to(device)
            out = paged_prefill_attention(q, k, v, freed, meta.query_start_loc, meta.seq_lens, scale,
                                          sliding_window=window, sink_tokens=sinks)
            rows.append({"kernel": "prefill", "dtype": str(dtype), "window": window, "sinks": sinks,
                         "max_abs_err": (out.float() - want).abs().max().item()})
    return rows


def timing(device, reps: int = 30) -> list[dict]:
    B, ctx, kv_heads, heads, D, bs = 32, 32768, 8, 32, 128, 16
    window, sinks = 4096, 4
    k, v, tables = pool_and_tables([ctx] * B, bs, kv_heads, D, torch.bfloat16, device)
    meta = AttentionMetadata.build([1] * B, [ctx] * B, device=device)
    q = torch.randn(B, heads, D, device=device, dtype=torch.bfloat16)
    freed = give_back(tables, meta, window, sinks, bs).to(device)
    rows = []
    for name, table, kw, keys in (("full context", tables, {}, ctx),
                                  ("window 4096 + 4 sinks", freed, dict(sliding_window=window, sink_tokens=sinks),
                                   window + sinks)):
        run = lambda: paged_decode_attention(q, k, v, table, meta.seq_lens, D ** -0.5, max_seq_len=ctx, **kw)  # noqa: E731
        for _ in range(5):
            run()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        kv_bytes = 2 * B * keys * kv_heads * D * 2
        med = statistics.median(times)
        rows.append({"case": name, "batch": B, "context": ctx, "keys_read_per_seq": keys, "kv_bytes_read": kv_bytes,
                     "median_us": med, "min_us": min(times), "max_us": max(times),
                     "GB_per_s": kv_bytes / med / 1e3})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    device = torch.device("cuda")
    import transformers
    import triton

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    checks = correctness(device)
    tol = {"torch.float16": 5e-3, "torch.bfloat16": 3e-2}
    ok = all(r["max_abs_err"] <= tol[r["dtype"]] for r in checks)
    for r in checks:
        print(r)
    print("correct:", ok)
    times = timing(device) if ok else []
    print(f"{'case':<24}{'keys/seq':>10}{'median us':>12}{'spread':>20}{'GB/s':>8}")
    for r in times:
        print(f"{r['case']:<24}{r['keys_read_per_seq']:>10}{r['median_us']:>12.1f}"
              f"{r['min_us']:>10.1f}-{r['max_us']:<9.1f}{r['GB_per_s']:>8.0f}")
    record = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "triton": triton.__version__,
              "transformers": transformers.__version__, "commit": commit, "correct": ok, "tolerance": tol,
              "correctness": checks, "timing": times}
    with open(os.path.join(args.out, "window_decode_gpu.json"), "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
