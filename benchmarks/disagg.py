"""Prefill and decode on separate engines against one colocated engine: a few long prompts among many
short chats. What disaggregation buys is the short chats' inter-token latency (no long prefill in their
steps); what it costs is the long prompts' time to first token (a transfer, one prefill engine).

    python benchmarks/disagg.py --device cuda --model random-qwen2.5-0.5b     # 2 GPUs: 1 prefill + 1 decode
    python benchmarks/disagg.py --smoke                                       # CPU, tiny-random: the plumbing
    python benchmarks/disagg.py --cpu --base /tmp/disagg_base                 # CPU: this tree's pair against another's

--cpu: tiny-random (float32) on the CPU, short chats arriving faster than a prefill server that runs one
prompt at a time and sends ~8 blocking messages per transfer can serve (its queue grows without bound);
the question is whether the prefill side keeps up with its load, not what a model's FLOPs cost. --base DIR
runs the disaggregated pair a second time with the servers of the tree at DIR (`git archive main | tar -x
-C DIR`), in the same run; the colocated engine and the router in front are this tree's.

Colocated: one `minikv serve` on GPU 0 (chunked prefill, its default token budget). Disaggregated:
`minikv serve --role prefill` on GPU 0 and `--role decode` on GPU 1 (KV blocks over NCCL; gloo on CPUs),
`minikv route --prefill URL --decode URL` in front (in this process; the colocated engine has a router in
front too, so both pay the same hop). Every engine runs in its server's
process (--no-engine-process) on both sides, so the comparison is like for like. The load is seeded:
`short` chats of `short_len` prompt tokens streaming `short_out` tokens, and `long` prompts of
`long_len` tokens arriving among them; the clients stream and time every token (tokens that arrive in
one server-sent chunk count a gap of 0: on a tiny model whose steps take a millisecond, most do).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from router import pct, python_path, resolve_model, write_record  # noqa: E402

from minikv.serve.router import Router, free_port, wait_healthy  # noqa: E402


def start(cmd: list[str], gpu: int | None, url: str, tree: Path = ROOT) -> subprocess.Popen:
    """`minikv serve` from the tree at `tree` (its folder first on the path, and the working directory)."""
    path = python_path() if tree == ROOT else os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH"))
                                                              if p)
    env = {**os.environ, "PYTHONPATH": path}
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    return subprocess.Popen([sys.executable, "-m", "minikv.cli", "serve", *cmd], env=env, cwd=tree)


def wait_up(procs: list[subprocess.Popen], urls: list[str], timeout: float = 900) -> None:
    wait_healthy(procs, urls, timeout, poll_s=0.5)


def load(args) -> list[dict]:
    """Seeded requests: (send_at, prompt ids, max_tokens, kind), short chats with long prompts among them."""
    rng = random.Random(args.seed)
    reqs, t = [], 0.0
    long_at = sorted(rng.uniform(0.2, 0.8) * args.short / args.rate for _ in range(args.long))
    for _ in range(args.short):
        t += rng.expovariate(args.rate)
        reqs.append({"at": t, "ids": [rng.randrange(100, args.vocab) for _ in range(args.short_len)],
                     "max_tokens": args.short_out, "kind": "short"})
    for at in long_at:
        reqs.append({"at": at, "ids": [rng.randrange(100, args.vocab) for _ in range(args.long_len)],
                     "max_tokens": args.long_out, "kind": "long"})
    return sorted(reqs, key=lambda r: r["at"])


async def replay(url: str, model: str, reqs: list[dict]) -> list[dict]:
    out: list[dict] = []
    async with httpx.AsyncClient(timeout=1800, trust_env=False) as client:
        t0 = time.perf_counter()

        async def one(r: dict) -> None:
            await asyncio.sleep(max(0.0, r["at"] - (time.perf_counter() - t0)))
            body = {"model": model, "prompt": r["ids"], "max_tokens": r["max_tokens"], "temperature": 0,
                    "ignore_eos": True, "stream": True, "return_token_ids": True,
                    "stream_options": {"include_usage": True}}
            start, times, usage = time.perf_counter(), [], None
            async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        event = json.loads(line[6:])
                        if "error" in event:
                            raise RuntimeError(event["error"])
                        n = sum(len(c.get("token_ids") or []) for c in event.get("choices") or [])
                        times += [time.perf_counter()] * n
                        usage = event.get("usage") or usage
            if usage is None or not times:
                raise RuntimeError(f"a {r['kind']} request's stream ended without tokens or usage")
            out.append({"kind": r["kind"], "ttft_s": times[0] - start, "prompt_tokens": usage["prompt_tokens"],
                        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                        "itls": [b - a for a, b in zip(times, times[1:])], "tokens": len(times)})
        await asyncio.gather(*(one(r) for r in reqs))
    return out


def summary(results: list[dict], wall_s: float) -> dict:
    short = [r for r in results if r["kind"] == "short"]
    long = [r for r in results if r["kind"] == "long"]
    itls = [x for r in short for x in r["itls"]]
    return {"short_itl_p50_s": statistics.median(itls), "short_itl_p99_s": pct(itls, 0.99),
            "short_ttft_p50_s": statistics.median(r["ttft_s"] for r in short),
            "short_ttft_p99_s": pct([r["ttft_s"] for r in short], 0.99),
            "long_ttft_p50_s": statistics.median(r["ttft_s"] for r in long) if long else None,
            "long_ttft_max_s": max(r["ttft_s"] for r in long) if long else None,
            "requests": len(results), "tokens": sum(r["tokens"] for r in results), "wall_s": wall_s,
            # prompt tokens the decoding engine did not compute (its prefix cache, or blocks it was sent)
            "cached_fraction": sum(r["cached_tokens"] for r in results) / sum(r["prompt_tokens"] for r in results)}


def measure(url: str, model: str, reqs: list[dict]) -> dict:
    asyncio.run(replay(url, model, reqs[:2]))  # warm up
    t0 = time.perf_counter()
    results = asyncio.run(replay(url, model, reqs))
    return summary(results, time.perf_counter() - t0)


def disaggregated(args, common: list[str], reqs: list[dict], gpu: bool, tree: Path) -> dict:
    """The prefill/decode pair from `tree`, a router in front; the prefill server's counters when it has them."""
    ports = [free_port() for _ in range(2)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    kv = f"127.0.0.1:{free_port()}"
    procs = [start([*common, "--port", str(ports[0]), "--role", "prefill", "--kv-address", kv], 0 if gpu else None,
                   urls[0], tree),
             start([*common, "--port", str(ports[1]), "--role", "decode", "--kv-address", kv], 1 if gpu else None,
                   urls[1], tree)]
    try:
        wait_up(procs, urls)
        with Router([urls[1]], prefill=[urls[0]]) as router:
            result = measure(router.url, args.model, reqs)
        health = httpx.get(urls[0] + "/health", timeout=30, trust_env=False).json()
        result["prefill_server"] = {k: v for k, v in health.items() if k != "status"} or None
        return result
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random-qwen2.5-0.5b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--short", type=int, default=200, help="short chats")
    ap.add_argument("--short-len", type=int, default=256)
    ap.add_argument("--short-out", type=int, default=128)
    ap.add_argument("--long", type=int, default=4, help="long prompts among them")
    ap.add_argument("--long-len", type=int, default=16384)
    ap.add_argument("--long-out", type=int, default=16)
    ap.add_argument("--rate", type=float, default=20.0, help="short chats per second (Poisson)")
    ap.add_argument("--max-model-len", type=int, default=20000)
    ap.add_argument("--vocab", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny-random, a dozen requests")
    ap.add_argument("--cpu", action="store_true", help="CPU, tiny-random, short chats faster than one prompt at a time")
    ap.add_argument("--base", type=Path, default=None, help="also run the pair from the tree at this folder")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each disaggregated pair, taking turns")
    ap.add_argument("--base-commit", default=None, help="the commit that tree was archived from, for the record")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.device, args.short, args.short_len, args.short_out = "tiny-random", "cpu", 8, 32, 8
        args.long, args.long_len, args.long_out, args.rate, args.max_model_len, args.vocab = 2, 384, 4, 8.0, 512, 500
    elif args.cpu:
        args.model, args.device, args.short, args.short_len, args.short_out = "tiny-random", "cpu", 200, 128, 16
        args.long, args.long_len, args.long_out, args.rate, args.max_model_len, args.vocab = 4, 1536, 4, 30.0, 2048, 500
    gpu = args.device.startswith("cuda")
    args.model = resolve_model(args.model, args.device)
    common = ["--model", args.model, "--device", args.device.split(":")[0], "--max-model-len", str(args.max_model_len),
              "--no-engine-process", "--log-level", "warning"]
    reqs = load(args)
    results = {}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs = [start([*common, "--port", str(port)], 0 if gpu else None, url)]
    try:
        wait_up(procs, [url])
        with Router([url]) as router:  # the same front as the pair's: like for like
            results["colocated"] = measure(router.url, args.model, reqs)
    finally:
        procs[0].terminate()
        procs[0].wait(timeout=120)
    order = [("disaggregated", ROOT)] + ([("disaggregated_base", args.base.resolve())] if args.base else [])
    for i in range(args.repeat):  # this tree and the base take turns (A B B A ...): a drifting load hits both
        for name, tree in order if i % 2 == 0 else order[::-1]:
            results[name + (f"_{i + 1}" if i else "")] = disaggregated(args, common, reqs, gpu, tree)
    print(f"{'':>18} {'short ITL p50':>14} {'short ITL p99':>14} {'short TTFT p50':>15} {'long TTFT p50':>14}")
    for name, r in results.items():
        long_ttft = f"{r['long_ttft_p50_s']:.3f}s" if r["long_ttft_p50_s"] is not None else "-"
        counters = f", prefill server {r['prefill_server']}" if r.get("prefill_server") else ""
        print(f"{name:>18} {r['short_itl_p50_s']:>13.4f}s {r['short_itl_p99_s']:>13.4f}s "
              f"{r['short_ttft_p50_s']:>14.3f}s {long_ttft:>14}  ({r['requests']} requests, {r['tokens']} tokens, "
              f"{r['wall_s']:.1f} s, {r['cached_fraction']:.0%} of prompt tokens not computed by the decoding "
              f"engine{counters})")
    write_record("disagg", args, results, leave_out=("out", "base", "base_commit"), base_commit=args.base_commit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
