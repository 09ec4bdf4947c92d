"""Many engines behind one router: prefix-cache hit rate and TTFT under cache_aware, round_robin and
least_loaded, on a multi-turn chat load from many users (each user's turns share a growing prefix).

    python benchmarks/router.py                              # CPU: 2 replicas of SmolLM2 (float32)
    python benchmarks/router.py --smoke                      # CPU, tiny-random, a few requests (a check)
    python benchmarks/router.py --device cuda --model random-qwen2.5-0.5b --users 64 --turns 6   # 2 GPUs

The replicas are `minikv serve` processes on loopback ports (one GPU each on a CUDA host with two);
the router runs in this process and the clients stream (/v1/completions with token ids: the same
load for any model). A conversation's next prompt is its last prompt + the answer's token ids + a new
user message, so each user's prefix grows turn by turn; every user shares a system prompt. Each policy
runs the same seeded load on the same replicas, under a cache salt of its own (no run finds another
run's blocks). TTFT is measured by the client: request sent -> first token chunk.

Writes a JSON record (device, versions, commit, workload, per-policy figures) and prints a table.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from minikv.serve.metrics import parse_metrics  # noqa: E402
from minikv.serve.router import POLICIES, Router, free_port, wait_healthy  # noqa: E402


def conversations(users: int, turns: int, system_len: int, first_len: int, turn_len: int, vocab: int,
                  seed: int) -> tuple[list[int], list[list[list[int]]]]:
    """The system prompt and, per user, the new message of each turn (token ids), seeded."""
    rng = random.Random(seed)
    system = [rng.randrange(100, vocab) for _ in range(system_len)]
    msgs = [[[rng.randrange(100, vocab) for _ in range(first_len if t == 0 else turn_len)] for t in range(turns)]
            for _ in range(users)]
    return system, msgs


async def run_policy(router_url: str, model: str, system: list[int], msgs, max_tokens: int, salt: str,
                     concurrency: int) -> list[dict]:
    """Every user's conversation, `concurrency` users at a time; one record per request."""
    records: list[dict] = []
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
        async def user(u: int) -> None:
            async with gate:
                history = list(system)
                for t, message in enumerate(msgs[u]):
                    prompt = history + message
                    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                            "return_token_ids": True, "cache_salt": salt}
                    start, first, answer, usage = time.perf_counter(), None, [], None
                    async with client.stream("POST", router_url + "/v1/completions", json=body) as resp:
                        if resp.status_code != 200:
                            raise RuntimeError(f"user {u}, turn {t} ({len(prompt)} prompt tokens): HTTP "
                                               f"{resp.status_code}: {(await resp.aread()).decode()[:300]}")
                        async for line in resp.aiter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            event = json.loads(line[6:])
                            if "error" in event:
                                raise RuntimeError(event["error"])
                            for c in event.get("choices") or []:
                                if c.get("token_ids"):
                                    first = first or time.perf_counter()
                                    answer += c["token_ids"]
                            usage = event.get("usage") or usage
                    if usage is None or first is None:
                        raise RuntimeError(f"user {u}, turn {t}: the stream ended without tokens or usage")
                    records.append({"user": u, "turn": t, "prompt_tokens": usage["prompt_tokens"],
                                    "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                                    "ttft_s": first - start})
                    history = prompt + answer
        await asyncio.gather(*(user(u) for u in range(len(msgs))))
    return records


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def python_path() -> str:
    """This checkout first, then whatever PYTHONPATH the caller set (packages installed beside it)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


def write_record(benchmark: str, args, results: dict, leave_out: tuple = ("out",), **extra) -> Path:
    """The run's JSON record (device, versions, commit, date, load average, `extra`, the workload's
    arguments but `leave_out`, the results) at --out, or benchmarks/<benchmark>_<smoke|cpu|cuda>.json."""
    record = {"benchmark": benchmark, "device": device_name(args.device), "versions": versions(), "commit": commit(),
              "date": time.strftime("%Y-%m-%d"),
              "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None, **extra,
              "workload": {k: v for k, v in vars(args).items() if k not in leave_out}, "results": results}
    out = args.out or ROOT / "benchmarks" / f"{benchmark}_{'smoke' if args.smoke else args.device.split(':')[0]}.json"
    out.write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(f"wrote {out}")
    return out


def resolve_model(name: str, device: str) -> str:
    """`random-<shape>` (random-qwen2.5-0.5b, random-llama-3.1-8b): a checkpoint of that shape with seeded
    random weights, written once to a temporary folder (bf16 on a GPU); any other name is served as given."""
    if not name.startswith("random-"):
        return name
    import tempfile

    import torch

    from minikv.bench.throughput import LLAMA31_8B_SHAPE, QWEN25_05B_SHAPE, make_random_checkpoint
    shapes = {"qwen2.5-0.5b": QWEN25_05B_SHAPE, "llama-3.1-8b": LLAMA31_8B_SHAPE}
    shape = name.removeprefix("random-")
    if shape not in shapes:
        raise SystemExit(f"unknown random shape {shape!r}: use one of {', '.join('random-' + s for s in shapes)}")
    cuda = device.startswith("cuda")
    path = make_random_checkpoint(shapes[shape], Path(tempfile.mkdtemp()) / shape,
                                  dtype=torch.bfloat16 if cuda else torch.float32, device="cuda" if cuda else "cpu")
    return str(path)


def start_replicas(n: int, model: str, device: str, num_blocks: int | None) -> tuple[list, list[str]]:
    procs, urls = [], []
    for i in range(n):
        port = free_port()
        env = dict(os.environ)
        if device.startswith("cuda"):
            env["CUDA_VISIBLE_DEVICES"] = str(i)
        cmd = [sys.executable, "-m", "minikv.cli", "serve", "--model", model, "--port", str(port), "--device",
               device.split(":")[0], "--log-level", "warning"]
        if device == "cpu":
            cmd += ["--no-engine-process", "--dtype", "float32"]
        if num_blocks:
            cmd += ["--num-blocks", str(num_blocks)]
        procs.append(subprocess.Popen(cmd, env={**env, "PYTHONPATH": python_path()}))
        urls.append(f"http://127.0.0.1:{port}")
    wait_healthy(procs, urls, 900, poll_s=0.5)
    return procs, urls


def versions() -> dict:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("triton", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001
            out[name] = None
    return out


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return sha + ("+uncommitted" if dirty else "")
    except Exception:  # noqa: BLE001
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--users", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4, help="users in conversation at once")
    ap.add_argument("--system-len", type=int, default=128)
    ap.add_argument("--first-len", type=int, default=96)
    ap.add_argument("--turn-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=10000)
    ap.add_argument("--num-blocks", type=int, default=None)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny-random, 4 users x 2 turns: checks the plumbing")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.users, args.turns, args.concurrency, args.vocab = "tiny-random", 4, 2, 2, 500
        args.system_len, args.first_len, args.turn_len, args.max_tokens = 32, 32, 16, 4
    policies = args.policies.split(",")
    for p in policies:
        if p not in POLICIES:
            ap.error(f"unknown policy {p!r}; choose from {', '.join(POLICIES)}")
    system, msgs = conversations(args.users, args.turns, args.system_len, args.first_len, args.turn_len, args.vocab,
                                 args.seed)
    args.model = resolve_model(args.model, args.device)
    procs, urls = start_replicas(args.replicas, args.model, args.device, args.num_blocks)
    results = {}
    try:
        # warm every replica first (kernels compiled, graphs captured), under a salt no policy uses:
        # otherwise the first policy's first turns pay it and its p99 says nothing about routing
        wsys, wmsgs = conversations(2 * args.replicas, 2, args.system_len, args.first_len, args.turn_len, args.vocab,
                                    args.seed + 1)
        with Router(urls, "round_robin") as router:
            asyncio.run(run_policy(router.url, args.model, wsys, wmsgs, args.max_tokens, "warm-up",
                                   args.concurrency))
        for policy in policies:
            with Router(urls, policy) as router:
                t0 = time.perf_counter()
                records = asyncio.run(run_policy(router.url, args.model, system, msgs, args.max_tokens,
                                                 f"run-{policy}-{args.seed}", args.concurrency))
                wall = time.perf_counter() - t0
                m = parse_metrics(httpx.get(router.url + "/metrics", trust_env=False).text)
            ttft = [r["ttft_s"] for r in records]
            per_replica = {k.split('"')[1]: int(v) for k, v in m.items()
                           if k.startswith("minikv:router_requests_total")}
            later = [r for r in records if r["turn"] > 0]
            results[policy] = {
                "requests": len(records), "wall_s": wall,
                "hit_rate": sum(r["cached_tokens"] for r in records) / sum(r["prompt_tokens"] for r in records),
                "hit_rate_later_turns": (sum(r["cached_tokens"] for r in later) / sum(r["prompt_tokens"] for r in later)
                                         if later else None),
                "ttft_p50_s": statistics.median(ttft), "ttft_p99_s": pct(ttft, 0.99),
                "requests_per_replica": per_replica, "balanced": int(m.get("minikv:router_balanced_total", 0)),
                "records": records}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=60)
    print(f"{'policy':>14} {'hit rate':>9} {'later turns':>12} {'TTFT p50':>9} {'TTFT p99':>9}  requests per replica")
    for policy, r in results.items():
        later = f"{r['hit_rate_later_turns']:.0%}" if r["hit_rate_later_turns"] is not None else "-"
        print(f"{policy:>14} {r['hit_rate']:>9.0%} {later:>12} {r['ttft_p50_s']:>8.3f}s {r['ttft_p99_s']:>8.3f}s  "
              f"{sorted(r['requests_per_replica'].values())}")
    write_record("router", args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
