"""The host's share of a prefix hit: the block manager's work for one request whose prompt is a cached
prefix plus 32 new tokens, per prefix-cache design, on whatever CPU runs it (no model, no device).

    python benchmarks/prefix_host_cpu.py [--prefix 2048,8192] [--out FILE]
    PYTHONPATH=path/to/an/older/tree python benchmarks/prefix_host_cpu.py ...   # another tree, same CPU

On a GPU a hit's time to first token is this host work plus one small forward; at 8,192 tokens the
cache's per-block Python (512 blocks: hash or walk the tree, take each block, give each back) is a
large part of it. The phases are the engine's own calls, in the order the scheduler makes them:

    match    BlockManager.match_prefix (hash: hash the blocks and look each up; radix: walk the tree)
    admit    can_admit              acquire  acquire_prefix (take the hit's blocks)
    grow     grow (the 32 new tokens' blocks)
    cache    cache_blocks (the new full blocks join the cache)
    free     free (the request's blocks go back, the cached ones into the eviction queue)

Each phase is a median over 40 requests; the hit must cover the whole prefix or the script stops.
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minikv.cache.block_manager import BlockManager  # noqa: E402
from minikv.cache.prefix.registry import make_prefix_cache  # noqa: E402

PHASES = ("match", "admit", "acquire", "grow", "cache", "free")


class Request:
    """What the block manager reads of a request (CachedRequest)."""

    _next = 0

    def __init__(self, token_ids: list[int]):
        Request._next += 1
        self.seq_id, self.request_id = Request._next, f"r{Request._next}"
        self._ids, self.block_table, self.num_computed_tokens, self.cache_salt = token_ids, [], 0, None

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)  # the engine's requests build the list too

    @property
    def num_tokens(self) -> int:
        return len(self._ids)


def one(bm: BlockManager, ids: list[int]) -> tuple[int, list[float]]:
    seq, t = Request(ids), [time.perf_counter()]
    hit = bm.match_prefix(seq)
    t.append(time.perf_counter())
    if not bm.can_admit(seq, hit, seq.num_tokens):
        raise RuntimeError("no room: raise num_blocks")
    t.append(time.perf_counter())
    seq.num_computed_tokens = bm.acquire_prefix(seq, hit) or 0
    t.append(time.perf_counter())
    bm.grow(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    t.append(time.perf_counter())
    bm.cache_blocks(seq)
    t.append(time.perf_counter())
    bm.free(seq)
    t.append(time.perf_counter())
    return hit.num_tokens, [b - a for a, b in zip(t, t[1:])]


def measure(design: str, prefix: int, requests: int = 40, seed: int = 0) -> dict:
    rng = random.Random(seed)
    shared = [rng.randrange(100, 151_000) for _ in range(prefix)]
    bm = BlockManager(2 * (prefix // 16) + 64, 16)
    bm.attach_prefix_cache(make_prefix_cache(design, 16))
    one(bm, shared + [1])  # the prefix cached
    times: list[list[float]] = []
    for _ in range(requests):
        hit, phases = one(bm, shared + [rng.randrange(100, 151_000) for _ in range(32)])
        if hit != prefix:
            raise AssertionError(f"{design}: the hit covered {hit} of {prefix} tokens")
        times.append(phases)
    ms = {p: statistics.median(t[i] for t in times) * 1e3 for i, p in enumerate(PHASES)}
    return {"phases_ms": ms, "total_ms": statistics.median(sum(t) for t in times) * 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix", default="2048,8192")
    ap.add_argument("--label", default="this tree")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    rows = {}
    for prefix in (int(p) for p in args.prefix.split(",")):
        for design in ("hash", "radix"):
            r = rows[f"{design}_{prefix}"] = measure(design, prefix)
            print(f"[prefix_host] {args.label}: {design:5s} {prefix:5d} tokens  total {r['total_ms']:.3f} ms  "
                  + "  ".join(f"{p} {v:.3f}" for p, v in r["phases_ms"].items()), flush=True)
    if args.out:
        record = {"benchmark": "prefix_host_cpu", "label": args.label, "python": platform.python_version(),
                  "cpu": platform.processor() or platform.machine(), "rows": rows}
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
