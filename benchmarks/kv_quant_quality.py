"""How much does an 8-bit KV cache cost in quality? SmolLM2 on the CPU, int8 and fp8 pools against
the same engine with a full-precision (float32) pool.

    PYTHONPATH=. python benchmarks/kv_quant_quality.py            the recorded run (a few minutes)
    PYTHONPATH=. python benchmarks/kv_quant_quality.py --quick --no-record     a smoke run

Three measures, each against the full-precision pool, same weights, same process:

  greedy      each fixed prompt generates `max_tokens` greedy tokens; how many come before the first
              token that differs (agreement = their mean as a fraction of max_tokens), and at each first
              difference the gap between the full pool's top two logits (a near tie flips on any noise)
  teacher     a fixed text (benchmarks/data/pride_and_prejudice_ch1.txt, public domain) is fed whole;
  forcing     at every position the quantized pool's next-token distribution against the full one:
              KL(full || quantized) mean and max, max |logit difference|, top-1 agreement
  perplexity  exp(mean negative log-likelihood) of the same text's tokens, each pool

Granularity: the engine keeps a scale per token and KV head (and for int8 a zero point: each row's
[min, max] onto [-127, 127]; benchmarks/kv_quant_schemes.py compares the candidate formats). The
per-block alternative (one scale and zero per block and KV head, shared by its block_size tokens) is
measured under teacher forcing too, through the kv_quantizer seam: the text is stored in one step
from position 0, so each group of block_size rows the quantizer sees is one block (scales are
repeated per token, so the pool's format does not change).

For context, a 16-bit pool against the same float32 pool: a float32 pool whose store rounds K/V to
float16 holds exactly what a float16 pool would, so its greedy agreement is what rounding to 16 bits
alone costs on these prompts (a near tie flips on any noise).
"""
from __future__ import annotations

import argparse
import datetime
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from minikv import LLM, SamplingParams
from minikv.attention.metadata import PagedMetadata
from minikv.bench import REPO, environment, first_divergence
from minikv.bench.cache_speedup import write_record
from minikv.cache.blocks.quant import QMAX, has_zero_point

TEXT = REPO / "benchmarks" / "data" / "pride_and_prejudice_ch1.txt"
PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "The three primary colors are",
    "Once upon a time, in a small village by the sea,",
    "To make a cup of tea, first",
    "The largest planet in the solar system is",
    "A computer program is a list of instructions that",
    "In the morning, the birds",
    "The history of the Roman Empire begins",
    "Photosynthesis is the process by which",
    "My favourite book is",
    "def fibonacci(n):",
]
BLOCK_SIZE = 16


def per_block_quantizer(block_size: int):
    """A kv_quantizer with one scale (and int8 zero point) per (block, KV head): rows [i*block_size,
    (i+1)*block_size) share them. Correct only for a store that starts at a block's first slot (the
    teacher-forcing pass here)."""
    def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        T, H, D = x.shape
        qmax = QMAX[dtype]
        pad = -T % block_size
        xp = F.pad(x.float(), (0, 0, 0, 0, 0, pad), value=float("nan")).view(-1, block_size, H, D)
        per_token = lambda t: t.expand(-1, block_size, -1, -1)[..., 0].reshape(-1, H)[:T]  # noqa: E731  [T, H]
        if has_zero_point(dtype):  # the block's [min, max] (padding rows left out)
            hi = xp.nan_to_num(nan=-float("inf")).amax(dim=(1, 3), keepdim=True)
            lo = xp.nan_to_num(nan=float("inf")).amin(dim=(1, 3), keepdim=True)
            scale, zero = per_token((hi - lo) / 2 / qmax), per_token((hi + lo) / 2)
        else:
            scale, zero = per_token(xp.nan_to_num(nan=0).abs().amax(dim=(1, 3), keepdim=True) / qmax), None
        inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        y = (x.float() - (0 if zero is None else zero[..., None])) * inv[..., None]
        q = (torch.floor(y + 0.5) if dtype == torch.int8 else y).clamp(-qmax, qmax).to(dtype)
        return q, scale, zero
    return quantize


def float16_pool(llm: LLM):
    """Make llm's float32 pool store K/V rounded to float16 (what a float16 pool holds); returns the undo."""
    pool = llm.backend.pool
    store = pool.store
    pool.store = lambda layer, k, v, slots: store(layer, k.half().float(), v.half().float(), slots)
    return lambda: setattr(pool, "store", store)


