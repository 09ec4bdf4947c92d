"""What the KV cache buys: rung 1 (naive) vs rung 2 (contiguous cache) vs transformers `generate`.

    python -m minikv.bench.cache_speedup            the recorded CPU run (several minutes: naive is slow)
    python -m minikv.bench.cache_speedup --prompt-len 32 --new-tokens 8 --no-record     a quick try

One process, one device, one workload: SmolLM2-135M-Instruct in fp32, a 512-token prompt, 128 new
tokens, greedy, EOS ignored (transformers: min_new_tokens = max_new_tokens). Each engine is loaded once
and warmed up; a timed run goes from prompt to last token (prefill included). Contiguous and
transformers take turns `--repeats` times and the fastest run of each counts (a shared machine is
noisy); naive takes minutes per run and runs `--naive-repeats` times (default once). Every run's time
is in the record. The token sequences must all be the same; the record says whether they are. Writes
benchmarks/cache_speedup_cpu.json and appends a line to benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from pathlib import Path
from typing import Callable

import torch

from minikv.bench import REPO, environment, first_divergence

# English about the subject, tiled to the prompt length: a natural prompt keeps greedy decoding away
# from the near-ties that random token ids produce.
PROMPT_TEXT = (
    "A language model writes one token at a time. To choose the next token, every layer lets the newest "
    "token attend to the keys and values of all the tokens before it. Those keys and values do not change "
    "once they are computed, so an inference engine can keep them in memory instead of computing them "
    "again at every step. That memory is the KV cache. It turns the cost of a step from the whole sequence "
    "into a single token, and it is paid for in memory: two vectors per layer, per key-value head, per "
    "token, for every request that is running. "
)


def prompt_ids(tokenizer, length: int) -> list[int]:
    ids = tokenizer.encode(PROMPT_TEXT, add_special_tokens=False)
    return (ids * (length // len(ids) + 1))[:length]


def minikv_runner(kv_backend: str, ids: list[int], new_tokens: int, warmup_tokens: int) -> Callable[[], dict]:
    """Load and warm up one engine; return a function that times one run."""
    from minikv import LLM, SamplingParams

    llm = LLM("smollm2-135m", kv_backend=kv_backend, dtype="float32", device="cpu", max_num_seqs=1,
              max_model_len=len(ids) + new_tokens)
    llm.generate(ids[:32], SamplingParams(max_tokens=warmup_tokens, ignore_eos=True))

    def run() -> dict:
        t = time.perf_counter()
        out = llm.generate(ids, SamplingParams(max_tokens=new_tokens, ignore_eos=True))[0]
        seconds = time.perf_counter() - t
        return {"seconds": seconds, "ttft_s": out.time_to_first_token, "mean_itl_s": out.inter_token_latency,
                "token_ids": out.token_ids}
    return run


def transformers_runner(ids: list[int], new_tokens: int, warmup_tokens: int) -> Callable[[], dict]:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from minikv.model.named import prepare_smollm2

    hf_logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(prepare_smollm2(quiet=True), dtype=torch.float32).eval()

    def generate(prompt: list[int], n: int) -> list[int]:
        x = torch.tensor([prompt])
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    with torch.inference_mode():
        generate(ids[:32], warmup_tokens)

    def run() -> dict:
        with torch.inference_mode():
            t = time.perf_counter()
            tokens = generate(ids, new_tokens)
            seconds = time.perf_counter() - t
        return {"seconds": seconds, "token_ids": tokens, "attn_implementation": model.config._attn_implementation}
    return run


RESULTS_HEADER = """# Benchmark results

Every figure here compares minikv with a baseline measured **in the same run, on the same device**
(same process, same workload, same weights); the raw record of each run (device, CPU count, torch /
triton / transformers versions, commit, workload, timings) is the JSON file named on its line.
A time measured on another machine or another day is never compared with these.

"""


def tokens_identical(rec: dict) -> bool:
    return (all(v is None for v in rec["first_divergence"].values())
            and all(r["runs_identical"] for r in rec["results"].values()))


def write_record(record: dict, out: Path, line: str, name: str) -> None:
    """Save the run's JSON record and append its line to RESULTS.md beside it (created if absent)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    results_md = out.parent / "RESULTS.md"
    if not results_md.exists():
        results_md.write_text(RESULTS_HEADER)
    with results_md.open("a") as f:
        f.write(line)
    print(f"[{name}] wrote {out} and a line in {results_md}")


