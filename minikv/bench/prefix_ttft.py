"""Time to first token with a 2,048-token shared prefix: prefix caching off, hash chain, radix tree.

    python -m minikv.bench.prefix_ttft --threads 1                  CPU, SmolLM2 (the recorded CPU run)
    python -m minikv.bench.prefix_ttft --model random-qwen2.5-0.5b --device cuda \\
        --out benchmarks/prefix_ttft_gpu.json                       GPU, Qwen2.5-0.5B shapes, random bf16
    python -m minikv.bench.prefix_ttft --prefix-len 256 --requests 3 --no-record      a quick try

The workload: every request is the same `prefix_len`-token document followed by its own
`suffix_len`-token question, sent one at a time (so TTFT is prefill time, not queueing), greedy,
`max_tokens` new tokens. Three engines with the same weights run side by side in one process,
request by request in turn (off, hash, radix, off, hash, ...), so a busy machine slows all three
alike:

    request 1    cold: every engine computes the whole prompt (the cached ones fill their cache)
    request 2..  warm: "off" computes it all again; "hash" and "radix" compute only the question

The record: TTFT of each request for each engine, the warm mean, speedup = off / cached (warm
means), tokens served from the cache and the hit rate, and whether every engine produced the same
tokens. Writes the JSON record and a line in benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch

from minikv.bench import REPO, environment
from minikv.bench.cache_speedup import prompt_ids, write_record

MODES = (None, "hash", "radix")
QUESTIONS = ["What is this text about?", "Summarise it in one sentence.", "Which memory does it describe?",
             "Why does the cache grow?", "What does a step cost?", "Name one trade-off.",
             "Who pays for the memory?", "What changes once keys are computed?"]


def build_prompts(tokenizer, vocab: int, prefix_len: int, suffix_len: int, n: int) -> list[list[int]]:
    """The shared document (English tiled, or ids for a model without a tokenizer) + one question each."""
    if tokenizer is not None:
        prefix = prompt_ids(tokenizer, prefix_len)
        suffixes = [(tokenizer.encode(" " + QUESTIONS[i % len(QUESTIONS)], add_special_tokens=False) * suffix_len)
                    [:suffix_len] for i in range(n)]
    else:
        g = torch.Generator().manual_seed(0)
        prefix = torch.randint(0, min(vocab, 10000), (prefix_len,), generator=g).tolist()
        suffixes = [torch.randint(0, min(vocab, 10000), (suffix_len,), generator=g).tolist() for _ in range(n)]
    return [prefix + s for s in suffixes]


def model_path(model: str, tmp: Path) -> str:
    if model == "random-qwen2.5-0.5b":
        from minikv.bench.throughput import QWEN25_05B_SHAPE, make_random_checkpoint

        return str(make_random_checkpoint(QWEN25_05B_SHAPE, tmp / "qwen2.5-0.5b-random"))
    return model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="smollm2-135m, random-qwen2.5-0.5b, or a checkpoint")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--prefix-len", type=int, default=2048)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--requests", type=int, default=4, help="1 cold + the rest warm")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--attention", default="torch", choices=["torch", "triton"])
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--warmup-len", type=int, default=None, help="warm-up prompt tokens (default: 64 on CPU, "
                    "the full prompt length on CUDA, where the first long prefill pays one-time setup)")
    ap.add_argument("--commit", default=None, help="record this commit (a copy of the tree without .git)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "prefix_ttft_cpu.json"))
    ap.add_argument("--no-record", action="store_true", help="print the record, write nothing")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from minikv import LLM, SamplingParams

    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    max_len = args.prefix_len + args.suffix_len + args.max_tokens
    # room for one request, the cached prefix, and every question's blocks: nothing is evicted here
    num_blocks = 2 * (-(-max_len // args.block_size)) + args.requests * (-(-args.suffix_len // args.block_size) + 2)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        path = model_path(args.model, Path(tmp))
        engines = {m or "off": LLM(path, device=args.device, dtype=dtype, kv_backend="paged", max_num_seqs=1,
                                block_size=args.block_size, num_blocks=num_blocks, max_model_len=max_len,
                                attention=args.attention, prefix_caching=m) for m in MODES}
    first = engines["off"]
    prompts = build_prompts(first.tokenizer, first.config.vocab_size, args.prefix_len, args.suffix_len, args.requests)
    warmup_len = args.warmup_len or (args.prefix_len + args.suffix_len if args.device.startswith("cuda") else 64)
    warm_prompt = build_prompts(None, first.config.vocab_size, warmup_len - 1, 1, 1)[0]
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    for llm in engines.values():  # warm-up on an unrelated short prompt (kernels, allocator)
        llm.generate(warm_prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        if llm.prefix_cache is not None:  # start the measured run with an empty cache and fresh counters
            llm.reset_prefix_cache()
            llm.prefix_cache.queries = llm.prefix_cache.hits = 0
    ttft = {k: [] for k in engines}
    cached = {k: [] for k in engines}
    tokens = {k: [] for k in engines}
    for i, prompt in enumerate(prompts):
        for k, llm in engines.items():
            out = llm.generate(prompt, sp)[0]
            ttft[k].append(out.time_to_first_token)
            cached[k].append(out.num_cached_tokens)
            tokens[k].append(out.token_ids)
            print(f"[prefix_ttft] request {i + 1} {k:5s} ttft {out.time_to_first_token:8.3f} s, "
                  f"{out.num_cached_tokens} cached tokens", flush=True)
            gc.collect()
    warm = {k: statistics.mean(v[1:]) if len(v) > 1 else None for k, v in ttft.items()}
    results = {}
    for k, llm in engines.items():
        results[k] = {"ttft_s": ttft[k], "cold_ttft_s": ttft[k][0], "warm_mean_ttft_s": warm[k],
                      "num_cached_tokens": cached[k]}
        if llm.prefix_cache is not None:
            s = llm.stats()["prefix_cache"]
            results[k].update(prefix_cache_queries=s["queries"], prefix_cache_hits=s["hits"], hit_rate=s["hit_rate"])
    record = {
        "benchmark": "prefix_ttft",
        "date": datetime.date.today().isoformat(),
        **environment(args.device, args.commit),
        "load_average_1min": {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2)},
        "workload": {"model": args.model, "dtype": dtype, "device": args.device, "attention": args.attention,
                     "prefix_tokens": args.prefix_len, "suffix_tokens": args.suffix_len, "requests": args.requests,
                     "max_tokens": args.max_tokens, "block_size": args.block_size, "num_blocks": num_blocks,
                     "one request at a time": True, "engines interleaved request by request": True},
        "results": results,
        "speedup_warm_ttft": {k: warm["off"] / warm[k] for k in ("hash", "radix") if warm[k]},
        "tokens_identical_to_off": {k: tokens[k] == tokens["off"] for k in ("hash", "radix")},
    }
    print(json.dumps(record, indent=1))
    if args.no_record:
        return 0
    write_record(record, Path(args.out), results_line(record, Path(args.out).name), "prefix_ttft")
    return 0 if all(record["tokens_identical_to_off"].values()) else 1


def results_line(rec: dict, json_name: str) -> str:
    w, r, s = rec["workload"], rec["results"], rec["speedup_warm_ttft"]
    same = "identical" if all(rec["tokens_identical_to_off"].values()) else "NOT identical (see JSON)"
    threads = f", {rec['torch_threads']} torch threads" if w["device"] == "cpu" else ""
    return (f"- {rec['date']} · prefix_ttft · {rec['device']}{threads} · {w['model']} {w['dtype']}, "
            f"{w['prefix_tokens']}-token shared prefix + {w['suffix_tokens']}-token question, {w['requests']} requests "
            f"one at a time · warm TTFT: off {r['off']['warm_mean_ttft_s']:.3f} s, hash "
            f"{r['hash']['warm_mean_ttft_s']:.3f} s (**{s['hash']:.1f}x**), "
            f"radix {r['radix']['warm_mean_ttft_s']:.3f} s "
            f"(**{s['radix']:.1f}x**); hit rate hash {r['hash']['hit_rate']:.0%}, radix {r['radix']['hit_rate']:.0%} · "
            f"tokens {same} · commit {rec['commit']} · [{json_name}]({json_name})\n")


if __name__ == "__main__":
    raise SystemExit(main())
