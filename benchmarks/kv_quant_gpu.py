"""The quantized pool on a GPU: decode attention time and bytes read for int8 and fp8 against bf16 at
long contexts, and engine throughput at equal pool memory when the pool is the limit.

    python benchmarks/kv_quant_gpu.py --out benchmarks/kv_quant_gpu_h100.json     the recorded run
    python benchmarks/kv_quant_gpu.py --smoke                                       tiny shapes (CPU too)

One process, one card, the bf16 baseline beside each quantized run:
  1. correctness (before any timing): the store kernel against quantize_block (bf16 K/V in: int8's
     values, scales and zero points, fp8's values and scales), the decode and prefill kernels on int8
     and fp8 pools against an fp32 reference over the dequantized K/V (q * scale + zero), ragged
     lengths, blocks of 16 and 128
  2. decode attention, Qwen2.5-0.5B's attention shape (14 query / 2 KV heads, head_dim 64), the
     engine's head-major pool, block 16: CUDA-graph median time (L2 flushed by reading), the bytes
     the step must read (K, V, scales, int8's zero points, the block table) and the bandwidth they imply
  3. the engine (random bf16 Qwen2.5-0.5B-shaped weights, Triton attention, CUDA graphs) on one
     fixed pool memory: requests whose K/V outgrow a bf16 pool; the 8-bit pool holds ~1.9x the
     tokens, so more sequences run at once. Output tokens per second, the most sequences running at
     once, preemptions.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
import time
from pathlib import Path

import torch

import minikv.kernels  # noqa: F401, I001  (first: on a CPU it switches Triton to its interpreter)
from minikv.bench import environment
from minikv.bench.decode_attention import Clock, copy_bandwidth, kernel_time, rel_err
from minikv.cache.blocks.quant import dequantize_block, quantize_block
from minikv.kernels import paged_decode_attention, paged_prefill_attention, store_kvcache

H, KVH, D = 14, 2, 64
TOL = 1e-2  # relative L2 error against fp32 on bf16 queries (bf16 rounding ~4e-3)
QDTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
DT = torch.bfloat16 if torch.cuda.is_available() else torch.float32  # the interpreter's bf16 is wrong


def pool(B, L, block_size, device, seed):
    """B sequences of L tokens scattered over a shuffled pool: bf16 K/V [blocks, block_size, KVH, D]
    stored head-major (the engine's layout for Triton), and the block tables."""
    g = torch.Generator().manual_seed(seed)
    per = math.ceil(L / block_size)
    n = B * per + 4
    tables = torch.randperm(n, generator=g)[: B * per].view(B, per).to(device)
    kv = [torch.randn(n, KVH, block_size, D, generator=g).to(device, DT).transpose(1, 2)
          for _ in range(2)]
    return kv[0], kv[1], tables


def quantized(cache, dtype):
    """cache quantized like the store kernel: (values in cache's head-major layout, scales [blocks, slots, KVH],
    zero points of the same shape (int8) or None (fp8))."""
    q, s, z = quantize_block(cache, dtype)
    stored = torch.empty_like(cache.transpose(1, 2), dtype=dtype).transpose(1, 2)
    stored.copy_(q)
    return stored, s, z


def quant_kwargs(ks, vs, kz, vz) -> dict:
    """The kernels' keyword arguments for a pool's scales and zero points (empty for a bf16 pool)."""
    return {} if ks is None else {"k_scale": ks, "v_scale": vs, "k_zero": kz, "v_zero": vz}


def reference(q, k, v, tables, seq_lens, scale):
    """fp32 decode attention per sequence over k, v [blocks, slots, KVH, D] (any dtype, already dequantized)."""
    outs = []
    for b in range(q.shape[0]):
        L = int(seq_lens[b])
        kk = k[tables[b]].reshape(-1, KVH, D)[:L].float().transpose(0, 1)  # [KVH, L, D]
        vv = v[tables[b]].reshape(-1, KVH, D)[:L].float().transpose(0, 1)
        qq = q[b].float().view(KVH, H // KVH, D)
        p = (torch.einsum("hgd,hld->hgl", qq, kk) * scale).softmax(-1)
        outs.append(torch.einsum("hgl,hld->hgd", p, vv).reshape(H, D))
    return torch.stack(outs)


def correctness(device, smoke) -> dict:
    out = {}
    scale = D**-0.5
    g = torch.Generator().manual_seed(1)
    # store kernel vs quantize_block: bf16 K/V as the model makes them
    T, bs, nb = 300, 16, 40
    k = torch.randn(T, KVH, D, generator=g).to(device, DT)
    k[:, :, 5] *= 30  # an outlier channel
    v = torch.randn(T, KVH, D, generator=g).to(device, DT)
    slots = torch.randperm(nb * bs, generator=g)[:T].to(device)
    for name, dt in QDTYPES.items():
        kc = torch.zeros(nb, bs, KVH, D, dtype=dt, device=device)
        vc = torch.zeros_like(kc)
        ks, vs, kz, vz = torch.zeros(4, nb, bs, KVH, device=device).unbind(0)
        if dt != torch.int8:  # fp8 pools keep no zero points
            kz = vz = None
        store_kvcache(k, v, kc, vc, slots, ks, vs, kz, vz)
        wq, ws, wz = quantize_block(k, dt)
        got = kc[slots // bs, slots % bs]
        out[f"store_{name}"] = {
            "values_bit_equal": (got.view(torch.uint8) == wq.view(torch.uint8)).float().mean().item(),
            "values_within_one_level": ((got.float() - wq.float()).abs()
                                        <= (1 if dt == torch.int8 else wq.float().abs() / 8)).float().mean().item(),
            "scale_rel_err": rel_err(ks[slots // bs, slots % bs], ws),
            "zero_rel_err": rel_err(kz[slots // bs, slots % bs], wz) if wz is not None else 0.0}
    # decode and prefill on quantized pools, ragged
    lens = [1, 17, 300, 1000, 4097] if not smoke else [1, 17, 40]
    for name, dt in QDTYPES.items():
        for block_size in (16, 128):
            kb, vb, tables = pool(len(lens), max(lens), block_size, device, seed=block_size)
            (kq, ks, kz), (vq, vs, vz) = quantized(kb, dt), quantized(vb, dt)
            params = quant_kwargs(ks, vs, kz, vz)
            seq_lens = torch.tensor(lens, device=device, dtype=torch.int32)
            q = torch.randn(len(lens), H, D, generator=g).to(device, DT)
            kd, vd = dequantize_block(kq, ks, kz), dequantize_block(vq, vs, vz)
            ref = reference(q, kd, vd, tables, seq_lens, scale)
            err = {f"decode_splits_{n}": rel_err(paged_decode_attention(q, kq, vq, tables, seq_lens, scale,
                                                                        num_splits=n, **params), ref)
                   for n in (1, 4)}
            # prefill: the last 5 tokens of each sequence as new rows (shorter ones whole)
            qlens = [min(5, s) for s in lens]
            starts = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0)), device=device, dtype=torch.int32)
            qp = torch.randn(sum(qlens), H, D, generator=g).to(device, DT)
            got = paged_prefill_attention(qp, kq, vq, tables, starts, seq_lens, scale, **params)
            refs = []
            for b, (s, ql) in enumerate(zip(lens, qlens)):
                for i in range(ql):
                    row = qp[int(starts[b]) + i][None]
                    refs.append(reference(row, kd, vd, tables[b:b + 1], torch.tensor([s - ql + i + 1]), scale)[0])
            err["prefill"] = rel_err(got, torch.stack(refs))
            out[f"attention_{name}_block{block_size}"] = err
    out["passed"] = all(v < TOL for key, e in out.items() if key.startswith("attention") for v in e.values()) and all(
        e["values_within_one_level"] == 1.0 and e["scale_rel_err"] < 1e-6 and e["zero_rel_err"] < 1e-6
        for key, e in out.items()
        if key.startswith("store"))
    return out


def decode_timing(device, clock, smoke) -> list[dict]:
    rows = []
    shapes = [(32, 4096), (8, 32768), (32, 32768)] if not smoke else [(2, 64)]
    scale = D**-0.5
    for B, L in shapes:
        kb, vb, tables = pool(B, L, 16, device, seed=B + L)
        seq_lens = torch.full((B,), L, device=device, dtype=torch.int32)
        q = torch.randn(B, H, D, device=device, dtype=DT)
        out = torch.empty_like(q)
        table_bytes = tables.numel() * tables.element_size()
        variants = {"bf16": (kb, vb, {})}
        for name, dt in QDTYPES.items():
            (kq, ks, kz), (vq, vs, vz) = quantized(kb, dt), quantized(vb, dt)
            variants[name] = (kq, vq, quant_kwargs(ks, vs, kz, vz))
        base = None
        for name, (k, v, params) in variants.items():
            def step(k=k, v=v, params=params):
                paged_decode_attention(q, k, v, tables, seq_lens, scale, max_seq_len=L, out=out, **params)
            us = kernel_time(clock, step)
            per_row = 4 * sum(params.get(key) is not None for key in ("k_scale", "k_zero"))  # scale (+ zero)
            kv_bytes = 2 * B * L * KVH * (D * k.element_size() + per_row)
            nbytes = kv_bytes + table_bytes + 2 * q.numel() * q.element_size()
            base = base or (us, nbytes)
            rows.append({"batch": B, "context": L, "kv_cache_dtype": name, "us": us, "bytes_read": nbytes,
                         "gb_per_s": nbytes / us / 1e3, "bytes_vs_bf16": nbytes / base[1],
                         "time_vs_bf16": us / base[0]})
            print(f"decode {B} x {L} {name}: {us:.1f} us, {nbytes / 2**20:.1f} MiB, {nbytes / us / 1e3:.0f} GB/s")
        del variants, kb, vb
        torch.cuda.empty_cache() if device.type == "cuda" else None
    return rows


def sweep(device, clock, smoke) -> list[dict]:
    """Decode launch settings per pool dtype: an 8-bit tile carries half the bytes of a bf16 one, so the
    best tile (positions per program iteration) and warp count may differ."""
    from minikv.kernels import decode_attention as dec

    rows = []
    shapes = [(32, 4096), (8, 32768), (32, 32768)] if not smoke else [(2, 64)]
    configs = [(bn, w, st) for bn in (32, 64, 128) for w in (1, 2, 4) for st in (2, 3)] if not smoke else [(32, 1, 2)]
    scale = D**-0.5
    for B, L in shapes:
        kb, vb, tables = pool(B, L, 16, device, seed=B + L)
        seq_lens = torch.full((B,), L, device=device, dtype=torch.int32)
        q = torch.randn(B, H, D, device=device, dtype=DT)
        out = torch.empty_like(q)
        variants = {"bf16": (kb, vb, {})}
        for name, dt in QDTYPES.items():
            (kq, ks, kz), (vq, vs, vz) = quantized(kb, dt), quantized(vb, dt)
            variants[name] = (kq, vq, quant_kwargs(ks, vs, kz, vz))
        splits = dec.default_num_splits(B, KVH, L, device)
        for name, (k, v, params) in variants.items():
            for bn, w, st in configs:
                def step(k=k, v=v, params=params, bn=bn, w=w, st=st):
                    paged_decode_attention(q, k, v, tables, seq_lens, scale, max_seq_len=L, out=out, num_splits=splits,
                                           block_n=bn, num_warps=w, num_stages=st, **params)
                rows.append({"batch": B, "context": L, "kv_cache_dtype": name, "block_n": bn, "num_warps": w,
                             "num_stages": st, "us": kernel_time(clock, step)})
            best = min((r for r in rows if (r["batch"], r["context"], r["kv_cache_dtype"]) == (B, L, name)),
                       key=lambda r: r["us"])
            print(f"sweep {B} x {L} {name}: best {best['us']:.1f} us at block_n {best['block_n']}, "
                  f"{best['num_warps']} warps, {best['num_stages']} stages")
        del variants, kb, vb
    return rows


def engine_throughput(device, smoke) -> dict:
    from minikv import LLM, SamplingParams
    from minikv.bench.throughput import QWEN25_05B_SHAPE, SMALL_SHAPE, make_random_checkpoint

    shape = SMALL_SHAPE if smoke else QWEN25_05B_SHAPE
    n, lo, hi = (8, 16, 48) if smoke else (128, 256, 1024)
    random.seed(0)
    requests = [([random.randint(0, 10000) for _ in range(random.randint(lo, hi))], random.randint(lo, hi))
                for _ in range(n)]
    memory = 2**20 * (2 if smoke else 384)  # the pool: far less than the workload's K/V
    tmp = Path(tempfile.mkdtemp())
    ckpt = make_random_checkpoint(shape, tmp / "ckpt")
    dtype = DT
    out = {"requests": n, "prompt_and_output_tokens": [lo, hi], "kv_cache_memory": memory,
           "output_tokens": sum(o for _, o in requests), "runs": {}}
    for kv in ("auto", "int8", "fp8"):
        llm = LLM(str(ckpt), device=device, dtype=dtype, kv_backend="paged", kv_cache_dtype=kv, kv_cache_memory=memory,
                  block_size=16, max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=8192)
        llm.generate([list(range(1, 65))], SamplingParams(max_tokens=8, ignore_eos=True))  # warm up
        seqs = [llm.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True)) for p, m in requests]
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0, steps, most = time.perf_counter(), 0, 0
        while llm.has_unfinished():
            llm.step()
            steps += 1
            most = max(most, len(llm.scheduler.running))
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        made = sum(len(s.output_token_ids) for s in seqs)
        st = llm.stats()
        out["runs"][st["kv_cache_dtype"]] = {
            "num_blocks": st["num_blocks"], "bytes_per_token": st["bytes_per_token"], "pool_tokens":
            st["num_blocks"] * st["block_size"], "seconds": dt, "output_tokens": made, "tokens_per_s": made / dt,
            "most_running": most, "steps": steps, "num_preemptions": st["num_preemptions"]}
        print(f"engine {st['kv_cache_dtype']}: {made / dt:,.0f} tok/s, {st['num_blocks']} blocks, "
              f"{most} running at most, {st['num_preemptions']} preemptions")
        del llm, seqs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", action="store_true", help="also time every decode launch setting per pool dtype")
    ap.add_argument("--no-engine", dest="engine", action="store_false", help="skip the engine throughput runs")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    record = {"benchmark": "kv_quant_gpu", "date": time.strftime("%Y-%m-%d"), **environment(device)}
    record["correctness"] = c = correctness(device, args.smoke)
    print(json.dumps(c, indent=1))
    if not c["passed"] and not args.smoke:
        raise SystemExit("correctness failed: no timings")
    clock = Clock(device, reps=5 if args.smoke else 50, warmup=1 if args.smoke else 5)
    record["copy_bandwidth_gb_per_s"] = copy_bandwidth(clock, 2**22 if args.smoke else 2**30)
    if args.sweep:
        record["sweep"] = sweep(device, clock, args.smoke)
    record["decode"] = decode_timing(device, clock, args.smoke)
    if args.engine:
        record["engine"] = engine_throughput(device, args.smoke)
    print(f"\n{record['device']}  torch {record['torch']}  triton {record['triton']}  copy "
          f"{record['copy_bandwidth_gb_per_s']:.0f} GB/s")
    print(f"{'decode':>16} {'dtype':>6} {'us':>8} {'MiB':>8} {'GB/s':>6} {'bytes/bf16':>10} {'time/bf16':>9}")
    for r in record["decode"]:
        print(f"{r['batch']:>6} x {r['context']:>7} {r['kv_cache_dtype']:>6} {r['us']:8.1f} "
              f"{r['bytes_read'] / 2**20:8.1f} {r['gb_per_s']:6.0f} {r['bytes_vs_bf16']:10.2f} "
              f"{r['time_vs_bf16']:9.2f}")
    for name, r in record.get("engine", {}).get("runs", {}).items():
        print(f"engine {name:>14}: {r['tokens_per_s']:8,.0f} tok/s  {r['num_blocks']:6} blocks  "
              f"{r['most_running']:4} running at most  {r['num_preemptions']:4} preemptions")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
