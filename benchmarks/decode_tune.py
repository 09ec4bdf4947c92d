"""Tune the paged decode kernel's launch settings on a GPU, at the decode benchmark's shapes.

The cases are minikv/bench/decode_attention.py's decode workloads (each (batch, context) at block
sizes 16 and 128, Qwen2.5-0.5B's heads, bf16, the pool stored as the engine stores it). A setting's
score is the kernel's CUDA-graph time summed over all cases; each setting is first checked against
a float32 reference on every case (a wrong one is never chosen). In this order:

    programs per SM   the split heuristic's target (default_num_splits)
    launch settings   positions per tile (block_n) x warps x pipeline stages, at the chosen target
    programs per SM   again, with the chosen launch settings (the two interact)

The code's defaults stay unless something beats them by more than NOISE: two runs of one setting
differ by ~1% (benchmarks/NOTES_decode.md, run 11). The kernel module is left as it was: to adopt a
choice, make it the default in minikv/kernels/decode_attention.py (PROGRAMS_PER_SM, DECODE_CONFIG) and run
the benchmark again. Writes decode_tune_gpu.json (records before this script existed keep the same
log under "tuning" in decode_attention_gpu*.json).

    python benchmarks/decode_tune.py --out benchmarks/ [--smoke]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

if __name__ == "__main__":  # run as a script: minikv from this checkout, installed or not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import minikv.kernels  # noqa: E402, F401, I001  (first: on a CPU it switches Triton to its interpreter)
import minikv.kernels.decode_attention as dec  # noqa: E402
from minikv.bench import environment  # noqa: E402
from minikv.bench.decode_attention import (BLOCK_SIZES, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, SHAPES, TOL,  # noqa: E402
                                           Clock, contiguous_kv, decode_case, engine_kv_layout,
                                           fp32_decode_reference, kernel_time, rel_err, triton_decode)

NOISE = 0.02  # a setting replaces the default only if it is this much faster: closer is run-to-run noise
PROGRAMS_PER_SM = (2, 3, 4, 6, 8, 16)
PROGRAMS_PER_SM_AGAIN = (2, 3, 4, 6, 8)
TILES = ((32, 1), (32, 2), (64, 1), (64, 2), (64, 4), (128, 2), (128, 4), (256, 4), (256, 8))  # (block_n, warps)
LAUNCH = [{"block_n": n, "num_warps": w, "num_stages": s} for s in (2, 3, 4) for n, w in TILES
          if not (s == 4 and n > 64)]  # deep stages of big tiles: no room in shared memory
SETTINGS = ("block_n", "num_warps", "num_stages")


def keep_default(times: dict, default):
    """The key of the fastest time, unless the default's is within NOISE of it (then the default)."""
    best = min(times, key=times.get)
    return default if default in times and times[best] > (1 - NOISE) * times[default] else best