def results_line(rec: dict, json_name: str) -> str:
    r, s, w = rec["results"], rec["speedup"], rec["workload"]
    same = "identical" if tokens_identical(rec) else "NOT identical (see JSON)"
    return (f"- {rec['date']} · cache_speedup · {rec['device']}, {rec['cpu_count']} cores, "
            f"{rec['torch_threads']} torch threads · {w['model']} {w['dtype']}, {w['prompt_tokens']}-token prompt "
            f"+ {w['new_tokens']} new tokens, greedy, batch 1, fastest of {w['repeats']} runs "
            f"({w['naive_repeats']} for naive), load average {rec['load_average_1min']['before']:.1f} · "
            f"contiguous KV cache {r['contiguous']['tokens_per_s']:.2f} tok/s, "
            f"naive (no cache) {r['naive']['tokens_per_s']:.2f} tok/s = **{s['contiguous_vs_naive']:.1f}x**; "
            f"transformers generate {r['transformers']['tokens_per_s']:.2f} tok/s "
            f"(contiguous / transformers = {s['contiguous_vs_transformers']:.2f}x) · tokens {same} · "
            f"commit {rec['commit']} · [{json_name}]({json_name})\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--warmup-tokens", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of contiguous and transformers (fastest counts)")
    ap.add_argument("--naive-repeats", type=int, default=1, help="timed runs of naive (minutes each)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "cache_speedup_cpu.json"))
    ap.add_argument("--no-record", action="store_true", help="print the record, write nothing")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from minikv.model.named import prepare_smollm2

    ids = prompt_ids(AutoTokenizer.from_pretrained(prepare_smollm2(quiet=True)), args.prompt_len)
    load_before = os.getloadavg()
    runners = {"contiguous": minikv_runner("contiguous", ids, args.new_tokens, args.warmup_tokens),
               "transformers": transformers_runner(ids, args.new_tokens, args.warmup_tokens),
               "naive": minikv_runner("naive", ids, args.new_tokens, args.warmup_tokens)}
    order = ["contiguous", "transformers"] * args.repeats + ["naive"] * args.naive_repeats
    runs: dict[str, list[dict]] = {name: [] for name in runners}
    for name in order:
        runs[name].append(runners[name]())
        print(f"[cache_speedup] {name}: {runs[name][-1]['seconds']:.1f} s", flush=True)
    results = {}
    for name, rs in runs.items():
        best = min(rs, key=lambda r: r["seconds"])
        results[name] = {**best, "tokens_per_s": args.new_tokens / best["seconds"],
                         "all_seconds": [round(r["seconds"], 3) for r in rs],
                         "runs_identical": all(r["token_ids"] == rs[0]["token_ids"] for r in rs)}
    reference = results["transformers"]["token_ids"]
    record = {
        "benchmark": "cache_speedup",
        "date": datetime.date.today().isoformat(),
        **environment(),
        "load_average_1min": {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2)},
        "workload": {"model": "SmolLM2-135M-Instruct", "dtype": "float32", "batch_size": 1,
                     "prompt_tokens": len(ids), "new_tokens": args.new_tokens, "greedy": True, "ignore_eos": True,
                     "warmup_tokens": args.warmup_tokens, "repeats": args.repeats, "naive_repeats": args.naive_repeats,
                     "timing": "fastest run of each engine, prefill included",
                     "prompt": "PROMPT_TEXT tiled (minikv/bench/cache_speedup.py)"},
        "results": {k: {m: v for m, v in r.items() if m != "token_ids"} for k, r in results.items()},
        "speedup": {
            "contiguous_vs_naive": results["naive"]["seconds"] / results["contiguous"]["seconds"],
            "contiguous_vs_transformers": results["transformers"]["seconds"] / results["contiguous"]["seconds"],
            "transformers_vs_naive": results["naive"]["seconds"] / results["transformers"]["seconds"],
        },
        "first_divergence": {f"{k}_vs_transformers": first_divergence(results[k]["token_ids"], reference)
                             for k in ("contiguous", "naive")},
        "token_ids": reference,
    }
    print(json.dumps({k: v for k, v in record.items() if k != "token_ids"}, indent=1))
    if not args.no_record:
        write_record(record, Path(args.out), results_line(record, Path(args.out).name), "cache_speedup")
    return 0 if tokens_identical(record) else 1


if __name__ == "__main__":
    raise SystemExit(main())
