"""Which 8-bit KV format? Candidate quantization schemes measured in torch before any kernel is written.

    PYTHONPATH=. python benchmarks/kv_quant_schemes.py            the recorded run (about 20 minutes)
    PYTHONPATH=. python benchmarks/kv_quant_schemes.py --quick --no-record     a smoke run

Each scheme is simulated on a float32 pool: the store rounds K and V to the scheme's grid and keeps
the de-quantized values (q * scale [+ zero]), which a float32 pool holds exactly. Attention then
reads what an 8-bit pool of that format would give back, so the quality measured is the format's,
with no kernel involved. Same measures as benchmarks/kv_quant_quality.py, against the float32 pool:

  greedy      12 fixed prompts x 32 greedy tokens: tokens before the first difference / max_tokens
  teacher     Pride and Prejudice ch. 1 fed whole: KL(full || scheme) mean and max, max |logit diff|
  bytes       per token over all layers, K and V, payload + scales (+ zero points)

Schemes (x [..., head_dim] one token's row of one KV head; a group = `group` consecutive channels):

  token          one scale per (token, KV head): absmax / qmax                     (the first engine)
  token-g32/16   one scale per (token, KV head, group of 32 / 16 channels)
  ...-fp16       the same with float16 scales (half the scale bytes)
  asym-...       min/max per group: scale = (max - min) / range, plus a zero point (the group's middle),
                 both float32
  block-channel  keys: one scale per (block, KV head, channel) over the block's block_size tokens;
                 values per token. Measured under teacher forcing only: the text is stored in one
                 step from slot 0, so every block is whole when its scale is taken. A pool filled one
                 token at a time cannot do this without re-quantizing the block at every new token,
                 or keeping the partial block in full precision (KIVI's residual)
  float16        a 16-bit pool (no scales): what rounding to 16 bits alone costs
"""
from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch

from minikv import SamplingParams
from minikv.bench import REPO, environment, first_divergence
from minikv.cache.blocks.quant import QMAX

from kv_quant_quality import BLOCK_SIZE, PROMPTS, TEXT, all_logits, teacher_forcing  # noqa: E402

FP8 = torch.float8_e4m3fn


