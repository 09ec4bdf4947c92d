"""The host's work to prepare a step's sampled rows, with and without the draw plan the overlapped step keeps.

    python benchmarks/draw_plan_cpu.py [--seqs 218] [--out benchmarks/draw_plan_cpu.json]

Every step that samples must know which rows draw and of which kind, pack their temperature, top-p,
top-k, row and draw key into the array the sampling kernel reads, and compute the keys (a hash of each
row's seed and position). All but the keys depend on the batch's params alone, and a running decode
batch keeps its sequences from one step to the next. So the engine's overlapped step keeps that part
(`EngineCore._draws`, `minikv.engine.sampler.DrawPlan`) while the batch's sequences stay the same.

This script times, on a steady batch of --seqs sequences sampling at temperature 0.6 and top-p 0.95
(the serve workload's), a plan made afresh with its keys (`_keys`, then `DrawPlan`: what a step pays
when its batch has changed, and about what every step paid before plans were kept) against the kept
plan (`_draws`), after checking that both pack the same rows. The model is stubbed out: only the
host's work is timed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import timeit
from pathlib import Path

if __name__ == "__main__":  # run as a script: minikv from this checkout, installed or not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(seqs: int, steps: int = 6, number: int = 300) -> dict:
    import torch

    import minikv.engine.core as core_mod
    from minikv import LLM, SamplingParams
    from minikv.bench import load_script
    from minikv.engine.sampler import DrawPlan

    StubModel = load_script(Path(__file__).with_name("host_step_cpu.py")).StubModel  # noqa: N806

    llm = LLM("tiny-random", kv_backend="paged", device="cpu", max_num_seqs=seqs, block_size=16,
              num_blocks=seqs * 40 + 2048, max_num_batched_tokens=16384, max_model_len=2048)
    llm.async_scheduling = True
    core = llm.core
    core.runner.model = StubModel(core.runner.model, 512)
    params = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0.6, top_p=0.95)
    for i in range(seqs):
        llm.add_request([(7 * i + 3 * j) % 500 + 3 for j in range(200)], params)
    for _ in range(steps):  # the prefill, then decodes: the batch is steady
        core.step()
    batch = list(core.scheduler.running)

    def fresh():
        keys = core_mod._keys(batch)
        return DrawPlan([s.params for s in batch]).packed(keys)

    def kept():
        plan, keys = core._draws(batch)
        return plan.packed(keys)

    if not torch.equal(fresh(), kept()):
        raise AssertionError("the kept plan packs other rows than a fresh one")
    us = {name: min(timeit.repeat(f, number=number, repeat=5)) / number * 1e6 for name, f in
          (("fresh", fresh), ("kept", kept))}
    llm.close()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), None) if Path("/proc/cpuinfo").exists() else None
    return {"seqs": seqs, "torch": torch.__version__, "cpu": cpu, "threads": torch.get_num_threads(),
            "loadavg": os.getloadavg(), "us_per_step": {k: round(v, 1) for k, v in us.items()},
            "saved_us": round(us["fresh"] - us["kept"], 1)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, default=218)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    r = run(args.seqs)
    print(f"[draw plan] {r['seqs']} sampled rows: a fresh plan and keys {r['us_per_step']['fresh']} us a step, "
          f"the kept plan {r['us_per_step']['kept']} us (saves {r['saved_us']} us)")
    if args.out:
        Path(args.out).write_text(json.dumps(r, indent=1) + "\n")
    return r


if __name__ == "__main__":
    main()