def tune_decode(cases, clock, deadline, programs_per_sm=PROGRAMS_PER_SM, again=PROGRAMS_PER_SM_AGAIN,
                launch=LAUNCH) -> dict:
    """Pick the split heuristic (programs per SM) and the launch settings that minimise the summed
    kernel time over all decode cases. The kernel module's settings are restored before returning."""
    start = {"programs_per_sm": dec.PROGRAMS_PER_SM, **dec.DECODE_CONFIG}
    log = {"configs": [], "start": start}
    refs = [fp32_decode_reference(c["q"], contiguous_kv(c["k_cache"], c["tables"], c["L"]),
                                  contiguous_kv(c["v_cache"], c["tables"], c["L"]), c["scale"]) for c in cases]

    def total(**kw):
        t, worst = 0.0, 0.0
        for c, ref in zip(cases, refs):
            fn = triton_decode(c, **kw)
            worst = max(worst, rel_err(fn(), ref))
            if worst > TOL:
                raise ValueError(f"rel err {worst:.1e} > {TOL} at B={c['B']} L={c['L']} bs={c['block_size']}")
            t += kernel_time(clock, fn)
        return round(t, 2)

    def sweep_programs_per_sm(key, values):
        log[key] = {}
        for p in values:
            if time.time() > deadline:
                break
            dec.PROGRAMS_PER_SM = p
            log[key][p] = total()
            print(f"programs per SM {p}: {log[key][p]} us", flush=True)
        return log[key]

    try:
        best_pps = keep_default(sweep_programs_per_sm("programs_per_sm", programs_per_sm), start["programs_per_sm"])
        dec.PROGRAMS_PER_SM = best_pps
        for kw in launch:
            if time.time() > deadline:
                break
            try:
                log["configs"].append({**kw, "total_us": total(**kw)})
            except Exception as e:
                log["configs"].append({**kw, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            print(log["configs"][-1], flush=True)
        timed = {tuple(x[k] for k in SETTINGS): x["total_us"] for x in log["configs"] if "total_us" in x}
        if timed:
            dec.DECODE_CONFIG.update(zip(SETTINGS, keep_default(timed, tuple(start[k] for k in SETTINGS))))
        times = sweep_programs_per_sm("programs_per_sm_again", again)
        dec.PROGRAMS_PER_SM = keep_default(times, best_pps) if best_pps in times else best_pps
        log["chosen"] = {"programs_per_sm": dec.PROGRAMS_PER_SM, **dec.DECODE_CONFIG}
    finally:
        dec.PROGRAMS_PER_SM = start["programs_per_sm"]
        dec.DECODE_CONFIG.update((k, start[k]) for k in SETTINGS)
    log["rule"] = f"the fastest, unless the default is within {NOISE:.0%} of it (then the default)"
    return log


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for decode_tune_gpu.json")
    ap.add_argument("--budget-s", type=float, default=240, help="stop trying settings past this many seconds")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and grid on any device (checks the script)")
    args = ap.parse_args(argv)
    t0 = time.time()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        raise SystemExit("this script needs a CUDA GPU; use --smoke to try it on a CPU")
    dtype, shapes, block_sizes, heads = torch.bfloat16, SHAPES, BLOCK_SIZES, (NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)
    clock, grid = Clock(device, reps=50, warmup=10), {}
    if args.smoke:
        shapes, block_sizes, heads, clock = [(2, 40), (3, 17)], [16], (6, 2, 16), Clock(device, 1, 0)
        dtype = torch.float32 if device.type != "cuda" else dtype
        grid = {"programs_per_sm": (2, 4), "again": (4,), "launch": [dict(dec.DECODE_CONFIG), LAUNCH[0]]}
    cases = [decode_case(B, L, bs, dtype, device, heads) for B, L in shapes for bs in block_sizes]
    record = {"env": {**environment(device), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")},
              "workload": {"decode_shapes": shapes, "block_sizes": block_sizes, "num_heads": heads[0],
                           "num_kv_heads": heads[1], "head_dim": heads[2], "dtype": str(dtype).replace("torch.", ""),
                           "kv_layout": engine_kv_layout(), "timing": f"total_us: CUDA-graph times summed over "
                           f"the cases, each the median of {clock.reps} CUDA-event timings after {clock.warmup} "
                           "warmups, L2 flushed by reading"},
              "tuning": tune_decode(cases, clock, t0 + args.budget_s, **grid)}
    record["elapsed_s"] = round(time.time() - t0, 1)
    out_path = Path(args.out) / "decode_tune_gpu.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(record, indent=1))

    tuning = record["tuning"]
    print(f"\n{record['env']['device']}: summed CUDA-graph time over {len(cases)} cases, us")
    for key in ("programs_per_sm", "programs_per_sm_again"):
        print(f"{key:>22}: " + "  ".join(f"{p}: {t}" for p, t in tuning[key].items()))
    for c in sorted(tuning["configs"], key=lambda c: c.get("total_us", float("inf"))):
        print(f"{'':>22}  block_n {c['block_n']:>3}, {c['num_warps']} warps, {c['num_stages']} stages: "
              + (f"{c['total_us']}" if "total_us" in c else c["error"]))
    print(f"start  {tuning['start']}\nchosen {tuning['chosen']}  ({tuning['rule']})")
    print(f"wrote {out_path} ({record['elapsed_s']} s)")
    return record


if __name__ == "__main__":
    main()