def round_to(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """y (already divided by its scale) on dtype's grid, as float32: int8 rounds half up, fp8 to nearest even."""
    if dtype == torch.int8:
        return torch.floor(y + 0.5)
    return y.to(dtype).float()


def fake_quant(x: torch.Tensor, dtype: torch.dtype, group: int, asym: bool, scale_dtype: torch.dtype) -> torch.Tensor:
    """x [..., head_dim] -> what a pool of `dtype` with this scheme gives back (float32)."""
    *lead, D = x.shape
    g = x.float().reshape(*lead, D // group, group)
    qmax = QMAX[dtype]
    if asym:  # the group's middle as zero point, half its range onto [-qmax, qmax]
        hi, lo = g.amax(-1, keepdim=True), g.amin(-1, keepdim=True)
        zero = ((hi + lo) / 2).to(scale_dtype).float()
        scale = ((hi - lo) / 2 / qmax).to(scale_dtype).float()
        # an int8 grid of 255 steps spans max - min: use -127..127 around the middle (one code unused)
    else:
        zero = torch.zeros_like(g[..., :1])
        scale = (g.abs().amax(-1, keepdim=True) / qmax).to(scale_dtype).float()
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = round_to(((g - zero) * inv).clamp(-qmax, qmax), dtype).clamp(-qmax, qmax)
    return (q * scale + zero).reshape(x.shape)


def block_channel_keys(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Keys [T, H, D] stored from slot 0: one scale per (block, KV head, channel) over the block's rows."""
    T, H, D = x.shape
    pad = -T % BLOCK_SIZE
    xp = torch.nn.functional.pad(x.float(), (0, 0, 0, 0, 0, pad)).view(-1, BLOCK_SIZE, H, D)
    scale = xp.abs().amax(dim=1, keepdim=True) / QMAX[dtype]
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = round_to((xp * inv).clamp(-QMAX[dtype], QMAX[dtype]), dtype)
    return (q * scale).reshape(-1, H, D)[:T]


def schemes(head_dim: int) -> dict:
    """name -> (quantize K, quantize V, bytes per KV-head row of K or V per token, teacher forcing only)."""
    out = {}
    for group in (head_dim, 32, 16):
        for asym in (False, True):
            for sdt in (torch.float32,) if asym else (torch.float32, torch.float16):
                name = ("asym-" if asym else "") + ("token" if group == head_dim else f"token-g{group}") + (
                    "-fp16" if sdt == torch.float16 else "")
                nbytes = head_dim + (head_dim // group) * (2 if asym else 1) * (4 if sdt == torch.float32 else 2)
                fq = (lambda g, a, s: lambda x, dt: fake_quant(x, dt, g, a, s))(group, asym, sdt)
                out[name] = (fq, fq, nbytes, False)
    tok = out["token"][0]
    out["block-channel"] = (block_channel_keys, tok, head_dim + 4, True)  # K: D*4/block_size bytes, V: 4 (about)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--quick", action="store_true", help="2 prompts, 8 tokens, 64 text tokens, 3 schemes")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "kv_quant_schemes_cpu.json"))
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    from minikv import LLM
    torch.manual_seed(0)
    prompts, max_tokens = (PROMPTS[:2], 8) if args.quick else (PROMPTS, 32)
    t0 = time.perf_counter()
    llm = LLM(args.model, device="cpu", kv_backend="paged", block_size=BLOCK_SIZE, num_blocks=256, max_num_seqs=16)
    pool = llm.backend.pool
    store = pool.store
    ids = llm.tokenizer.encode(TEXT.read_text())[: 64 if args.quick else None]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(prompts, params)]
    logits_full = all_logits(llm, ids)
    L, H, D = pool.num_layers, pool.num_kv_heads, pool.head_dim

    def measure(quant_k, quant_v, teacher_only: bool) -> dict:
        pool.store = lambda layer, k, v, slots: store(layer, quant_k(k), quant_v(v), slots)
        try:
            out = {"teacher_forcing": teacher_forcing(logits_full, all_logits(llm, ids), ids)}
            if not teacher_only:
                got = [o.token_ids for o in llm.generate(prompts, params)]
                before = [max_tokens if f is None else f for f in map(first_divergence, got, want)]
                out["greedy"] = {"tokens_before_first_difference": before,
                                 "agreement": sum(before) / (len(prompts) * max_tokens)}
        finally:
            pool.store = store
        return out

    results = {}
    half = lambda x: x.half().float()  # noqa: E731
    results["float16"] = {"bytes_per_token": 2 * L * H * D * 2, **measure(half, half, False)}
    print(f"float16 pool: {json.dumps(results['float16'])}", flush=True)
    table = schemes(D)
    names = ["token", "token-g16", "block-channel"] if args.quick else list(table)
    for dtype_name, dtype in (("int8", torch.int8), ("fp8", FP8)):
        for name in names:
            qk, qv, row_bytes, teacher_only = table[name]
            r = measure(lambda x: qk(x, dtype), lambda x: qv(x, dtype), teacher_only)
            if name == "block-channel":  # K scales: D per block; V: one per token
                row_bytes_k = D + D * 4 / BLOCK_SIZE
                r["bytes_per_token"] = L * H * (row_bytes_k + row_bytes)
            else:
                r["bytes_per_token"] = 2 * L * H * row_bytes
            results[f"{dtype_name} {name}"] = r
            tf = r["teacher_forcing"]
            print(f"{dtype_name:4} {name:18} {r['bytes_per_token']:>8.0f} B/token  KL mean {tf['kl_mean']:.2e} max "
                  f"{tf['kl_max']:.2e}  max|dlogit| {tf['logit_max_abs']:.3f}  greedy "
                  f"{r.get('greedy', {}).get('agreement', float('nan')):.1%} "
                  f"{r.get('greedy', {}).get('tokens_before_first_difference', '')}", flush=True)
    record = {"benchmark": "kv_quant_schemes", "date": datetime.date.today().isoformat(), **environment("cpu"),
              "workload": {"model": args.model, "dtype": "float32", "block_size": BLOCK_SIZE, "prompts": prompts,
                           "max_tokens": max_tokens, "text": str(TEXT.relative_to(REPO)), "text_tokens": len(ids),
                           "simulation": "float32 pool holding the de-quantized values of each scheme"},
              "full_precision": {"bytes_per_token": 2 * L * H * D * 4},
              "results": results, "seconds": time.perf_counter() - t0}
    print(f"{record['seconds']:.0f} s")
    if not args.no_record:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
