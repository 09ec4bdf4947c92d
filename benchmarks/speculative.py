"""Speculative decoding (rung 11): the same engine with and without n-gram drafts, same process, same device.

    OMP_NUM_THREADS=1 python benchmarks/speculative.py --cpu --out benchmarks/speculative_cpu.json
    python benchmarks/speculative.py --gpu --out benchmarks/speculative_gpu.json      # on a CUDA machine
    python benchmarks/speculative.py --gpu --cpu-smoke                                # the GPU mode, tiny, on a CPU
    python benchmarks/speculative.py --gpu --random-shape qwen2.5-0.5b --out ...      # a GPU without the course's model

CPU mode: SmolLM2-135M-Instruct float32, one request at a time, greedy, on prompts whose answer repeats
its input (repeating a passage, renaming a variable in code) and on one whose answer does not (a
story): output tokens per second of the paged engine without and with `speculative="ngram"`, the
acceptance rate, and target forward passes (engine steps) per output token. Plain and speculative
runs take turns --repeats times; greedy tokens must be equal, and the record says whether they are.

GPU mode: the repetitive prompts at batch 1, 8, 64 and 256 (EOS ignored, --new-tokens each), plain
against n-gram: at a small batch k + 1 query tokens cost about one decode step (the step reads the
weights once either way), at a large batch the step is compute-bound and rejected drafts cost real
work. The table gives the speedup at each batch size and the crossover, the first batch size where
speculation stops paying: set `speculative_disable_by_batch_size` below it. Speculation turns the
overlapped (async) steps off, so on a GPU the plain engine runs twice, with its defaults (overlap on,
the speedup that counts) and without overlap (what the drafts alone change).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from minikv import LLM, SamplingParams
from minikv.bench import environment

PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished "
           "the great lens, and wrote the weather in a small leather book. Ships passed far out at sea, and none "
           "of them knew his name, but every one of them saw his light.")
CODE = ("def total(xs):\n    s = 0\n    for x in xs:\n        if x > 0:\n            s = s + x\n    return s\n\n"
        "def count(xs):\n    n = 0\n    for x in xs:\n        if x > 0:\n            n = n + 1\n    return n\n")
PROMPTS = {
    "repeat a passage": "Repeat the following text exactly, word for word:\n\n" + PASSAGE,
    "edit code": "Rename the variable `x` to `item` in this Python code and print the whole code:\n\n" + CODE,
    "free story (low acceptance)": "Write a short story about a dragon who learns to bake bread.",
}


class Steps:
    """Counts engine steps (target forward passes)."""

    def __init__(self):
        self.n = 0

    def on_step(self, llm, batch, events):
        self.n += 1


def run(llm: LLM, prompts: list, params: SamplingParams) -> dict:
    steps = Steps()
    remove = llm.add_observer(steps)
    before = llm.stats().get("speculative", {})
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    remove()
    after = llm.stats().get("speculative", {})
    tokens = sum(len(o.token_ids) for o in outs)
    drafted = after.get("drafted", 0) - before.get("drafted", 0)
    accepted = after.get("accepted", 0) - before.get("accepted", 0)
    return {"seconds": dt, "tokens": tokens, "tok_s": tokens / dt, "steps": steps.n,
            "forwards_per_token": steps.n / tokens, "drafted": drafted, "accepted": accepted,
            "acceptance_rate": accepted / drafted if drafted else None, "token_ids": [o.token_ids for o in outs]}


def compare(engines: dict[str, LLM], prompts: list, params: SamplingParams, repeats: int) -> dict:
    """Each engine runs the prompts `repeats` times, taking turns (a slow spell of a shared machine hits
    them all); "ngram" is compared with every other."""
    runs = {name: [] for name in engines}
    names = list(engines)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            runs[name].append(run(engines[name], prompts, params))
    s = runs["ngram"]
    row = {"batch": len(prompts), "tokens": s[-1]["tokens"], "acceptance_rate": s[-1]["acceptance_rate"],
           "drafted": s[-1]["drafted"], "accepted": s[-1]["accepted"],
           "ngram_tok_s": statistics.median(x["tok_s"] for x in s),
           "ngram_forwards_per_token": s[-1]["forwards_per_token"]}
    for name in names:
        if name == "ngram":
            continue
        p = runs[name]
        row[f"{name}_tok_s"] = statistics.median(x["tok_s"] for x in p)
        row[f"{name}_forwards_per_token"] = p[-1]["forwards_per_token"]
        row[f"paired_speedups_vs_{name}"] = [b["tok_s"] / a["tok_s"] for a, b in zip(p, s)]
        row[f"speedup_vs_{name}"] = statistics.median(row[f"paired_speedups_vs_{name}"])
        row[f"greedy_tokens_identical_to_{name}"] = all(a["token_ids"] == b["token_ids"] for a, b in zip(p, s))
    row["speedup"] = row["speedup_vs_plain"]
    row["greedy_tokens_identical"] = row["greedy_tokens_identical_to_plain"]
    row["plain_forwards_per_token"] = row["plain_forwards_per_token"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--cpu", action="store_true", help="single stream on the CPU, float32")
    mode.add_argument("--gpu", action="store_true", help="batch 1, 8, 64, 256 on a CUDA device")
    ap.add_argument("--cpu-smoke", action="store_true", help="the GPU mode with tiny sizes on a CPU (a check)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--random-shape", choices=["qwen2.5-0.5b", "llama-3.1-8b"], default=None,
                    help="a random-weight checkpoint of these shapes instead of --model (a GPU machine that cannot "
                         "hold the course's model); prompts are then repeating token ids, and the record says so")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = "cuda" if args.gpu and not args.cpu_smoke else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"
    model = "tiny-random" if args.cpu_smoke else args.model
    if args.random_shape:
        import tempfile

        from minikv.bench.throughput import LLAMA31_8B_SHAPE, QWEN25_05B_SHAPE, make_random_checkpoint

        shape = {"qwen2.5-0.5b": QWEN25_05B_SHAPE, "llama-3.1-8b": LLAMA31_8B_SHAPE}[args.random_shape]
        model = str(make_random_checkpoint(shape, Path(tempfile.mkdtemp()) / args.random_shape,
                                           dtype=getattr(torch, dtype), device=device))
    new_tokens = args.new_tokens or (8 if args.cpu_smoke else 64 if args.cpu else 128)
    repeats = args.repeats or (1 if args.cpu_smoke else 2 if args.cpu else 3)
    common = dict(device=device, dtype=dtype, kv_backend="paged")
    if args.cpu_smoke:
        common.update(num_blocks=256, block_size=8)
    elif device == "cuda":  # up to three engines share the card: a pool fitted to the whole of it leaves none
        common.update(kv_cache_memory=8 * 2**30)
    plain = LLM(model, **common)
    spec = LLM(plain.loaded, **common, speculative="ngram", num_speculative_tokens=args.k)
    engines = {"plain": plain, "ngram": spec}
    if args.gpu and (plain.async_scheduling or args.cpu_smoke):  # speculation turns overlap off: show that too
        engines = {"plain": plain, "plain_no_overlap": plain.derive(async_scheduling=False), "ngram": spec}
    tok = plain.tokenizer

    def encode(text: str):
        return plain.chat_prompt(text) if tok is not None else [(i * 7) % 50 + 1 for i in range(40)]

    rows = []
    if args.cpu:
        params = SamplingParams(max_tokens=new_tokens, temperature=0)
        for name, text in PROMPTS.items():
            row = compare(engines, [encode(text)], params, repeats)
            rows.append({"workload": name, **row})
    else:
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        repetitive = [encode(t) for name, t in PROMPTS.items() if "low" not in name]
        batches = [1, 2] if args.cpu_smoke else [int(b) for b in args.batches.split(",")]
        for engine in engines.values():  # warm-up (kernels, graphs)
            run(engine, repetitive[:1], SamplingParams(max_tokens=4))
        for b in batches:
            prompts = [repetitive[i % len(repetitive)] for i in range(b)]
            rows.append({"workload": "repetitive (passage, code)", **compare(engines, prompts, params, repeats)})
    crossover = next((r["batch"] for r in rows if args.gpu and r["speedup"] < 1.0), None)
    print(f"{'workload':32} {'batch':>5} {'plain tok/s':>11} {'ngram tok/s':>11} {'speedup':>7} {'accept':>6} "
          f"{'fwd/tok plain':>13} {'fwd/tok ngram':>13} same")
    for r in rows:
        acc = f"{r['acceptance_rate']:.2f}" if r["acceptance_rate"] is not None else "-"
        print(f"{r['workload']:32} {r['batch']:>5} {r['plain_tok_s']:>11.1f} {r['ngram_tok_s']:>11.1f} "
              f"{r['speedup']:>6.2f}x {acc:>6} {r['plain_forwards_per_token']:>13.2f} "
              f"{r['ngram_forwards_per_token']:>13.2f} {r['greedy_tokens_identical']}"
              + (f"  (vs plain without overlap: {r['speedup_vs_plain_no_overlap']:.2f}x)"
                 if "speedup_vs_plain_no_overlap" in r else ""))
    if args.gpu:
        print(f"crossover (first batch size where n-gram speculation is slower): {crossover}")
    record = {"benchmark": "speculative decoding, n-gram, with and without", **environment(device),
              "model": f"random weights, {args.random_shape} shapes" if args.random_shape else model,
              "dtype": dtype, "num_speculative_tokens": args.k, "new_tokens": new_tokens,
              "repeats": repeats, "mode": "cpu single stream" if args.cpu else "gpu batches", "rows": rows,
              "crossover_batch": crossover}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
