"""Decode attention on a GPU: does reading K/V through a block table cost anything?

For each (batch, context) and block size we time, in the same process on the same card:

    triton_paged      minikv.kernels.paged_decode_attention (K/V read in place from the pool, stored
                      as the engine's Triton backend stores it: head-major)
    triton_paged_token_major   the same kernel on a token-major pool (a token's KV heads side by side)
    sdpa_contiguous   torch SDPA on contiguous [B, kv_heads, L, head_dim] K/V (no paging at all)
    gather_sdpa       gather the pages into a contiguous copy, then SDPA (paging done in torch)
    torch_paged_ref   rung 4's reference: gather + masked SDPA with K/V repeated per query head
    flex_contiguous   FlexAttention (torch.compile) on contiguous K/V, when it compiles

Decode reads every K/V byte once, so the figure of merit is bandwidth: bytes of K/V read / time,
next to the card's measured copy bandwidth (bytes read + written / time of a 1 GiB copy).
Times are medians of CUDA-event timings after warmup, with L2 flushed before each run.
The prefill kernel is timed against the torch reference too. Everything is written to one JSON.

    python -m minikv.bench.decode_attention --out benchmarks/   [--smoke]

The kernel runs with its default launch settings. They are tuned at these shapes by a research
script beside the records, benchmarks/decode_tune.py.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import minikv.kernels  # noqa: F401, I001  (first: on a CPU it switches Triton to its interpreter)
from minikv.bench import environment, first_divergence

SHAPES = [(32, 4096), (64, 1024), (8, 16384)]  # (batch, context)
BLOCK_SIZES = [16, 128]
LONG_SHAPES = [(32, 32768)]  # 512 MiB of K/V, block size 16 only: where fixed costs no longer dominate
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 14, 2, 64  # Qwen2.5-0.5B's attention shape
PREFILL_CASES = [  # (name, batch, new tokens, context after the step)
    ("prompts", 4, 2048, 2048),
    ("chunk_after_cache", 4, 512, 4096),
]
TOL = 1e-2  # |kernel - fp32 reference| / |reference| (L2 norms) on bf16 inputs: bf16 rounding is ~4e-3


class Clock:
    """Median time in microseconds of fn(): CUDA events on a GPU, L2 flushed before each run.

    The flush reads (never writes) a buffer larger than L2, so L2 holds only clean lines when the
    timed run starts. Flushing by writing (zeroing the buffer, as is common) leaves L2 full of dirty
    lines that the timed kernel then pays to write back: a memory-bound kernel is charged for up to
    an L2's worth of writes it never made (flush="zero" keeps that behaviour, for comparison).
    """

    def __init__(self, device: torch.device, reps: int, warmup: int, flush: str = "read"):
        if flush not in ("read", "zero"):
            raise ValueError(f"flush must be 'read' or 'zero', not {flush!r}")
        self.device, self.reps, self.warmup, self.flush_mode = device, reps, warmup, flush
        self.flush = torch.ones(256 * 2**20, dtype=torch.int8, device=device) if device.type == "cuda" else None

    def flush_l2(self) -> None:
        if self.flush_mode == "zero":
            self.flush.zero_()
        else:
            self.flush.view(torch.int64).max()  # reads 256 MiB, writes 8 bytes

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        if self.device.type == "cuda":  # keep the card busy ~30 ms so its clocks are up after an idle spell
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 0.03:
                fn()
                torch.cuda.synchronize()
        if self.device.type != "cuda":
            times = []
            for _ in range(self.reps):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            return statistics.median(times)
        torch.cuda.synchronize()
        events = []
        for _ in range(self.reps):
            self.flush_l2()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events) * 1e3


def kernel_time(clock: Clock, fn) -> float:
    """Median GPU time of fn replayed from a CUDA graph (no Python launch cost); eager on a CPU."""
    if clock.device.type != "cuda":
        return clock(fn)
    fn()  # compile / warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return clock(graph.replay)


def copy_bandwidth(clock: Clock, nbytes: int = 2**30) -> float:
    """GB/s of a device-to-device copy, counting bytes read + bytes written."""
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=clock.device)
    y = torch.empty_like(x)
    us = clock(lambda: y.copy_(x))
    return 2 * nbytes / us / 1e3


def paged_pool(B, L, block_size, dtype, device, seed=0, kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, kv_layout="nhd"):
    """B sequences of context L scattered over a shuffled pool (a few spare blocks), indexed
    [block, slot, kv_head, dim] and stored in kv_layout's order (the same values either way)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    per_seq = math.ceil(L / block_size)
    num_blocks = B * per_seq + 8
    tables = torch.randperm(num_blocks, generator=g)[: B * per_seq].view(B, per_seq).to(device)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    caches = []
    for _ in range(2):
        x = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
        caches.append(stored_head_major(x) if kv_layout == "hnd" else x)
    return caches[0], caches[1], tables


