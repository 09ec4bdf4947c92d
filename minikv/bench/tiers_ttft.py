"""Time to first token on a multi-turn chat whose history no longer fits the pool: offload tiers off
(recompute), a CPU tier, a disk tier, and a fresh engine on the warm directory.

    python -m minikv.bench.tiers_ttft --threads 1                          CPU, SmolLM2 (the recorded run)
    python -m minikv.bench.tiers_ttft --model random-qwen2.5-0.5b --device cuda \\
        --out benchmarks/tiers_ttft_gpu.json                               GPU, Qwen2.5-0.5B shapes, bf16
    python -m minikv.bench.tiers_ttft --doc-len 48 --users 2 --turns 2 --no-record       a quick try

The workload: `users` conversations, each on its own `doc_len`-token document, take turns one
request at a time (user 0 turn 1, user 1 turn 1, ..., user 0 turn 2, ...). Each prompt is the whole
history: document, earlier questions and answers, the new question. The pool holds about one
history, so when a user comes back the others have evicted theirs:

    off     recomputes the history                        (prefix caching on, no tiers)
    cpu     copies it back from the CPU tier               (kv_offload_cpu_bytes)
    disk    reads it back from files                       (kv_offload_dir)
    warm    a NEW engine on the disk engine's directory, replaying every user's last prompt, against
            `off` replaying the same prompts in the same phase (the cold start of a restarted server)

The engines take each request in turn (off, cpu, disk, off, cpu, ...), so a busy machine slows them
alike. Recorded: TTFT of every request, medians (with min and max) over the returning turns, prompt
tokens computed (a count that does not depend on load), bytes copied back and the bandwidth of the
copies, and whether every engine produced the same tokens.
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
from minikv.bench.prefix_ttft import model_path

QUESTIONS = ["What is this text about?", "Which memory does it describe?", "Why does the cache grow?",
             "Name one trade-off.", "What changes once keys are computed?", "Summarise it in one sentence."]


def conversation_parts(tokenizer, vocab: int, users: int, doc_len: int, question_len: int, turns: int):
    """Each user's document and questions (token ids), distinct per user."""
    g = torch.Generator().manual_seed(0)
    docs, questions = [], []
    for u in range(users):
        if tokenizer is not None:
            ids = prompt_ids(tokenizer, doc_len + 97 * u)[97 * u:]
            qs = [(tokenizer.encode(f" User {u}: " + QUESTIONS[(u + t) % len(QUESTIONS)], add_special_tokens=False)
                   * question_len)[:question_len] for t in range(turns)]
        else:
            ids = torch.randint(0, min(vocab, 10000), (doc_len,), generator=g).tolist()
            qs = [torch.randint(0, min(vocab, 10000), (question_len,), generator=g).tolist() for _ in range(turns)]
        docs.append(ids)
        questions.append(qs)
    return docs, questions


def median_spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else {}


