"""Where a CPU decode token's time goes, minikv against transformers `generate`, same workload as
benchmarks/cpu_single_stream.py (SmolLM2-135M float32, 128-token prompt, greedy, 1 torch thread).

    OMP_NUM_THREADS=1 python benchmarks/cpu_decode_breakdown.py --out benchmarks/cpu_decode_breakdown.json

Both models name their modules alike (`model.layers.3.self_attn.q_proj`, ...), so one set of forward
hooks times the same parts of each, per decode step (the wall time between two tokens):

    linear          every nn.Linear (the seven of each layer and the LM head): the weights' traffic
    attention core  self_attn minus its four linears: rotary embedding, KV cache write and read, SDPA
    norms           the RMSNorms
    rest of model   the model's call minus the above: embedding, residual adds, SiLU * up, module calls
    outside model   the step minus the model's call: scheduling, batch tensors, sampling, detokenizing
                    (minikv); input preparation, logits processors, stopping criteria (transformers)

The hooks add a few microseconds per module call to both engines alike. Medians over the decode
steps of --repeats runs of each engine, taking turns.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from minikv.bench import environment
from minikv.bench.cache_speedup import prompt_ids


class PartTimer:
    """Forward hooks that add each timed module's wall time to its part."""

    def __init__(self, model: nn.Module):
        self.total: dict[str, float] = defaultdict(float)
        self.started: dict[int, float] = {}
        for name, module in model.named_modules():
            part = ("model" if module is model else "attention linear" if isinstance(module, nn.Linear) and
                    ".self_attn." in name else "other linear" if isinstance(module, nn.Linear) else
                    "self_attn" if name.endswith("self_attn") else "norms" if name.endswith("norm") else None)
            if part is not None:
                module.register_forward_pre_hook(self._start)
                module.register_forward_hook(lambda m, args, out, part=part: self._stop(m, part))

    def _start(self, module, args) -> None:
        self.started[id(module)] = time.perf_counter()

    def _stop(self, module, part: str) -> None:
        self.total[part] += time.perf_counter() - self.started.pop(id(module))

    def snapshot(self) -> dict[str, float]:
        return dict(self.total)


def parts_of_step(before: dict, after: dict, wall: float) -> dict[str, float]:
    """One step's parts in ms, from two snapshots of the timer and the step's wall time (s)."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ("model", "attention linear", "other linear",
                                                            "self_attn", "norms")}
    linear = d["attention linear"] + d["other linear"]
    core = d["self_attn"] - d["attention linear"]
    parts = {"step": wall, "linear": linear, "attention core": core, "norms": d["norms"],
             "rest of model": d["model"] - linear - core - d["norms"], "outside model": wall - d["model"]}
    return {k: 1000 * v for k, v in parts.items()}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, GenerationConfig

    from minikv import LLM, SamplingParams
    from minikv.model.named import prepare_smollm2

    llm = LLM("smollm2-135m", device="cpu", dtype="float32")
    ids = prompt_ids(llm.tokenizer, args.prompt_len)
    hf = AutoModelForCausalLM.from_pretrained(prepare_smollm2(), dtype=torch.float32).eval()
    timers = {"minikv": PartTimer(llm.model), "transformers": PartTimer(hf)}
    n = args.new_tokens

    def ours(mark) -> None:
        for _ in llm.stream([ids], SamplingParams(max_tokens=n, ignore_eos=True)):
            mark()

    def theirs(mark) -> None:
        class Streamer:  # put() gets the prompt first, then each new token
            calls = 0

            def put(self, value):
                self.calls += 1
                if self.calls > 1:
                    mark()

            def end(self):
                pass

        cfg = GenerationConfig(max_new_tokens=n, min_new_tokens=n, pad_token_id=0, do_sample=False)
        with torch.no_grad():
            hf.generate(torch.tensor([ids]), generation_config=cfg, streamer=Streamer())

    engines = {"minikv": ours, "transformers": theirs}
    steps: dict[str, list[dict]] = {e: [] for e in engines}
    for r in range(args.repeats + 1):  # the first round warms up
        for engine in (engines if r % 2 == 0 else reversed(engines)):
            timer, marks = timers[engine], []
            engines[engine](lambda: marks.append((time.perf_counter(), timer.snapshot())))
            if r > 0:  # marks[0] is the first token (prefill); each later interval is one decode step
                steps[engine] += [parts_of_step(a[1], b[1], b[0] - a[0]) for a, b in zip(marks[1:], marks[2:])]
    record = {"benchmark": "CPU decode token breakdown", **environment("cpu"), "load_average": os.getloadavg(),
              "model": "SmolLM2-135M-Instruct float32", "prompt_tokens": len(ids), "new_tokens": n,
              "repeats": args.repeats, "median_ms_per_decode_token": {
                  engine: {part: round(statistics.median(s[part] for s in ss), 2) for part in ss[0]}
                  for engine, ss in steps.items()}}
    print(json.dumps(record, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()
