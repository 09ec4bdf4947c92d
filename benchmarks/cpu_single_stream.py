"""CPU, one request at a time: minikv's contiguous cache (the CPU default) against transformers
`generate`, greedy and sampled (temperature 0.6, top-p 0.95), in one process.

    python benchmarks/cpu_single_stream.py --out benchmarks/cpu_single_stream.json

SmolLM2-135M-Instruct in float32, cache_speedup's English prompt tiled to --prompt-len tokens,
--new-tokens new tokens, EOS ignored. The four runs take turns --repeats times (a shared machine is
noisy); the record keeps every time, and the fastest and the median of each. Greedy tokens of the two
engines must be equal; the record says whether they are.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from minikv.bench import environment
from minikv.bench.cache_speedup import prompt_ids

SAMPLED = {"temperature": 0.6, "top_p": 0.95}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, GenerationConfig

    from minikv import LLM, SamplingParams
    from minikv.model.named import prepare_smollm2

    llm = LLM("smollm2-135m", device="cpu", dtype="float32")
    ids = prompt_ids(llm.tokenizer, args.prompt_len)
    hf = AutoModelForCausalLM.from_pretrained(prepare_smollm2(), dtype=torch.float32).eval()
    n = args.new_tokens

    def ours(sampled: bool):
        params = SamplingParams(max_tokens=n, ignore_eos=True, seed=0, **(SAMPLED if sampled else {}))
        return llm.generate([ids], params)[0].token_ids

    def theirs(sampled: bool):
        cfg = GenerationConfig(max_new_tokens=n, min_new_tokens=n, pad_token_id=0,
                               **({"do_sample": True, "top_k": 0, **SAMPLED} if sampled else {"do_sample": False}))
        with torch.no_grad():
            return hf.generate(torch.tensor([ids]), generation_config=cfg)[0, len(ids):].tolist()

    runs = {"minikv greedy": lambda: ours(False), "minikv sampled": lambda: ours(True),
            "transformers greedy": lambda: theirs(False), "transformers sampled": lambda: theirs(True)}
    for fn in runs.values():  # warm up
        fn()
    times: dict[str, list[float]] = {k: [] for k in runs}
    tokens: dict[str, list[int]] = {}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            t = time.perf_counter()
            tokens[name] = fn()
            times[name].append(time.perf_counter() - t)
            print(f"{name}: {times[name][-1]:.2f} s", flush=True)
    record = {"benchmark": "CPU single stream, greedy and sampled", **environment("cpu"),
              "load_average": os.getloadavg(), "model": "SmolLM2-135M-Instruct float32",
              "prompt_tokens": len(ids), "new_tokens": n, "sampled": SAMPLED, "repeats": args.repeats,
              "greedy_tokens_identical": tokens["minikv greedy"] == tokens["transformers greedy"], "runs": {}}
    for name, ts in times.items():
        record["runs"][name] = {"seconds": [round(t, 3) for t in ts], "best_tok_s": round(n / min(ts), 2),
                                "median_tok_s": round(n / statistics.median(ts), 2)}
    r = record["runs"]
    record["ratios_median"] = {
        "minikv_sampled_over_greedy": round(r["minikv sampled"]["median_tok_s"]
                                            / r["minikv greedy"]["median_tok_s"], 3),
        "minikv_over_transformers_greedy": round(r["minikv greedy"]["median_tok_s"]
                                                 / r["transformers greedy"]["median_tok_s"], 3),
        "minikv_over_transformers_sampled": round(r["minikv sampled"]["median_tok_s"]
                                                  / r["transformers sampled"]["median_tok_s"], 3)}
    print(json.dumps(record, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()