def all_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] of one pass over the whole text on llm's pool (blocks 0, 1, ... in order)."""
    n = len(ids)
    blocks = list(range(-(-n // llm.block_size)))
    meta = PagedMetadata.build([n], [n], llm.device, slot_mapping=torch.arange(n, device=llm.device),
                               block_tables=torch.tensor([blocks], device=llm.device))
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=llm.device)  # noqa: E731
    with torch.inference_mode():
        return llm.model(as_long(ids), as_long(range(n)), meta, llm.backend, logits_indices=as_long(range(n))).float()


def teacher_forcing(full: torch.Tensor, quant: torch.Tensor, ids: list[int]) -> dict:
    logp_full, logp_q = F.log_softmax(full, -1), F.log_softmax(quant, -1)
    kl = (logp_full.exp() * (logp_full - logp_q)).sum(-1)  # KL(full || quantized) per position
    target = torch.tensor(ids[1:])
    nll = -logp_q[:-1].gather(1, target[:, None])[:, 0]
    return {"positions": len(ids), "kl_mean": kl.mean().item(), "kl_max": kl.max().item(),
            "logit_max_abs": (full - quant).abs().max().item(),
            "logit_mean_abs": (full - quant).abs().mean().item(),
            "top1_agreement": (full.argmax(-1) == quant.argmax(-1)).float().mean().item(),
            "perplexity": math.exp(nll.mean().item())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="2 prompts, 8 tokens, 64 text tokens (a smoke run)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "kv_quant_quality_cpu.json"))
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    prompts, max_tokens = (PROMPTS[:2], 8) if args.quick else (PROMPTS, args.max_tokens)
    t0 = time.perf_counter()
    full = LLM(args.model, device="cpu", kv_backend="paged", block_size=BLOCK_SIZE, num_blocks=256, max_num_seqs=16)
    text = TEXT.read_text()
    ids = full.tokenizer.encode(text) if full.tokenizer is not None else list(range(1, 200))
    if args.quick:
        ids = ids[:64]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in full.generate(prompts, params)]
    logits_full = all_logits(full, ids)
    ppl_full = math.exp(F.cross_entropy(logits_full[:-1], torch.tensor(ids[1:])).item())
    decode = (lambda toks: full.tokenizer.decode(toks)) if full.tokenizer is not None else str  # noqa: E731
    results, texts = {}, {"full": [decode(t) for t in want[:3]]}
    undo = float16_pool(full)
    try:
        got16 = [o.token_ids for o in full.generate(prompts, params)]
        teacher16 = teacher_forcing(logits_full, all_logits(full, ids), ids)
    finally:
        undo()
    before16 = [max_tokens if f is None else f for f in map(first_divergence, got16, want)]
    float16_reference = {"bytes_per_token": full.stats()["bytes_per_token"] // 2,
                         "greedy": {"tokens_before_first_difference": before16,
                                    "identical_runs": sum(b == max_tokens for b in before16),
                                    "agreement": sum(before16) / (len(prompts) * max_tokens)},
                         "teacher_forcing": teacher16}
    print(f"float16 pool (context): greedy agreement {float16_reference['greedy']['agreement']:.1%} {before16}; "
          f"KL mean {teacher16['kl_mean']:.2e}")
    for kv in ("int8", "fp8"):
        llm = full.derive(kv_cache_dtype=kv)
        got = [o.token_ids for o in llm.generate(prompts, params)]
        first = [first_divergence(g, w) for g, w in zip(got, want)]
        before = [max_tokens if f is None else f for f in first]
        # where a run parts from the full-precision one: how close were the full pool's top two tokens?
        gaps = []
        for prompt, f, w in zip(prompts, first, want):
            if f is not None:
                top = all_logits(full, full.encode(prompt)[0] + w[:f])[-1].topk(2).values
                gaps.append(round((top[0] - top[1]).item(), 4))
        stats = llm.stats()
        results[kv] = {
            "kv_cache_dtype": stats["kv_cache_dtype"], "bytes_per_token": stats["bytes_per_token"],
            "greedy": {"prompts": len(prompts), "max_tokens": max_tokens, "tokens_before_first_difference": before,
                       "identical_runs": sum(f is None for f in first),
                       "full_precision_top2_logit_gap_at_first_difference": gaps,
                       "agreement": sum(before) / (len(prompts) * max_tokens)},
            "teacher_forcing": teacher_forcing(logits_full, all_logits(llm, ids), ids),
            "teacher_forcing_per_block_scales": teacher_forcing(
                logits_full, all_logits(full.derive(kv_cache_dtype=kv, kv_quantizer=per_block_quantizer(BLOCK_SIZE)),
                                        ids), ids),
        }
        texts[kv] = [decode(t) for t in got[:3]]
        r = results[kv]
        print(f"{kv}: greedy agreement {r['greedy']['agreement']:.1%} {before}; "
              f"KL mean {r['teacher_forcing']['kl_mean']:.2e} max {r['teacher_forcing']['kl_max']:.2e}; "
              f"ppl {r['teacher_forcing']['perplexity']:.3f} (full {ppl_full:.3f}); per-block scales: KL mean "
              f"{r['teacher_forcing_per_block_scales']['kl_mean']:.2e}, ppl "
              f"{r['teacher_forcing_per_block_scales']['perplexity']:.3f}")
    full_stats = full.stats()
    record = {
        "benchmark": "kv_quant_quality", "date": datetime.date.today().isoformat(), **environment("cpu"),
        "workload": {"model": args.model, "dtype": str(full.dtype).removeprefix("torch."), "block_size": BLOCK_SIZE,
                     "prompts": prompts, "max_tokens": max_tokens, "greedy": True,
                     "text": str(TEXT.relative_to(REPO)), "text_tokens": len(ids),
                     "text_source": "Jane Austen, Pride and Prejudice (1813), chapter 1; public domain",
                     "scale_granularity": "int8: a float32 scale and zero point per token and KV head (the row's "
                                          "[min, max] onto [-127, 127]); fp8: a float32 scale per token and KV head "
                                          "(absmax / 448) (engine); per block and KV head "
                                          "(teacher_forcing_per_block_scales, through the kv_quantizer seam)"},
        "full_precision": {"kv_cache_dtype": full_stats["kv_cache_dtype"],
                           "bytes_per_token": full_stats["bytes_per_token"], "perplexity": ppl_full},
        "float16_reference": float16_reference,
        "results": results, "sample_texts": texts, "seconds": time.perf_counter() - t0,
    }
    print(f"full precision perplexity {ppl_full:.3f}; {record['seconds']:.0f} s")
    if args.no_record:
        return
    i8, f8 = results["int8"], results["fp8"]
    line = (f"- {record['date']} · kv_quant_quality · {record['device']}, {record['torch_threads']} torch threads · "
            f"torch {record['torch']} · {args.model} float32 weights, block {BLOCK_SIZE}, int8 scale + zero point / "
            f"fp8 scale per token and KV head · "
            f"greedy agreement over {len(prompts)} prompts × {max_tokens} tokens (tokens before the first difference): "
            f"**int8 {i8['greedy']['agreement']:.1%}** ({i8['greedy']['identical_runs']}/{len(prompts)} identical), "
            f"**fp8 {f8['greedy']['agreement']:.1%}** ({f8['greedy']['identical_runs']}/{len(prompts)} identical), "
            f"a float16 pool {float16_reference['greedy']['agreement']:.1%} for context; "
            f"top-2 logit gap of the full pool where a run parts: int8 "
            f"{i8['greedy']['full_precision_top2_logit_gap_at_first_difference']}, fp8 "
            f"{f8['greedy']['full_precision_top2_logit_gap_at_first_difference']}; "
            f"teacher forcing on {len(ids)} tokens of Pride and Prejudice ch. 1: KL mean int8 "
            f"{i8['teacher_forcing']['kl_mean']:.1e} / fp8 {f8['teacher_forcing']['kl_mean']:.1e}, max |logit diff| "
            f"{i8['teacher_forcing']['logit_max_abs']:.2f} / {f8['teacher_forcing']['logit_max_abs']:.2f}, top-1 "
            f"{i8['teacher_forcing']['top1_agreement']:.1%} / {f8['teacher_forcing']['top1_agreement']:.1%}; "
            f"perplexity full {ppl_full:.3f}, int8 {i8['teacher_forcing']['perplexity']:.3f}, fp8 "
            f"{f8['teacher_forcing']['perplexity']:.3f}; per-block scales: KL mean "
            f"{i8['teacher_forcing_per_block_scales']['kl_mean']:.1e} / "
            f"{f8['teacher_forcing_per_block_scales']['kl_mean']:.1e}, perplexity "
            f"{i8['teacher_forcing_per_block_scales']['perplexity']:.3f} / "
            f"{f8['teacher_forcing_per_block_scales']['perplexity']:.3f}; bytes per token "
            f"{full_stats['bytes_per_token']:,} (float32) vs {i8['bytes_per_token']:,} (int8) / "
            f"{f8['bytes_per_token']:,} "
            f"(fp8) · commit {record['commit']} · "
            f"[{Path(args.out).name}]({Path(args.out).name})\n")
    write_record(record, Path(args.out), line, "kv_quant_quality")


if __name__ == "__main__":
    main()
