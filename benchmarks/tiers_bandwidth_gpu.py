"""How fast blocks move between the pool and the CPU tier: spill (pool -> CPU tier) and load (CPU tier
-> pool), the batched path of minikv/cache/tiers/offload.py against the per-block path it replaced, and
against a raw pinned copy of the same bytes (the most any path can reach over this link).

    python3 benchmarks/tiers_bandwidth_gpu.py --out $OUT/tiers_bandwidth_gpu.json      on a GPU
    python3 benchmarks/tiers_bandwidth_gpu.py --device cpu --shapes qwen0.5b --blocks 16 --reps 7
                                                                                   on a CPU (a quick try)

Each case first checks the round trip: random K/V in pool blocks A, spilled, loaded into blocks B,
must equal A bit for bit (both paths). Then it times, over `--reps` repetitions (medians; CUDA
events on a GPU, perf_counter on a CPU):

    spill  new   Offload.spill: one index_select from the pool, one device-to-host copy into pinned
                 memory, one copy per tensor per run of consecutive slots into the CPU tier's slab
           old   an advanced-index gather, a synchronous .to("cpu"), then CpuTier.put block by
                 block (one copy per block per tensor into a [capacity, ...] slab)
    load   new   Offload.load: one index_select per tensor into pinned staging, one host-to-device
                 copy, pool.write_blocks (one index_copy_ per tensor on a GPU)
           old   a get per block, a copy per block per tensor into pinned staging, the copy up, an
                 advanced-index assignment into the pool
    raw          one contiguous device->pinned (spill) / pinned->device (load) copy of the same bytes

GB/s counts the blocks' bytes (K and V, all layers) once. Prints a table and writes a JSON.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import platform
import statistics
import time
from collections import OrderedDict

import torch

from minikv.cache.blocks.pool import KVPool
from minikv.cache.prefix.hash_chain import HashChainCache
from minikv.cache.tiers.cpu import CpuTier
from minikv.cache.tiers.offload import Offload
from minikv.cache.tiers.tiered import TieredStore

SHAPES = {  # num_layers, num_kv_heads, head_dim, block_size
    "qwen0.5b": (24, 2, 64, 16),
    "llama8b": (32, 8, 128, 16),
}


# ---- the per-block path the batched one replaced (kept here as the baseline) -----------------------
class PerBlockCpuTier:
    """The CPU tier before batching: a [capacity, num_layers, ...] slab filled one block at a time."""

    def __init__(self, capacity: int, pin: bool):
        self.capacity, self.pin = capacity, pin
        self.slab: list[torch.Tensor] = []
        self.slot_of: OrderedDict[bytes, int] = OrderedDict()
        self.free_slots = list(range(capacity - 1, -1, -1))

    def put(self, key: bytes, value: tuple) -> None:
        if not self.slab:
            self.slab = [torch.empty((self.capacity,) + tuple(t.shape), dtype=t.dtype, pin_memory=self.pin)
                         for t in value]
        if not self.free_slots:
            _, slot = self.slot_of.popitem(last=False)
            self.free_slots.append(slot)
        slot = self.free_slots.pop()
        for s, t in zip(self.slab, value):
            s[slot].copy_(t)
        self.slot_of[key] = slot

    def get(self, key: bytes) -> tuple:
        slot = self.slot_of[key]
        return tuple(s[slot] for s in self.slab)

    def clear(self) -> None:
        self.slot_of.clear()
        self.free_slots = list(range(self.capacity - 1, -1, -1))


def old_read_blocks(pool: KVPool, blocks: list[int]) -> tuple:
    """KVPool.read_blocks before batching: an advanced-index gather."""
    index = torch.tensor(blocks, dtype=torch.long, device=pool.device)
    return tuple(plane[:, index].contiguous() for plane in pool.planes)


def old_write_blocks(pool: KVPool, blocks: list[int], *planes: torch.Tensor) -> None:
    """KVPool.write_blocks before batching: an advanced-index assignment."""
    index = torch.tensor(blocks, dtype=torch.long, device=pool.device)
    for plane, given in zip(pool.planes, planes):
        plane[:, index] = given.to(pool.device, plane.dtype)


def old_spill(pool: KVPool, tier: PerBlockCpuTier, blocks: list[int], keys: list[bytes]) -> None:
    read = tuple(t.to("cpu") for t in old_read_blocks(pool, blocks))
    for j, k in enumerate(keys):
        tier.put(k, tuple(t[:, j] for t in read))


def old_load(pool: KVPool, tier: PerBlockCpuTier, keys: list[bytes], blocks: list[int], staging: dict) -> None:
    values = [tier.get(k) for k in keys]
    out = []
    for i in range(len(values[0])):
        first = values[0][i]
        shape = (first.shape[0], len(values)) + tuple(first.shape[1:])
        numel = torch.Size(shape).numel()
        buf = staging.get(i)
        if buf is None or buf.numel() < numel:
            buf = staging[i] = torch.empty(numel, dtype=first.dtype, pin_memory=pool.device.type == "cuda")
        staged = buf[:numel].view(shape)
        for j, v in enumerate(values):
            staged[:, j].copy_(v[i])
        out.append(staged.to(pool.device, non_blocking=True))
    old_write_blocks(pool, blocks, *out)
    if pool.device.type == "cuda":
        torch.cuda.current_stream(pool.device).synchronize()


# ---- timing ---------------------------------------------------------------------------------------
def timed(fn, device: torch.device, reps: int, before=None) -> float:
    """Median seconds of fn() over reps (after one warm-up); `before` runs untimed before each."""
    times = []
    for r in range(reps + 1):
        if before is not None:
            before()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            fn()
            seconds = time.perf_counter() - t0
        if r:
            times.append(seconds)
    return statistics.median(times)


def run_case(name: str, device: torch.device, dtype: torch.dtype, n: int, reps: int) -> dict:
    layers, heads, head_dim, bs = SHAPES[name]
    pool = KVPool(layers, 2 * n + 1, bs, heads, head_dim, dtype, device)
    cache = HashChainCache(bs)
    store = TieredStore(CpuTier(n * pool.block_bytes, pool.block_bytes, pin=device.type == "cuda"))
    offload = Offload(pool, cache, store, "00" * 32)
    src, dst = list(range(n)), list(range(n, 2 * n))
    g = torch.Generator(device=device).manual_seed(0)
    for plane in pool.planes:
        plane.copy_(torch.randn(plane.shape, generator=g, device=device, dtype=torch.float32).to(plane.dtype))
    hashes = [hashlib.sha256(f"{name}-{j}".encode()).digest() for j in range(n)]
    keys = [offload.key(h) for h in hashes]
    nbytes = n * pool.block_bytes
    want = pool.read_blocks(src)

    def same_in_dst() -> bool:
        return all(torch.equal(a, b) for a, b in zip(want, pool.read_blocks(dst)))

    def clear_dst():
        for plane in pool.planes:
            plane[:, dst] = 0

    # round trips, checked bit for bit
    offload.spill(list(zip(src, hashes)))
    clear_dst()
    assert offload.load(keys, dst) == n and same_in_dst(), "the batched round trip changed the bytes"
    old_tier, staging = PerBlockCpuTier(n, pin=device.type == "cuda"), {}
    old_spill(pool, old_tier, src, keys)
    clear_dst()
    old_load(pool, old_tier, keys, dst, staging)
    assert same_in_dst(), "the per-block round trip changed the bytes"

    # raw pinned copies of the same bytes
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")

    def raw_down():
        host.copy_(flat, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    def raw_up():
        flat.copy_(host, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    seconds = {
        "spill_new": timed(lambda: offload.spill(list(zip(src, hashes))), device, reps, before=store.clear_memory),
        "spill_old": timed(lambda: old_spill(pool, old_tier, src, keys), device, reps, before=old_tier.clear),
        "spill_raw": timed(raw_down, device, reps),
        "load_new": timed(lambda: offload.load(keys, dst), device, reps),
        "load_old": timed(lambda: old_load(pool, old_tier, keys, dst, staging), device, reps),
        "load_raw": timed(raw_up, device, reps),
    }
    assert same_in_dst()
    gbps = {k: nbytes / s / 1e9 for k, s in seconds.items()}
    return {"shape": name, "layers_heads_dim_block": SHAPES[name], "dtype": str(dtype).removeprefix("torch."),
            "blocks": n, "block_bytes": pool.block_bytes, "bytes": nbytes, "round_trip_exact": True,
            "seconds": seconds, "GBps": gbps,
            "speedup_spill": seconds["spill_old"] / seconds["spill_new"],
            "speedup_load": seconds["load_old"] / seconds["load_new"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shapes", default="qwen0.5b,llama8b", help="comma-separated: " + ", ".join(SHAPES))
    ap.add_argument("--blocks", default="8,64", help="comma-separated batch sizes (blocks per spill / load)")
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--threads", type=int, default=None, help="torch threads on the CPU")
    ap.add_argument("--out", default=None, help="write the record here (JSON)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    rows = [run_case(s, device, dtype, int(n), args.reps)
            for s in args.shapes.split(",") for n in args.blocks.split(",")]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    print(f"{name}, {args.dtype}, medians of {args.reps}; GB/s of the blocks' bytes (round trips exact: "
          f"{all(r['round_trip_exact'] for r in rows)})")
    print(f"{'shape':>9} {'blocks':>6} {'MiB':>7} | {'spill new':>9} {'old':>6} {'raw':>6} {'x':>5} | "
          f"{'load new':>8} {'old':>6} {'raw':>6} {'x':>5}")
    for r in rows:
        g = r["GBps"]
        print(f"{r['shape']:>9} {r['blocks']:>6} {r['bytes'] / 2**20:>7.1f} | "
              f"{g['spill_new']:>9.2f} {g['spill_old']:>6.2f} "
              f"{g['spill_raw']:>6.2f} {r['speedup_spill']:>5.1f} | {g['load_new']:>8.2f} {g['load_old']:>6.2f} "
              f"{g['load_raw']:>6.2f} {r['speedup_load']:>5.1f}")
    record = {"device": name, "torch": torch.__version__, "dtype": args.dtype, "reps": args.reps,
              "threads": torch.get_num_threads(), "cases": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
        print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
