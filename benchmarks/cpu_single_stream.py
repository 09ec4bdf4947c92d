"""CPU, one request at a time: minikv's contiguous cache (the CPU default) against transformers
`generate`, greedy and sampled (temperature 0.6, top-p 0.95), in one process.

    OMP_NUM_THREADS=1 python benchmarks/cpu_single_stream.py --out benchmarks/cpu_single_stream.json

SmolLM2-135M-Instruct in float32, cache_speedup's English prompt tiled to --prompt-len tokens,
--new-tokens new tokens, EOS ignored, --threads torch threads (default 1: a shared 2-core machine).
Each run is timed token by token as the caller receives them (minikv: `LLM.stream`; transformers: a
streamer), on the wall clock and on the process's CPU time, and split into

    prefill   call -> first token (the prompt's forward and the first sample)
    decode    the median time between two later tokens (one decode step each)

The two engines take turns --repeats rounds (minikv first in even rounds, transformers first in odd
ones); each round gives a paired ratio, so slow spells of a shared machine hit both engines. CPU
time leaves out the time the process waits for a core; the record also says how many cores the
rest of the machine kept busy meanwhile (/proc/stat). Greedy tokens of the two engines must be
equal; the record says whether they are.
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


def clocks() -> tuple[float, float]:
    """(wall, this process's CPU time) in seconds."""
    return time.perf_counter(), time.process_time()


class Streamer:
    """transformers' streamer protocol: `put` gets the prompt first, then each new token."""

    def __init__(self, marks: list):
        self.marks, self.seen_prompt = marks, False

    def put(self, value) -> None:
        if self.seen_prompt:
            self.marks.append(clocks())
        self.seen_prompt = True

    def end(self) -> None:
        pass


def split(marks: list[tuple[float, float]]) -> dict:
    """marks: the clocks at the call and after each token -> one run's figures (seconds)."""
    wall = [b[0] - a[0] for a, b in zip(marks, marks[1:])]
    cpu = [b[1] - a[1] for a, b in zip(marks, marks[1:])]
    return {"seconds": marks[-1][0] - marks[0][0], "cpu_seconds": marks[-1][1] - marks[0][1],
            "prefill_s": wall[0], "prefill_cpu_s": cpu[0],
            "decode_s": statistics.median(wall[1:]), "decode_cpu_s": statistics.median(cpu[1:])}


def machine_clock() -> tuple[float, float, float, float]:
    """(wall, CPU seconds every core of the machine was busy, of them stolen by the hypervisor, ours)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = fields[:8]
    hz, own = os.sysconf("SC_CLK_TCK"), os.times()
    return (time.perf_counter(), (user + nice + system + irq + softirq + steal) / hz, steal / hz,
            own.user + own.system)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=10, help="rounds; each runs all four once")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.new_tokens < 2:
        raise SystemExit("--new-tokens must be at least 2: one for the prefill, the rest for decode steps")
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, GenerationConfig

    from minikv import LLM, SamplingParams
    from minikv.model.named import prepare_smollm2

    llm = LLM("smollm2-135m", device="cpu", dtype="float32")
    ids = prompt_ids(llm.tokenizer, args.prompt_len)
    hf = AutoModelForCausalLM.from_pretrained(prepare_smollm2(), dtype=torch.float32).eval()
    n = args.new_tokens

    def ours(sampled: bool) -> tuple[list, list[int]]:
        params = SamplingParams(max_tokens=n, ignore_eos=True, seed=0, **(SAMPLED if sampled else {}))
        marks, tokens = [clocks()], []
        for event in llm.stream([ids], params):
            marks.append(clocks())
            tokens.append(event.token_id)
        return marks, tokens

    def theirs(sampled: bool) -> tuple[list, list[int]]:
        cfg = GenerationConfig(max_new_tokens=n, min_new_tokens=n, pad_token_id=0,
                               **({"do_sample": True, "top_k": 0, **SAMPLED} if sampled else {"do_sample": False}))
        marks = [clocks()]
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), generation_config=cfg, streamer=Streamer(marks))
        return marks, out[0, len(ids):].tolist()

    engines = {"minikv": ours, "transformers": theirs}
    for fn in engines.values():  # warm up
        fn(False), fn(True)
    runs: dict[str, list[dict]] = {f"{e} {m}": [] for m in ("greedy", "sampled") for e in engines}
    tokens: dict[str, list[int]] = {}
    load_before, start = os.getloadavg(), machine_clock()
    for r in range(args.repeats):
        for mode in ("greedy", "sampled"):
            for engine in (engines if r % 2 == 0 else reversed(engines)):
                name = f"{engine} {mode}"
                marks, tokens[name] = engines[engine](mode == "sampled")
                runs[name].append(split(marks))
        print(f"round {r + 1}/{args.repeats}: " + ", ".join(
            f"{name} {n / rs[-1]['seconds']:.2f} tok/s" for name, rs in runs.items()), flush=True)
    end = machine_clock()
    wall = end[0] - start[0]
    record = {"benchmark": "CPU single stream, greedy and sampled, prefill and decode apart", **environment("cpu"),
              "load_average_before": load_before, "load_average_after": os.getloadavg(),
              # cores the rest of the machine kept busy while we ran (ours taken out), and the hypervisor's steal
              "other_busy_cores": round((end[1] - start[1] - (end[3] - start[3])) / wall, 2),
              "steal_cores": round((end[2] - start[2]) / wall, 2),
              "model": "SmolLM2-135M-Instruct float32", "prompt_tokens": len(ids), "new_tokens": n,
              "sampled": SAMPLED, "repeats": args.repeats,
              "greedy_tokens_identical": tokens["minikv greedy"] == tokens["transformers greedy"], "runs": {}}
    med = lambda rs, key: statistics.median(r[key] for r in rs)  # noqa: E731
    for name, rs in runs.items():
        record["runs"][name] = {
            "median_tok_s": round(n / med(rs, "seconds"), 2), "best_tok_s": round(n / min(r["seconds"] for r in rs), 2),
            "median_tok_s_cpu_time": round(n / med(rs, "cpu_seconds"), 2),
            "prefill_ms": round(1000 * med(rs, "prefill_s"), 1),
            "prefill_cpu_ms": round(1000 * med(rs, "prefill_cpu_s"), 1),
            "decode_ms_per_token": round(1000 * med(rs, "decode_s"), 2),
            "decode_cpu_ms_per_token": round(1000 * med(rs, "decode_cpu_s"), 2),
            "each_run": [{k: round(v, 4) for k, v in r.items()} for r in rs]}
    record["minikv_over_transformers"] = {}  # > 1: minikv faster
    for mode in ("greedy", "sampled"):
        ours_, theirs_ = runs[f"minikv {mode}"], runs[f"transformers {mode}"]
        paired = lambda key: round(statistics.median(t[key] / o[key] for o, t in zip(ours_, theirs_)), 3)  # noqa: E731
        record["minikv_over_transformers"][mode] = {
            "tok_s_paired_median": paired("seconds"), "tok_s_cpu_time_paired_median": paired("cpu_seconds"),
            "prefill_speed_paired_median": paired("prefill_s"), "decode_speed_paired_median": paired("decode_s"),
            "decode_speed_cpu_time_paired_median": paired("decode_cpu_s"),
            "rounds_minikv_faster": sum(o["seconds"] < t["seconds"] for o, t in zip(ours_, theirs_))}
    summary = {k: v for k, v in record.items() if k != "runs"}
    summary["runs"] = {name: {k: v for k, v in r.items() if k != "each_run"} for name, r in record["runs"].items()}
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()
