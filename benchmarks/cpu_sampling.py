"""The sampling step alone on the CPU: temperature 0.6 and top-p 0.95 against greedy (argmax), on the same
logits, 64 requests over Qwen2.5's 151,936-token vocabulary.

    OMP_NUM_THREADS=1 python benchmarks/cpu_sampling.py --out benchmarks/cpu_sampling.json

Logits, float32 [64, 151936], seeded: a model-like row is a long normal tail, N(0, 2^2) for every
token, plus a Zipf-like head of 40 tokens at random ids, logit_r = top - slope * ln(r) for rank r = 1..40,
top uniform in [10, 20] and slope uniform in [0.5, 4] per row: some rows are peaked (one token holds
nearly all the mass at T = 0.6), others spread their nucleus over tens to hundreds of tokens. The
record gives the nucleus sizes it produced.

Checks first: the sampler's tokens equal the reference's (`_sample_nucleus`, the sorted top-p path
the CPU took before the block search; selected by `sampler.CPU_TOP_P = "sorted"`) for --checks draws of
every row (each a different position, so different noise), on the sampler's own path (the C path where
this machine builds it, minikv/engine/cpu_topp.c) and on the block search in torch ops; the record counts
the rows each could not vouch for and left to the sorted path. Then, for each thread count, six runs take
turns --repeats rounds:

    greedy     sample() with greedy params (torch's max over the vocabulary)
    argmax     logits.argmax(-1), greedy as it was before (the same index, about three times slower)
    sampled    sample() at temperature 0.6, top-p 0.95, on the sampler's own path (the record names it)
    torch_path the same on the block search in torch ops (`CPU_TOP_P = "blocks"`: the path without a compiler)
    reference  the sorted path on the same rows
    exp_pass   torch.exp of the logits into a buffer: one pass of exp, which any exact top-p draw needs
               (every token's probability enters the normaliser), the floor of a sampled step
    lse_pass   the sampler's own pass over the vocabulary (the block maxima of every row in one op, then
               the sum of exp2(x / (T ln 2)) a row at a time in a buffer): sampled minus this is the work
               on the nucleus

--engine-rows takes a real model's rows instead: the logits SmolLM2-135M-Instruct (the course's offline
model, on its own 49,152-token vocabulary) gave the engine for the 8th token of each of 64
passages of the README at T = 0.6, top-p 0.95.

The medians give the ratios to greedy (the goal: sampled at most 1.1x) and to argmax (greedy before).
With several threads, libgomp's idle threads spin between parallel regions (OMP_WAIT_POLICY, recorded);
on a machine whose cores are shared that spinning takes the time of the thread doing the work.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if __name__ == "__main__":  # run as a script: minikv from this checkout, installed or not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import minikv.engine.sampler as sampler  # noqa: E402
from minikv import SamplingParams  # noqa: E402
from minikv.bench import environment  # noqa: E402
from minikv.engine import cpu_topp  # noqa: E402
from minikv.engine.sampler import draw_keys, filtered_probs, sample  # noqa: E402

SAMPLED = {"temperature": 0.6, "top_p": 0.95}


def model_like_logits(rows: int, vocab: int, seed: int, head: int = 40) -> torch.Tensor:
    """[rows, vocab] float32: a normal tail and a Zipf-like head at random ids (see the module's docstring)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 2.0
    top = 10 + 10 * torch.rand(rows, 1, generator=g)
    slope = 0.5 + 3.5 * torch.rand(rows, 1, generator=g)
    ranks = torch.arange(1, head + 1, dtype=torch.float32)[None, :]
    ids = torch.stack([torch.randperm(vocab, generator=g)[:head] for _ in range(rows)])
    return logits.scatter_(1, ids, top - slope * ranks.log())


def engine_logits(rows: int, step: int = 8) -> torch.Tensor:
    """[rows, 49152] float32: the logits the engine sampled the `step`-th token of every row from (the first
    from the prefill), SmolLM2-135M-Instruct (the course's offline model) continuing `rows` passages of this
    project's README at temperature 0.6, top-p 0.95. A real model's rows, on its own vocabulary (not
    Qwen2.5's 151,936)."""
    import minikv.engine.core as core
    from minikv import LLM

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text().split()
    prompts = [" ".join(text[i * 24:i * 24 + 24]) for i in range(rows)]
    seen = []
    real = {name: getattr(core, name) for name in ("sample", "sample_on_device")}  # (plain and overlapped steps)

    def capture(name):
        def run(logits, params, keys):
            if logits.shape[0] == rows:  # a token of every sequence
                seen.append(logits.float().clone())
            return real[name](logits, params, keys)
        return run

    llm = LLM("smollm2-135m", max_num_seqs=rows)
    for name in real:
        setattr(core, name, capture(name))
    try:
        llm.generate(prompts, [SamplingParams(seed=i, max_tokens=step + 1, ignore_eos=True, **SAMPLED)
                               for i in range(rows)])
    finally:
        for name, f in real.items():
            setattr(core, name, f)
        llm.close()
    if len(seen) < step:
        raise RuntimeError(f"the engine sampled all {rows} rows in {len(seen)} steps, fewer than {step}")
    return seen[step - 1]


@contextlib.contextmanager
def top_p_path(name: str):
    """Top-p rows on the CPU take this path: "sorted" (`_sample_nucleus`, the reference), "blocks" or "c"."""
    saved = sampler.CPU_TOP_P
    sampler.CPU_TOP_P = name
    try:
        yield
    finally:
        sampler.CPU_TOP_P = saved


def reference_path():
    return top_p_path("sorted")


def reference_sample(logits, params, keys) -> list[int]:
    with reference_path():
        return sample(logits, params, keys)


def torch_path_sample(logits, params, keys) -> list[int]:
    with top_p_path("blocks"):
        return sample(logits, params, keys)


def nucleus_sizes(logits: torch.Tensor, params: SamplingParams) -> list[int]:
    return [int((filtered_probs(row, params) > 0).sum()) for row in logits]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--checks", type=int, default=32)
    ap.add_argument("--engine-rows", action="store_true",
                    help="a real model's rows instead: SmolLM2-135M's logits as the engine samples them "
                         "(its 49,152-token vocabulary; --vocab and --seed unused)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    logits = engine_logits(args.rows) if args.engine_rows else model_like_logits(args.rows, args.vocab, args.seed)
    args.vocab = logits.shape[-1]
    sampled = [SamplingParams(seed=i, **SAMPLED) for i in range(args.rows)]
    greedy = [SamplingParams() for _ in range(args.rows)]
    seeds = list(range(args.rows))
    sizes = sorted(nucleus_sizes(logits, sampled[0]))
    redone = []  # rows the block search leaves to the sorted path
    block_search = sampler._sample_nucleus

    def counting(scaled, *rest):
        redone.append(scaled.shape[0])
        return block_search(scaled, *rest)

    path = sampler._cpu_top_p_path(logits)
    equal, equal_torch, redone_torch = 0, 0, 0
    for position in range(args.checks):
        keys = draw_keys(seeds, [position] * args.rows)
        want = reference_sample(logits, sampled, keys)
        sampler._sample_nucleus = counting
        got = sample(logits, sampled, keys)
        mark = len(redone)
        got_torch = torch_path_sample(logits, sampled, keys)
        sampler._sample_nucleus = block_search
        redone_torch += sum(redone[mark:])
        del redone[mark:]
        equal += sum(a == b for a, b in zip(got, want))
        equal_torch += sum(a == b for a, b in zip(got_torch, want))
    total = args.checks * args.rows
    print(f"the sampler's path: {path}{'' if path == 'c' else f' ({cpu_topp.why_not()})'}; tokens equal to the "
          f"reference: {equal}/{total} ({sum(redone)} rows left to the sorted path), on the torch path "
          f"{equal_torch}/{total} ({redone_torch}); nucleus sizes min {sizes[0]}, median {sizes[len(sizes) // 2]}, "
          f"max {sizes[-1]}")
    assert equal == total and equal_torch == total, "the sampler's tokens differ from the reference's"

    keys = draw_keys(seeds, [0] * args.rows)
    buffer = torch.empty_like(logits)
    temperature = torch.full((args.rows,), SAMPLED["temperature"])
    runs = {"greedy": lambda: sample(logits, greedy, keys), "argmax": lambda: logits.argmax(-1).tolist(),
            "sampled": lambda: sample(logits, sampled, keys),
            "torch_path": lambda: torch_path_sample(logits, sampled, keys),
            "reference": lambda: reference_sample(logits, sampled, keys),
            "exp_pass": lambda: torch.exp(logits, out=buffer),
            "lse_pass": lambda: sampler._lse_and_block_max(logits, seeds, temperature)}
    results = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        times = {name: [] for name in runs}
        for _ in range(2):  # warm-up
            for run in runs.values():
                run()
        for r in range(args.repeats):
            order = list(runs) if r % 2 == 0 else list(reversed(runs))  # slow spells hit every path
            for name in order:
                start = time.perf_counter()
                runs[name]()
                times[name].append(time.perf_counter() - start)
        med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        row = {"threads": threads, "median_ms": med,
               "sampled_over_greedy": med["sampled"] / med["greedy"],
               "sampled_over_argmax": med["sampled"] / med["argmax"],
               "torch_path_over_greedy": med["torch_path"] / med["greedy"],
               "reference_over_argmax": med["reference"] / med["argmax"],
               "exp_pass_over_greedy": med["exp_pass"] / med["greedy"],
               "exp_pass_over_argmax": med["exp_pass"] / med["argmax"],
               "lse_pass_over_greedy": med["lse_pass"] / med["greedy"]}
        results.append(row)
        print(f"{threads} thread(s): greedy {med['greedy']:.1f} ms, argmax {med['argmax']:.1f} ms, sampled "
              f"{med['sampled']:.1f} ms ({row['sampled_over_greedy']:.2f}x greedy, "
              f"{row['sampled_over_argmax']:.2f}x argmax), torch path {med['torch_path']:.1f} ms "
              f"({row['torch_path_over_greedy']:.2f}x greedy), reference {med['reference']:.1f} ms "
              f"({row['reference_over_argmax']:.2f}x argmax), one exp pass {med['exp_pass']:.1f} ms, the sampler's "
              f"pass over the vocabulary {med['lse_pass']:.1f} ms")
    if args.out:
        record = {"environment": environment(), "date": time.strftime("%Y-%m-%d"),
                  "args": vars(args) | {"out": str(args.out)},
                  "logits": (engine_logits if args.engine_rows else model_like_logits).__doc__,
                  "sampling": SAMPLED,
                  "path": path, "tokens_equal_reference": [equal, total], "rows_left_to_sorted_path": sum(redone),
                  "torch_path_tokens_equal_reference": [equal_torch, total],
                  "torch_path_rows_left_to_sorted_path": redone_torch,
                  "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset)"),
                  "nucleus_sizes": {"min": sizes[0], "median": sizes[len(sizes) // 2], "max": sizes[-1]},
                  "load_average": list(os.getloadavg()), "results": results}
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