def offload_figures(llm) -> dict:
    pc = llm.stats()["prefix_cache"]
    off = pc.get("offload", {})
    return {"hits_by_tier": pc.get("hits_by_tier", {"pool": pc["hits"]}), "hit_rate": pc["hit_rate"],
            "evicted_blocks": pc["evicted_blocks"], "bytes_in": off.get("bytes_in", 0),
            "bytes_out": off.get("bytes_out", 0), "load_seconds": off.get("load_seconds", 0.0),
            "load_bandwidth_GBps": off["bytes_in"] / off["load_seconds"] / 1e9 if off.get("load_seconds") else None,
            "corrupt_files": off.get("tiers", {}).get("disk", {}).get("corrupt_files", 0)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="smollm2-135m, random-qwen2.5-0.5b, or a checkpoint")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--users", type=int, default=3)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--doc-len", type=int, default=256)
    ap.add_argument("--question-len", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--attention", default="torch", choices=["torch", "triton"])
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--commit", default=None, help="record this commit (a copy of the tree without .git)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "tiers_ttft_cpu.json"))
    ap.add_argument("--no-record", action="store_true", help="print the record, write nothing")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from minikv import LLM, SamplingParams

    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    bs = args.block_size
    longest = args.doc_len + args.turns * (args.question_len + args.max_tokens)
    num_blocks = -(-longest // bs) + 4  # one history and a little: a returning user finds it evicted
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        path = model_path(args.model, Path(tmp))
        kv_dir = str(Path(tmp) / "kv")
        common = dict(device=args.device, dtype=dtype, kv_backend="paged", max_num_seqs=1, block_size=bs,
                      num_blocks=num_blocks, max_model_len=num_blocks * bs, attention=args.attention,
                      prefix_caching="hash", cuda_graphs=False)
        off = LLM(path, **common)
        block_bytes = off.view.block_bytes
        cpu_budget = (args.users + 1) * num_blocks * block_bytes
        engines = {"off": off, "cpu": off.derive(kv_offload_cpu_bytes=cpu_budget),
                   "disk": off.derive(kv_offload_dir=kv_dir, kv_offload_disk_bytes=4 * cpu_budget)}
        docs, questions = conversation_parts(off.tokenizer, off.config.vocab_size, args.users, args.doc_len,
                                             args.question_len, args.turns)
        sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        warm_prompt = list(range(1, 2 * bs + 2))
        for llm in engines.values():  # warm-up on an unrelated short prompt, then empty caches and counters
            llm.generate(warm_prompt, SamplingParams(max_tokens=2, ignore_eos=True))
            llm.reset_prefix_cache()
        runs = {k: [] for k in list(engines) + ["warm", "off_after_restart"]}
        history = [list(d) for d in docs]

        def run(name: str, llm, prompt: list[int], user: int, turn: int) -> list[int]:
            before = offload_figures(llm)["bytes_in"] if llm.offload_store is not None else 0
            out = llm.generate(prompt, sp)[0]
            moved = (offload_figures(llm)["bytes_in"] if llm.offload_store is not None else 0) - before
            runs[name].append({"user": user, "turn": turn, "prompt_tokens": len(prompt),
                               "computed_tokens": len(prompt) - out.num_cached_tokens,
                               "ttft_s": out.time_to_first_token,
                               "bytes_in": moved, "tokens": out.token_ids})
            print(f"[tiers_ttft] user {user} turn {turn} {name:17s} ttft {out.time_to_first_token:7.3f} s, "
                  f"{len(prompt)} tokens, {out.num_cached_tokens} cached, {moved / 2**20:.1f} MiB in", flush=True)
            gc.collect()
            return out.token_ids

        for turn in range(args.turns):
            for u in range(args.users):
                prompt = history[u] + questions[u][turn]
                answers = [run(k, llm, prompt, u, turn) for k, llm in engines.items()]
                history[u] = prompt + answers[0]
        figures = {k: offload_figures(llm) for k, llm in engines.items()}
        engines["disk"].close()
        # restart: a fresh engine on the warm directory; `off` replays the same prompts beside it
        warm = off.derive(kv_offload_dir=kv_dir, kv_offload_disk_bytes=4 * cpu_budget)
        warm.generate(warm_prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        off.reset_prefix_cache()
        for u in range(args.users):
            prompt = history[u][:-args.max_tokens]  # the user's last prompt, as sent
            run("warm", warm, prompt, u, args.turns - 1)
            run("off_after_restart", off, prompt, u, args.turns - 1)
        figures["warm"] = offload_figures(warm)
        warm.close()

    results = {}
    for k, rs in runs.items():
        back = [r for r in rs if r["turn"] > 0 or k in ("warm", "off_after_restart")]
        results[k] = {"requests": [{x: r[x] for x in r if x != "tokens"} for r in rs],
                      "returning_ttft_s": median_spread([r["ttft_s"] for r in back]),
                      "first_turn_ttft_s": median_spread([r["ttft_s"] for r in rs if r["turn"] == 0
                                                          and k not in ("warm", "off_after_restart")]),
                      "computed_tokens_returning": sum(r["computed_tokens"] for r in back),
                      "prompt_tokens_returning": sum(r["prompt_tokens"] for r in back),
                      **({"offload": figures[k]} if k in figures else {})}
    base = results["off"]["returning_ttft_s"]["median"]
    speedup = {k: base / results[k]["returning_ttft_s"]["median"] for k in ("cpu", "disk")}
    speedup["warm"] = (results["off_after_restart"]["returning_ttft_s"]["median"]
                       / results["warm"]["returning_ttft_s"]["median"])
    same = {k: [r["tokens"] for r in runs[k]] == [r["tokens"] for r in runs["off"]] for k in ("cpu", "disk")}
    same["warm"] = [r["tokens"] for r in runs["warm"]] == [r["tokens"] for r in runs["off_after_restart"]]
    record = {
        "benchmark": "tiers_ttft",
        "date": datetime.date.today().isoformat(),
        **environment(args.device, args.commit),
        "load_average_1min": {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2)},
        "workload": {"model": args.model, "dtype": dtype, "device": args.device, "attention": args.attention,
                     "users": args.users, "turns": args.turns, "doc_tokens": args.doc_len,
                     "question_tokens": args.question_len, "max_tokens": args.max_tokens, "block_size": bs,
                     "num_blocks": num_blocks, "block_bytes": block_bytes, "cpu_tier_bytes": cpu_budget,
                     "one request at a time": True, "engines interleaved request by request": True},
        "results": results,
        "speedup_returning_ttft_median": speedup,
        "tokens_identical_to_recompute": same,
    }
    print(json.dumps({k: v for k, v in record.items() if k != "results"}, indent=1))
    if args.no_record:
        return 0
    write_record(record, Path(args.out), results_line(record, Path(args.out).name), "tiers_ttft")
    return 0 if all(same.values()) else 1


def results_line(rec: dict, json_name: str) -> str:
    w, r, s = rec["workload"], rec["results"], rec["speedup_returning_ttft_median"]
    same = "identical" if all(rec["tokens_identical_to_recompute"].values()) else "NOT identical (see JSON)"
    threads = f", {rec['torch_threads']} torch threads" if w["device"] == "cpu" else ""

    def t(k):
        return f"{r[k]['returning_ttft_s']['median']:.3f} s"

    bw = r["disk"]["offload"]["load_bandwidth_GBps"]
    return (f"- {rec['date']} · tiers_ttft · {rec['device']}{threads} · {w['model']} {w['dtype']}, "
            f"{w['users']} users x "
            f"{w['turns']} turns, {w['doc_tokens']}-token documents, pool of {w['num_blocks']} blocks (one history) · "
            f"median TTFT of returning turns: recompute {t('off')}, CPU tier {t('cpu')} (**{s['cpu']:.1f}x**), "
            f"disk tier {t('disk')} (**{s['disk']:.1f}x**); after a restart, fresh engine on the warm directory "
            f"{t('warm')} against recompute {t('off_after_restart')} (**{s['warm']:.1f}x**); prompt tokens computed "
            f"on returning turns: recompute {r['off']['computed_tokens_returning']:,}, CPU "
            f"{r['cpu']['computed_tokens_returning']:,}, disk {r['disk']['computed_tokens_returning']:,}; "
            f"copies back: CPU {r['cpu']['offload']['bytes_in'] / 2**20:.0f} MiB, disk "
            f"{r['disk']['offload']['bytes_in'] / 2**20:.0f} MiB"
            + (f" at {bw:.2f} GB/s" if bw else "") + f" · tokens {same} · commit {rec['commit']} · "
            f"[{json_name}]({json_name})\n")


if __name__ == "__main__":
    raise SystemExit(main())
