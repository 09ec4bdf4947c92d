"""Attention of a query-row step on the GPU: a prefix hit's new tokens over their cached context, the
grouped kernel (paged_query_rows_attention: a sequence's rows share each K/V tile) against the decode
kernel one row per token (the path such steps took before), in one run.

    python3 benchmarks/query_rows_gpu.py [--context 8192] [--rows 32] [--out FILE.json]

Qwen2.5-0.5B's attention shapes (14 query heads, 2 KV heads, head_dim 64, bf16, blocks of 16), one
sequence, its blocks scattered over the pool. Each variant is first checked against float64 attention
of the same K/V, then timed with CUDA events over CUDA graphs of 20 calls (no Python launch
overhead in the figure, as in the engine's graphs; the median over --iters calls). Two call
shapes: "exact" passes the step's own lengths; "graph" passes what the engine's CUDA graphs pass (a
bucket's rows: 33 sequence rows of which one holds tokens, max_seq_len the model's limit).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import minikv.kernels.query_rows_attention as qr  # noqa: E402
from minikv.bench import environment  # noqa: E402
from minikv.kernels import paged_decode_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 14, 2, 64, 16


def timed(fn, iters: int, per_graph: int = 20) -> float:
    """Device time of one call: `per_graph` calls captured in a CUDA graph (no Python launch overhead
    between them, as in the engine's graphs), each replay timed with CUDA events; the median / per_graph."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    graph.replay()
    times = []
    for _ in range(max(1, iters // per_graph)):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / per_graph)
    return statistics.median(times)


def mixed_step(single_rows: int, context: int, tail_rows: int, iters: int) -> list[dict]:
    """`single_rows` sequences of one query row each (decodes beside a short prompt), then one sequence of
    `tail_rows` rows, every context `context` keys: the decode kernel a row per token against the grouped
    kernel (default settings), after a float64 check of both."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    query_lens = [1] * single_rows + ([tail_rows] if tail_rows else [])
    B, T, nblocks = len(query_lens), sum(query_lens), -(-context // BLOCK)
    k_cache = torch.randn(B * nblocks + 8, BLOCK, KV_HEADS, HEAD_DIM, device=dev, generator=g, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(B * nblocks + 8, device=dev, generator=g)[:B * nblocks].view(B, nblocks)
    q = torch.randn(T, HEADS, HEAD_DIM, device=dev, generator=g, dtype=torch.bfloat16)
    scale = HEAD_DIM ** -0.5
    qsl = torch.tensor([0] + query_lens, device=dev).cumsum(0)
    seq_lens = torch.full((B,), context, device=dev)
    token_seq = torch.repeat_interleave(torch.arange(B, device=dev), torch.tensor(query_lens, device=dev))
    token_pos = torch.cat([torch.arange(context - n, context, device=dev) for n in query_lens])
    want = torch.empty(T, HEADS, HEAD_DIM, dtype=torch.float64, device=dev)
    for t in range(T):
        b, p = int(token_seq[t]), int(token_pos[t])
        keys = k_cache[tables[b]].reshape(-1, KV_HEADS, HEAD_DIM)[:p + 1].double()
        vals = v_cache[tables[b]].reshape(-1, KV_HEADS, HEAD_DIM)[:p + 1].double()
        keys, vals = (x.repeat_interleave(HEADS // KV_HEADS, 1) for x in (keys, vals))
        want[t] = torch.einsum("hk,khd->hd", (torch.einsum("hd,khd->hk", q[t].double(), keys) * scale).softmax(-1),
                               vals)
    row_tables, row_lens = tables.index_select(0, token_seq), token_pos + 1

    def decode_rows():
        return paged_decode_attention(q, k_cache, v_cache, row_tables, row_lens, scale, max_seq_len=context,
                                      split_per_seq=True)

    def grouped():
        return qr.paged_query_rows_attention(q, k_cache, v_cache, tables, qsl, seq_lens, scale, context)
    out = []
    for name, fn in (("decode kernel, a row per token", decode_rows), ("grouped (defaults)", grouped)):
        err = (fn().double() - want).abs().max().item()
        if err > 2e-2:
            raise SystemExit(f"mixed {name}: max error {err:.3e} against float64")
        out.append({"scenario": f"{single_rows} one-row sequences + one of {tail_rows} rows, {context} keys each",
                    "variant": name, "median_us": timed(fn, iters), "max_abs_error": err})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=8192, help="cached tokens before the new ones")
    ap.add_argument("--rows", type=int, default=32, help="new tokens (query rows)")
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--mixed", action="store_true", help="also steps of many one-row sequences (decodes beside a "
                    "short prompt)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    L, R = args.context + args.rows, args.rows
    nblocks = -(-L // BLOCK)
    pool_blocks = 2 * nblocks + 8
    k_cache = torch.randn(pool_blocks, BLOCK, KV_HEADS, HEAD_DIM, device=dev, generator=g, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(pool_blocks, device=dev, generator=g)[:nblocks][None, :]
    q = torch.randn(R, HEADS, HEAD_DIM, device=dev, generator=g, dtype=torch.bfloat16)
    scale = HEAD_DIM ** -0.5
    qsl = torch.tensor([0, R], device=dev)
    seq_lens = torch.tensor([L], device=dev)
    pos = torch.arange(L - R, L, device=dev)

    # float64 reference
    keys = k_cache[table[0]].reshape(-1, KV_HEADS, HEAD_DIM)[:L].double().repeat_interleave(HEADS // KV_HEADS, 1)
    vals = v_cache[table[0]].reshape(-1, KV_HEADS, HEAD_DIM)[:L].double().repeat_interleave(HEADS // KV_HEADS, 1)
    s = torch.einsum("rhd,khd->hrk", q.double(), keys) * scale
    s = s.masked_fill(torch.arange(L, device=dev)[None, None, :] > pos[None, :, None], float("-inf"))
    want = torch.einsum("hrk,khd->rhd", s.softmax(-1), vals)

    # the graph's call shape: 33 sequence rows, only the first holds tokens
    g_rows = 33
    g_qsl = torch.full((g_rows + 1,), R, device=dev)
    g_qsl[0] = 0
    g_lens = torch.zeros(g_rows, dtype=torch.long, device=dev)
    g_lens[0] = L
    g_tables = torch.zeros(g_rows, nblocks, dtype=torch.long, device=dev)
    g_tables[0] = table[0]

    row_tables, row_lens = table.expand(R, -1), pos + 1

    def decode_rows():  # the decode kernel, one row per token (what the step took before)
        return paged_decode_attention(q, k_cache, v_cache, row_tables, row_lens, scale, max_seq_len=L,
                                      split_per_seq=True)

    variants = {"decode kernel, a row per token": decode_rows}
    for rows in (8, 16, 32):
        for warps in (4, 8):
            def grouped(rows=rows, warps=warps):
                return qr.paged_query_rows_attention(q, k_cache, v_cache, table, qsl, seq_lens, scale, L,
                                                     rows=rows, num_warps=warps)
            variants[f"grouped rows={rows} warps={warps}"] = grouped
    for rows in (16,):
        def graph_shape(rows=rows):
            return qr.paged_query_rows_attention(q, k_cache, v_cache, g_tables, g_qsl, g_lens, scale, L + 4,
                                                 rows=rows)
        variants[f"grouped rows={rows}, the graph's call shape"] = graph_shape
    splits_default = qr.query_rows_num_splits(-(-R // qr.QUERY_ROWS_CONFIG["rows"]), KV_HEADS, L, dev)
    for splits in sorted({16, 32, 64, 128} - {splits_default}):
        def with_splits(splits=splits):
            return qr.paged_query_rows_attention(q, k_cache, v_cache, table, qsl, seq_lens, scale, L,
                                                 num_splits=splits)
        variants[f"grouped default rows, {splits} splits"] = with_splits
    rows_out = []
    for name, fn in variants.items():
        err = (fn().double() - want).abs().max().item()
        if err > 2e-2:
            raise SystemExit(f"{name}: max error {err:.3e} against float64")
        us = timed(fn, args.iters)
        rows_out.append({"variant": name, "median_us": us, "max_abs_error": err})
    base = rows_out[0]["median_us"]
    print(f"{torch.cuda.get_device_name()}: {R} query rows over {L} keys, {HEADS}/{KV_HEADS} heads, d {HEAD_DIM}, "
          f"bf16; default splits {splits_default}")
    for r in rows_out:
        print(f"  {r['variant']:45} {r['median_us']:8.2f} us  {base / r['median_us']:5.2f}x   "
              f"err {r['max_abs_error']:.1e}")
    mixed = []
    if args.mixed:
        for single, context, tail in ((32, 2048, 0), (128, 1024, 16), (255, 1024, 1)):
            mixed += mixed_step(single, context, tail, args.iters)
        for r in mixed:
            print(f"  {r['scenario']}: {r['variant']:32} {r['median_us']:8.2f} us   err {r['max_abs_error']:.1e}")
    if args.out:
        record = {"benchmark": "query_rows_gpu", **environment(), "context": args.context, "rows": R,
                  "default_splits": splits_default, "config": qr.QUERY_ROWS_CONFIG, "results": rows_out, "mixed": mixed}
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