def stored_head_major(cache):
    """The same [blocks, block_size, kv_heads, D] values, stored [blocks, kv_heads, block_size, D]."""
    return cache.transpose(1, 2).contiguous().transpose(1, 2)


def contiguous_kv(cache, tables, L):
    """[B, kv_heads, L, head_dim]: the pages of each sequence laid end to end."""
    B = tables.shape[0]
    return cache[tables].reshape(B, -1, *cache.shape[2:])[:, :L].transpose(1, 2)


def fp32_decode_reference(q, k, v, scale):
    """q [B, H, D]; k, v [B, kv_heads, L, D] -> [B, H, D] in float32 (plain matmuls, no TF32)."""
    B, H, D = q.shape
    kvh = k.shape[1]
    qf = q.float().view(B, kvh, H // kvh, D)
    p = (torch.einsum("bhgd,bhld->bhgl", qf, k.float()) * scale).softmax(-1)
    return torch.einsum("bhgl,bhld->bhgd", p, v.float()).reshape(B, H, D)


def rel_err(a, b) -> float:
    """|a - b| / |b| in L2 norm; NaN (an unwritten element) gives inf."""
    d = (a.float() - b.float()).norm().item()
    return d / b.float().norm().item() if math.isfinite(d) else float("inf")


def engine_kv_layout() -> str:
    """The pool's storage order in the engine with attention="triton" (its configuration's default)."""
    from minikv.engine.config import EngineConfig

    return EngineConfig.from_options(model="tiny-random", device="cpu", kv_backend="paged",
                                     attention="triton").kv_layout


def decode_case(B, L, block_size, dtype, device, heads, kv_layout=None):
    """Inputs of one decode workload: a shuffled pool (stored as the engine's Triton backend stores it,
    unless kv_layout says otherwise), its block tables."""
    Hq, Hkv, D = heads
    k_cache, v_cache, tables = paged_pool(B, L, block_size, dtype, device, seed=B + L + block_size,
                                          kv_heads=Hkv, head_dim=D, kv_layout=kv_layout or engine_kv_layout())
    q = torch.randn(B, Hq, D, device=device).to(dtype)
    return {"B": B, "L": L, "block_size": block_size, "heads": heads, "q": q, "k_cache": k_cache,
            "v_cache": v_cache, "tables": tables, "seq_lens": torch.full((B,), L, dtype=torch.long, device=device),
            "scale": D**-0.5, "kv_bytes": 2 * B * L * Hkv * D * k_cache.element_size()}


def triton_decode(c, **kw):
    from minikv.kernels import paged_decode_attention

    return lambda: paged_decode_attention(c["q"], c["k_cache"], c["v_cache"], c["tables"], c["seq_lens"], c["scale"],
                                          max_seq_len=c["L"], **kw)


def bench_decode(c, device, clock, flex):
    from minikv.attention.common import attend
    from minikv.attention.metadata import AttentionMetadata
    from minikv.kernels import default_num_splits, paged_decode_attention

    B, L, block_size = c["B"], c["L"], c["block_size"]
    Hq, Hkv, D = c["heads"]
    q, k_cache, v_cache, tables, scale = c["q"], c["k_cache"], c["v_cache"], c["tables"], c["scale"]
    q4 = q[:, :, None, :]  # [B, H, 1, D]
    kc, vc = contiguous_kv(k_cache, tables, L).contiguous(), contiguous_kv(v_cache, tables, L).contiguous()
    kx, vx = kc.repeat_interleave(Hq // Hkv, dim=1), vc.repeat_interleave(Hq // Hkv, dim=1)
    meta = AttentionMetadata.build([1] * B, [L] * B, device)
    kv_bytes = c["kv_bytes"]
    k_nhd, v_nhd = k_cache.contiguous(), v_cache.contiguous()  # token-major copies (no copy if already so)
    methods = {
        "triton_paged": triton_decode(c),  # the pool stored as the engine's Triton backend stores it
        "triton_paged_token_major": lambda: paged_decode_attention(q, k_nhd, v_nhd, tables, c["seq_lens"], scale,
                                                                   max_seq_len=L),
        "sdpa_contiguous": lambda: F.scaled_dot_product_attention(q4, kc, vc, scale=scale, enable_gqa=True),
        # K/V repeated per query head beforehand (not timed): reads 7x the bytes, but always takes a fused kernel
        "sdpa_expanded": lambda: F.scaled_dot_product_attention(q4, kx, vx, scale=scale),
        "gather_sdpa": lambda: F.scaled_dot_product_attention(
            q4, contiguous_kv(k_cache, tables, L), contiguous_kv(v_cache, tables, L), scale=scale, enable_gqa=True),
        "torch_paged_ref": lambda: attend(q, contiguous_kv(k_cache, tables, L).transpose(1, 2),
                                          contiguous_kv(v_cache, tables, L).transpose(1, 2), meta, scale),
    }
    if flex is not None:
        methods["flex_contiguous"] = lambda: flex(q4, kc, vc, scale=scale, enable_gqa=True)
    row = {"batch": B, "context": L, "block_size": block_size, "num_heads": Hq, "num_kv_heads": Hkv,
           "head_dim": D, "dtype": str(q.dtype).replace("torch.", ""), "kv_bytes": kv_bytes,
           "num_splits": default_num_splits(B, Hkv, L, q.device), "bandwidth_GBps": {}}
    return measure(row, methods, fp32_decode_reference(q, kc, vc, scale), clock, kv_bytes)


def measure(row: dict, methods: dict, ref, clock: Clock, kv_bytes: int | None = None) -> dict:
    """Each method's error against ref, its eager time and its CUDA-graph time (the eager one where
    capture fails: errors says so), into row; a method that does not run on this stack is reported."""
    row.update(time_us={}, eager_time_us={}, rel_err_vs_fp32={}, errors={})
    for name, fn in methods.items():
        try:
            row["rel_err_vs_fp32"][name] = rel_err(fn().reshape(ref.shape), ref)
            row["eager_time_us"][name] = round(clock(fn), 2)
        except Exception as e:
            row["errors"][name] = f"{type(e).__name__}: {str(e)[:300]}"
            continue
        try:
            us = kernel_time(clock, fn)
        except Exception as e:
            row["errors"][name + " (graph)"] = f"{type(e).__name__}: {str(e)[:300]}"
            us = row["eager_time_us"][name]
        row["time_us"][name] = round(us, 2)
        if kv_bytes:
            row["bandwidth_GBps"][name] = round(kv_bytes / us / 1e3, 1)
    row["ok"] = row["rel_err_vs_fp32"].get("triton_paged", float("inf")) <= TOL
    return row


def bench_prefill(name, B, qlen, L, block_size, dtype, device, clock, heads):
    from minikv.attention.common import attend
    from minikv.attention.metadata import AttentionMetadata
    from minikv.kernels import paged_prefill_attention

    Hq, Hkv, D = heads
    scale = D**-0.5
    k_cache, v_cache, tables = paged_pool(B, L, block_size, dtype, device, seed=7, kv_heads=Hkv, head_dim=D,
                                          kv_layout=engine_kv_layout())
    meta = AttentionMetadata.build([qlen] * B, [L] * B, device)
    q = torch.randn(B * qlen, Hq, D, device=device).to(dtype)

    def triton_fn(**kw):
        return paged_prefill_attention(q, k_cache, v_cache, tables, meta.query_start_loc, meta.seq_lens, scale,
                                       **kw)

    def torch_ref(kc=k_cache, vc=v_cache, qq=q):
        keys, values = contiguous_kv(kc, tables, L).transpose(1, 2), contiguous_kv(vc, tables, L).transpose(1, 2)
        return attend(qq, keys, values, meta, scale)

    row = {"case": name, "batch": B, "new_tokens": qlen, "context": L, "block_size": block_size,
           "dtype": str(dtype).replace("torch.", "")}
    methods = {"triton_paged": triton_fn, "torch_paged_ref": torch_ref}
    if qlen == L:  # whole prompts: flash attention on contiguous K/V is the ideal to compare with
        qc = q.view(B, L, Hq, D).transpose(1, 2)
        kc, vc = contiguous_kv(k_cache, tables, L).contiguous(), contiguous_kv(v_cache, tables, L).contiguous()
        methods["sdpa_causal_contiguous"] = lambda: F.scaled_dot_product_attention(
            qc, kc, vc, is_causal=True, scale=scale, enable_gqa=True).transpose(1, 2).reshape(B * L, Hq, D)
    return measure(row, methods, torch_ref(k_cache.float(), v_cache.float(), q.float()), clock)


def ragged_correctness(device, dtypes, smoke=False) -> list[dict]:
    """Ragged batches (lengths 1, exact block multiples, odd), shuffled pools, GQA 1/3/7/8, 1 and several
    splits, a sliding window, outputs poisoned with NaN: decode and prefill vs a float64 reference."""
    from minikv.attention.common import attend
    from minikv.attention.metadata import AttentionMetadata
    from minikv.kernels import paged_decode_attention, paged_prefill_attention

    rows = []
    g = torch.Generator().manual_seed(1)
    cases = [(16, 1, 64), (16, 3, 64), (128, 7, 64), (16, 8, 128), (32, 7, 80)] if not smoke else [(8, 3, 16)]
    for i, dtype in enumerate(dtypes):
        for block_size, group, head_dim in cases if i == 0 else cases[1:3]:  # all cases in the first dtype
            lens = [1, block_size, 3 * block_size, 2 * block_size + 5, 1000, 4099] if not smoke else [1, 8, 21]
            qlens = [1, 1, 2 * block_size, 7, 300, 1] if not smoke else [1, 3, 10]
            B, Hkv = len(lens), 2
            per = [math.ceil(n / block_size) for n in lens]
            k_cache = torch.randn(sum(per) + 3, block_size, Hkv, head_dim, generator=g).to(device, dtype)
            v_cache = torch.randn_like(k_cache)
            order = torch.randperm(sum(per) + 3, generator=g)[:sum(per)]  # each sequence's blocks, -1 past its end
            tables = torch.nn.utils.rnn.pad_sequence(order.split(per), batch_first=True, padding_value=-1).to(device)
            scale = head_dim**-0.5
            L = max(lens)
            keys, values = (x[tables.clamp(min=0)].reshape(B, -1, Hkv, head_dim)[:, :L].double()
                            for x in (k_cache, v_cache))
            for window, layout in ((None, "nhd"), (300, "nhd"), (None, "hnd"), (300, "hnd")):
                kc, vc = (stored_head_major(x) if layout == "hnd" else x for x in (k_cache, v_cache))
                case = {"dtype": str(dtype).replace("torch.", ""), "block_size": block_size, "group": group,
                        "head_dim": head_dim, "window": window, "kv_layout": layout}
                meta = AttentionMetadata.build([1] * B, lens, device)
                q = torch.randn(B, Hkv * group, head_dim, generator=g).to(device, dtype)
                ref = attend(q.double(), keys, values, meta, scale, window)
                for splits in (1, 3, None):
                    out = torch.full_like(q, float("nan"))
                    paged_decode_attention(q, kc, vc, tables, meta.seq_lens, scale, num_splits=splits,
                                           sliding_window=window, out=out)
                    rows.append({"kernel": "decode", **case, "num_splits": splits, "rel_err": rel_err(out, ref)})
                meta = AttentionMetadata.build(qlens, lens, device)
                q = torch.randn(sum(qlens), Hkv * group, head_dim, generator=g).to(device, dtype)
                ref = attend(q.double(), keys, values, meta, scale, window)
                out = torch.full_like(q, float("nan"))
                paged_prefill_attention(q, kc, vc, tables, meta.query_start_loc, meta.seq_lens, scale,
                                        sliding_window=window, out=out)
                rows.append({"kernel": "prefill", **case, "rel_err": rel_err(out, ref)})
    for r in rows:
        r["ok"] = r["rel_err"] <= (1e-5 if r["dtype"] == "float32" else TOL)
    return rows


def engine_check(device, smoke: bool = False) -> dict:
    """Greedy tokens of tiny-random through the whole engine: Triton attention vs torch attention."""
    from minikv.engine.llm import LLM
    from minikv.engine.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(0)
    lengths = (5, 1, 30) if smoke else (5, 90, 1, 300, 33, 700)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in lengths]
    params = SamplingParams(max_tokens=4 if smoke else 24, ignore_eos=True)
    result = {}
    for dtype in ("float32",) if smoke else ("float32", "bfloat16"):
        outs = {}
        for attention in ("torch", "triton"):
            llm = LLM("tiny-random", device=str(device), dtype=dtype, kv_backend="paged", attention=attention,
                      block_size=16, num_blocks=512, max_num_batched_tokens=256)
            outs[attention] = [o.token_ids for o in llm.generate(prompts, params)]
        pairs = list(zip(outs["torch"], outs["triton"]))
        result[dtype] = {"tokens_equal": sum(a == b for x, y in pairs for a, b in zip(x, y)),
                         "tokens": sum(len(x) for x, _ in pairs), "sequences_identical": sum(x == y for x, y in pairs),
                         "sequences": len(prompts), "first_differing_token": [first_divergence(x, y) for x, y in pairs]}
    return result


def print_tables(record: dict) -> None:
    print(f"\n{record['env']['device']}  torch {record['env']['torch']}  triton {record['env']['triton']}")
    print(f"copy bandwidth (read + write): {record['copy_bandwidth_GBps']:.0f} GB/s")
    cols = ["triton_paged", "triton_paged_token_major", "sdpa_contiguous", "sdpa_expanded", "gather_sdpa",
            "torch_paged_ref", "flex_contiguous"]
    print("\ndecode, CUDA-graph time us / K+V bandwidth GB/s  (triton eager = launched from Python)")
    print(f"{'batch':>5} {'ctx':>6} {'bs':>4} {'splits':>6} " + " ".join(f"{c:>17}" for c in cols)
          + f" {'triton eager':>12}  rel err")
    for r in record["decode"]:
        cells = []
        for c in cols:
            t = r["time_us"].get(c)
            cells.append(f"{t:7.1f} /{r['bandwidth_GBps'][c]:6.0f}" if t else f"{'-':>15}")
        err = r["rel_err_vs_fp32"].get("triton_paged", float("nan"))
        eager = r["eager_time_us"].get("triton_paged", float("nan"))
        share = r["bandwidth_GBps"].get("triton_paged", float("nan")) / record["copy_bandwidth_GBps"]
        print(f"{r['batch']:>5} {r['context']:>6} {r['block_size']:>4} {r['num_splits']:>6} " + " ".join(
            f"{c:>17}" for c in cells) + f" {eager:>12.1f}  {err:.1e} {'ok' if r['ok'] else 'FAIL'}"
            f"  triton at {share:.0%} of copy bandwidth")
    print("\nprefill, CUDA-graph time us")
    for r in record["prefill"]:
        ts = "  ".join(f"{k} {v:.0f}" for k, v in r["time_us"].items())
        err = r["rel_err_vs_fp32"].get("triton_paged", float("nan"))
        print(f"{r['case']:>18} B={r['batch']} new={r['new_tokens']} ctx={r['context']}: {ts}  rel err {err:.1e}")
    if record.get("engine_check"):
        print("\nengine greedy tokens, triton vs torch attention:", record["engine_check"])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for decode_attention_gpu.json")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--budget-s", type=float, default=400, help="skip optional parts past this many seconds")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on any device (checks the script itself)")
    args = ap.parse_args(argv)
    t_start = time.time()
    deadline = t_start + args.budget_s
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        raise SystemExit("this benchmark needs a CUDA GPU; use --smoke to try the script on a CPU")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes, block_sizes, heads = SHAPES, BLOCK_SIZES, (NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)
    prefill_cases, prefill_bs = PREFILL_CASES, 16
    clock = Clock(device, reps=50, warmup=10)
    if args.smoke:
        shapes, block_sizes, heads = [(2, 40), (3, 17)], [8, 16], (6, 2, 16)
        prefill_cases = [("prompts", 2, 20, 20), ("chunk_after_cache", 2, 5, 33)]
        clock = Clock(device, reps=2, warmup=1)
    long_cases = [] if args.smoke else [(B, L, block_sizes[0]) for B, L in LONG_SHAPES]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "decode_attention_gpu.json"
    record = {"env": {**environment(device), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}, "workload": {
        "decode_shapes": shapes, "block_sizes": block_sizes, "long_shapes": [list(x) for x in long_cases],
        "num_heads": heads[0], "num_kv_heads": heads[1], "head_dim": heads[2],
        "dtype": str(dtype).replace("torch.", ""),
        "kv_layout": engine_kv_layout(),
        "timing": f"time_us: median of {clock.reps} CUDA-event timings of a CUDA graph replaying one call (GPU "
                  f"time, no Python launch cost) after {clock.warmup} warmups and 30 ms of back-to-back runs "
                  "(clocks up), L2 flushed by reading a 256 MiB buffer before each (a flush that writes leaves "
                  "dirty lines the timed kernel pays to write back); eager_time_us: the same call launched from "
                  "Python (includes launch overhead when it exceeds the GPU time)"},
        "decode": [], "prefill": []}

    def save():
        record["elapsed_s"] = round(time.time() - t_start, 1)
        path.write_text(json.dumps(record, indent=1))

    record["copy_bandwidth_GBps"] = round(copy_bandwidth(clock, 2**30 if not args.smoke else 2**20), 1)
    save()
    flex = None
    if not args.no_flex and device.type == "cuda":
        try:
            from torch.nn.attention.flex_attention import flex_attention
            flex = torch.compile(flex_attention, dynamic=False)
        except Exception as e:
            record["flex_error"] = f"{type(e).__name__}: {e}"

    def run_decode(c, flex):
        record["decode"].append(bench_decode(c, device, clock, flex))
        save()
        print(f"decode B={c['B']} L={c['L']} bs={c['block_size']}: {record['decode'][-1]['time_us']}", flush=True)

    cases = [decode_case(B, L, bs, dtype, device, heads) for B, L in shapes for bs in block_sizes]
    for c in cases:
        run_decode(c, flex if c["block_size"] == block_sizes[0] and time.time() < deadline - 60 else None)
    cases = c = None  # the pools are freed before the long ones are made
    for B, L, bs in long_cases:  # 512 MiB pools and their contiguous copies, one at a time
        run_decode(decode_case(B, L, bs, dtype, device, heads), None)
        torch.cuda.empty_cache()
    for name, B, qlen, L in prefill_cases:
        record["prefill"].append(bench_prefill(name, B, qlen, L, prefill_bs, dtype, device, clock, heads))
        save()
    try:
        dtypes = [torch.float32] if args.smoke else [torch.bfloat16, torch.float16, torch.float32]
        record["ragged_correctness"] = ragged_correctness(device, dtypes, args.smoke)
        bad = [r for r in record["ragged_correctness"] if not r["ok"]]
        print(f"ragged correctness: {len(record['ragged_correctness']) - len(bad)} ok, {len(bad)} failed {bad[:3]}")
    except Exception as e:
        record["ragged_correctness"] = [{"error": f"{type(e).__name__}: {str(e)[:300]}"}]
        print("ragged correctness error:", record["ragged_correctness"], flush=True)
    save()
    try:
        record["engine_check"] = engine_check(device, args.smoke)
    except Exception as e:
        record["engine_check"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    save()
    print_tables(record)
    print(f"\nwrote {path} ({record['elapsed_s']} s)")
    return record


if __name__ == "__main__":
    main()
