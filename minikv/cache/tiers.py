"""Rung 9: a tiered prefix store. Blocks the pool evicts are kept further down instead of dropped:

    pool (device)   the prefix cache's blocks                  a hit costs nothing
      | evict  ^ load
    CPU tier        pinned host memory, LRU within a budget    a hit costs a host-to-device copy
      | evict  ^ load
    disk tier       one file per block, LRU within a budget    a hit costs a file read + the copy
                    written through: queued once the block is computed and cached, so a new engine
                    (or one after a crash) finds it

A block is stored under a key that must make a wrong hit impossible:

    store key = sha256(identity, block hash)
    block hash  the hash chain's key: every token of the prefix up to this block, and the cache salt
    identity    the model (a fingerprint of every weight, its dtype) and the pool's storage format
                (block size, layout, each pool tensor's dtype and shape per block)

Another model, another kv dtype, another block size or another tenant computes other keys, so it
never hits. Each file repeats the identity and the key in its header and carries a checksum of its
payload: a corrupted or truncated file is skipped (deleted, counted), never loaded. Files are written
under a temporary name and renamed, so two engines sharing a directory never read half a file.

A value is what `KVPool.read_blocks` returns for one block: a tuple of tensors, each
[num_layers, block_size, ...]. The store treats it as opaque bytes. Blocks move in batches, shaped
as `read_blocks` returns many: [num_layers, n, block_size, ...] per tensor ("planes"):

    spill   pool planes --one index_select--> [L, n, ...] --one device-to-host copy--> pinned
            staging --one copy per run of consecutive slots--> CPU slab [L, capacity, ...]
            (free slots are handed out in order: a batch usually lands in one run)
    load    CPU slab --one copy per run of consecutive slots--> staging [L, n, ...] (pinned on a GPU)
            (disk blocks: read and checked by reader threads, copied in on the engine's thread)
            --one host-to-device copy--> pool.write_blocks

On the host, indexed copies over the block dimension (index_copy_, x[:, idx] = y, and index_select
too, measured at a third of a plain copy's speed on an H100's host) run far slower than plain copies
of runs: the CPU tier reads and writes its slab by runs, the pool (on the host side) reads by index.

Disk reads run on reader threads that only move and hash bytes (`DiskTier.read_async`): turning
bytes into tensors is left to the engine's thread, so a read never holds up torch work.
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Protocol

import torch

from minikv.cache.pool import runs

FORMAT = "minikv-kv-1"  # bump when the file layout or the key's recipe changes
MAGIC = b"MINIKV-KV1\n"
HEADER_BYTES = 512  # the JSON header is padded to this size; the payload follows
DEFAULT_DISK_BYTES = 2**30

Value = tuple  # tensors of one block: (k [num_layers, block_size, kv_heads, head_dim], v [...])


class BlockStore(Protocol):
    """What the engine needs of a store of evicted blocks (the `kv_offload_store` seam)."""

    def put(self, key: bytes, value: Value) -> None:
        """A block leaves the pool: keep it (or drop something else, or it) within the budget."""
        ...

    def get(self, key: bytes) -> Value | None:
        """The block stored under `key`, or None. It stays stored (a copy goes back to the pool)."""
        ...

    def __contains__(self, key: bytes) -> bool: ...


# ---- identity ------------------------------------------------------------------------------------
def fingerprint_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes: the weights' identity."""
    h = hashlib.sha256()
    for name, t in named:
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy() if t.numel() else b"")  # the buffer, no copy
    return h.hexdigest()


def pool_format(pool) -> dict:
    """The pool's storage format, read from its tensors: whatever a pool keeps per block (K, V, and
    any scales a quantized pool adds) enters with its dtype and per-block shape."""
    tensors = sorted((name, str(t.dtype), [t.shape[0]] + list(t.shape[2:]))
                     for name, t in vars(pool).items() if isinstance(t, torch.Tensor))
    return {"block_size": pool.block_size, "layout": getattr(pool, "kv_layout", None), "tensors": tensors}


def store_identity(weights: str, model_dtype: torch.dtype, pool) -> str:
    """Hex digest of everything besides the tokens that decides a block's bytes."""
    text = json.dumps({"format": FORMAT, "weights": weights, "dtype": str(model_dtype), "pool": pool_format(pool)},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def store_key(identity: str, block_hash: bytes) -> bytes:
    return hashlib.sha256(bytes.fromhex(identity) + block_hash).digest()


# ---- CPU tier ------------------------------------------------------------------------------------
class CpuTier:
    """Blocks in host memory (pinned when the pool is on a GPU), LRU within `budget` bytes.

    A slab per tensor, laid out like the pool's planes so that a batch moves with one indexed copy:

        slab[i]: [num_layers, capacity, block_size, ...]   slab[i][:, slot] holds value[i] of one block

    Free slots are handed out in order, so a batch of blocks usually lands in one run of slots.
    """

    def __init__(self, budget: int, block_bytes: int, pin: bool = False):
        self.capacity = budget // block_bytes
        if self.capacity < 1:
            raise ValueError(f"kv_offload_cpu_bytes={budget:,} holds no block of {block_bytes:,} bytes; "
                             f"give at least {block_bytes:,}")
        self.budget, self.block_bytes, self.pin = budget, block_bytes, pin
        self.slab: list[torch.Tensor] = []  # allocated at the first put, shaped by the values
        self.slot_of: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recently used first
        self.free_slots = list(range(self.capacity - 1, -1, -1))  # popped from the end: 0, 1, 2, ...

    def __contains__(self, key: bytes) -> bool:
        return key in self.slot_of

    def __len__(self) -> int:
        return len(self.slot_of)

    @property
    def used_bytes(self) -> int:
        return len(self.slot_of) * self.block_bytes

    def put(self, key: bytes, value: Value) -> list[tuple[bytes, Value]]:
        """Keep `value` as the most recent block; returns the blocks pushed out (least recent first)."""
        return self.put_many([key], tuple(t.unsqueeze(1) for t in value))

    def put_many(self, keys: list[bytes], planes: tuple) -> list[tuple[bytes, Value]]:
        """Keep the blocks of `planes` ([num_layers, len(keys), ...] each) under `keys`, the last the most
        recent: one copy per tensor for each run of consecutive free slots (a fresh tier hands out one
        run; on the host an indexed copy, index_copy_, is many times slower than these memcpys).
        Returns the blocks pushed out (least recent first), copied out of their slots before the slots
        are reused. A batch larger than the tier keeps its tail."""
        if not self.slab:
            self.slab = [torch.empty((t.shape[0], self.capacity) + tuple(t.shape[2:]), dtype=t.dtype,
                                     pin_memory=self.pin) for t in planes]
        last = {k: j for j, k in enumerate(keys)}  # a key given twice: its last position counts
        order = [j for j, k in enumerate(keys) if last[k] == j]
        out = [(keys[j], tuple(t[:, j] for t in planes))  # more than the tier holds: the head never stays
               for j in order[:-self.capacity] if keys[j] not in self.slot_of]
        new, slots, pushed = [], [], []
        for j in order[-self.capacity:]:
            if keys[j] in self.slot_of:
                self.slot_of.move_to_end(keys[j])
                continue
            if self.free_slots:
                slot = self.free_slots.pop()
            else:
                old, slot = self.slot_of.popitem(last=False)
                pushed.append((old, slot))
            self.slot_of[keys[j]] = slot
            new.append(j)
            slots.append(slot)
        if pushed:  # their bytes leave before new ones land in the same slots
            gone = self.gather([slot for _, slot in pushed], by_slot=True)
            out += [(old, tuple(t[:, i] for t in gone)) for i, (old, _) in enumerate(pushed)]
        for (slot, j, n) in runs(slots, new):  # one copy per tensor per run of consecutive slots
            for s, t in zip(self.slab, planes):
                s[:, slot:slot + n].copy_(t[:, j:j + n])
        return out

    def get(self, key: bytes) -> Value | None:
        slot = self.slot_of.get(key)
        if slot is None:
            return None
        self.slot_of.move_to_end(key)
        return tuple(s[:, slot] for s in self.slab)  # views: copy before the slot is reused

    def gather(self, keys_or_slots: list, out: list[torch.Tensor] | None = None, by_slot: bool = False) -> tuple:
        """The blocks of these keys (every one held) as planes [num_layers, n, ...], into `out` if given
        (a pinned staging buffer, say): one plain copy per run of consecutive slots, as the writes do
        (an index_select over the slot dimension runs at a fraction of memcpy speed on the host, and
        slots handed out together are mostly consecutive)."""
        slots = keys_or_slots if by_slot else [self.slot_of[k] for k in keys_or_slots]
        if not by_slot:
            for k in keys_or_slots:
                self.slot_of.move_to_end(k)
        if out is None:
            out = [torch.empty((s.shape[0], len(slots)) + tuple(s.shape[2:]), dtype=s.dtype) for s in self.slab]
        for slot, j, n in runs(slots, range(len(slots))):
            for s, o in zip(self.slab, out):
                o[:, j:j + n].copy_(s[:, slot:slot + n])
        return tuple(out)

    def clear(self) -> None:
        self.slot_of.clear()
        self.free_slots = list(range(self.capacity - 1, -1, -1))


# ---- disk tier -----------------------------------------------------------------------------------
def block_payload(value: Value) -> tuple[list, bytes]:
    """A block's tensors as (dtype and shape of each, their bytes): the only part that touches torch."""
    parts = [t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in value]
    return [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in value], b"".join(parts)


def block_file(identity: str, key: bytes, tensors: list, payload: bytes) -> bytes:
    """A block's file: a fixed-size header (identity, key, tensors, checksum) then the payload."""
    header = {"identity": identity, "key": key.hex(), "payload": len(payload), "tensors": tensors,
              "blake2b": hashlib.blake2b(payload, digest_size=16).hexdigest()}
    text = MAGIC + json.dumps(header).encode()
    if len(text) + 1 > HEADER_BYTES:
        raise ValueError(f"a block header of {len(text)} bytes does not fit {HEADER_BYTES}")
    return text + b" " * (HEADER_BYTES - 1 - len(text)) + b"\n" + payload


def check_block(data: bytes | bytearray, identity: str, key: bytes) -> list | None:
    """The tensors' (dtype, shape) a block file declares, if every check passes (magic, identity, key,
    sizes, checksum); None if anything is off. Bytes only: reader threads run it."""
    if len(data) < HEADER_BYTES or not data.startswith(MAGIC):
        return None
    try:
        header = json.loads(bytes(data[len(MAGIC):HEADER_BYTES]))
        payload = memoryview(data)[HEADER_BYTES:]
        if (header["identity"], header["key"], header["payload"]) != (identity, key.hex(), len(payload)):
            return None
        if hashlib.blake2b(payload, digest_size=16).hexdigest() != header["blake2b"]:
            return None
        tensors = [(getattr(torch, dtype), torch.Size(shape)) for dtype, shape in header["tensors"]]
        if sum(shape.numel() * dt.itemsize for dt, shape in tensors) != len(payload):
            return None
        return tensors
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError):
        return None


def payload_tensors(tensors: list, payload) -> Value:
    """A block's tensors as views of `payload` (a writable buffer: bytearray or memoryview of one)."""
    out, at = [], 0
    for dt, shape in tensors:
        n = shape.numel() * dt.itemsize
        out.append(torch.frombuffer(payload, dtype=torch.uint8, count=n, offset=at).view(dt).reshape(shape))
        at += n
    return tuple(out)


def decode_block(data: bytes | bytearray, identity: str, key: bytes) -> Value | None:
    """The tensors of a block file, or None if anything is off (truncated, corrupted, another key)."""
    tensors = check_block(data, identity, key)
    if tensors is None:
        return None
    return payload_tensors(tensors, memoryview(bytearray(data))[HEADER_BYTES:])


def file_bytes(block_bytes: int) -> int:
    return HEADER_BYTES + block_bytes


class DiskTier:
    """One file per block under `root/<identity[:16]>/`, LRU within `budget` bytes of files.

    `put` queues the block for a writer thread (its bytes stay readable from memory until written);
    `close()` writes what is queued and stops the thread. At start the directory's files are indexed
    (oldest first by modification time) and loaded only on a hit, checked against their checksum.
    `read_async` reads and checks files on reader threads; `get` is the same read, waited for."""

    def __init__(self, root: str | os.PathLike, identity: str, budget: int, block_bytes: int):
        if budget < file_bytes(block_bytes):
            raise ValueError(f"kv_offload_disk_bytes={budget:,} holds no block file of {file_bytes(block_bytes):,} "
                             f"bytes; give at least {file_bytes(block_bytes):,}")
        self.identity, self.budget = identity, budget
        self.dir = Path(root).expanduser() / identity[:16]
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".probe.{os.getpid()}.{threading.get_ident()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise ValueError(f"kv_offload_dir={os.fspath(root)!r} cannot be written ({e.strerror or e}); "
                             "give a directory you can create files in") from None
        self.lock = threading.Lock()
        self.index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, least recently used first
        files = []
        for f in self.dir.glob("*.kv"):
            try:
                files.append((f.stat().st_mtime, bytes.fromhex(f.stem), f.stat().st_size))
            except (OSError, ValueError):
                continue
        for _, key, size in sorted(files):
            self.index[key] = size
        self.pending: dict[bytes, tuple[list, bytes]] = {}  # queued, not yet on disk: (tensors, payload)
        self.num_writes = self.bytes_written = self.num_reads = self.bytes_read = 0
        self.num_corrupt = self.num_evicted = 0
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._readers: ThreadPoolExecutor | None = None
        self.closed = False
        self._trim()

    def path(self, key: bytes) -> Path:
        return self.dir / f"{key.hex()}.kv"

    def __contains__(self, key: bytes) -> bool:
        with self.lock:
            return key in self.index or key in self.pending

    def __len__(self) -> int:
        return len(self.index)

    @property
    def used_bytes(self) -> int:
        with self.lock:
            return sum(self.index.values())

    def put(self, key: bytes, value: Value) -> None:
        if self.closed:
            raise RuntimeError("the disk tier is closed (LLM.close() was called); build a new engine")
        with self.lock:
            if key in self.index or key in self.pending:
                return
            # torch work stays on the caller's thread: a thread that ran torch ops and then exits can
            # leave the process's OpenMP threads slow (seen: every later forward pass 25x slower)
            self.pending[key] = block_payload(value)  # bytes: the caller may reuse its buffers at once
        if self._thread is None:
            self._thread = threading.Thread(target=self._write_loop, name="minikv-disk-writer", daemon=True)
            self._thread.start()
        self._queue.put(key)

    def get(self, key: bytes) -> Value | None:
        found = self.read(key)
        return payload_tensors(*found) if found is not None else None

    def read(self, key: bytes) -> tuple[list, memoryview] | None:
        """The block's (tensors' dtype and shape, payload bytes), read and checked, or None: not here,
        gone, or damaged (deleted and counted). Bytes only, no torch: safe on a reader thread."""
        with self.lock:
            queued = self.pending.get(key)
            if queued is None and key not in self.index:
                return None
            if queued is None:
                self.index.move_to_end(key)
        if queued is not None:
            tensors, payload = queued
            return [(getattr(torch, dt), torch.Size(shape)) for dt, shape in tensors], memoryview(bytearray(payload))
        try:
            with open(self.path(key), "rb") as f:  # one copy: into a buffer the tensors then view
                data = bytearray(os.fstat(f.fileno()).st_size)
                f.readinto(data)
        except OSError:  # deleted under us (another engine's budget, a person): a miss
            with self.lock:
                self.index.pop(key, None)
            return None
        tensors = check_block(data, self.identity, key)
        if tensors is None:
            with self.lock:
                self.num_corrupt += 1
            self.drop(key)
            return None
        with self.lock:
            self.num_reads += 1
            self.bytes_read += len(data)
        return tensors, memoryview(data)[HEADER_BYTES:]

    def read_async(self, key: bytes) -> Future:
        """`read(key)` on a reader thread (file reads and hashing release the GIL); the Future's result is
        what `read` returns (turn it into tensors with `payload_tensors` on the engine's thread)."""
        if self._readers is None:
            self._readers = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1),
                                               thread_name_prefix="minikv-disk-read")
        return self._readers.submit(self.read, key)

    def forget(self, key: bytes) -> None:
        """Stop listing a block whose read failed or hung (its file stays: another engine may read it)."""
        with self.lock:
            self.index.pop(key, None)

    def drop(self, key: bytes) -> None:
        with self.lock:
            self.index.pop(key, None)
        try:
            self.path(key).unlink()
        except OSError:
            pass

    def _write_loop(self) -> None:
        while True:
            key = self._queue.get()
            try:
                if key is None:
                    return
                self._write(key)
            finally:
                self._queue.task_done()

    def _write(self, key: bytes) -> None:
        with self.lock:
            queued = self.pending.get(key)
        if queued is None:
            return
        data = block_file(self.identity, key, *queued)
        final = self.path(key)
        tmp = final.with_name(f"{final.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, final)  # atomic: a reader sees the old file, the new one, or none
        except OSError:
            tmp.unlink(missing_ok=True)
            with self.lock:
                self.pending.pop(key, None)
            return
        with self.lock:
            self.pending.pop(key, None)
            self.index[key] = len(data)
            self.num_writes += 1
            self.bytes_written += len(data)
        self._trim()

    def _trim(self) -> None:
        """Delete the least recently used files until the rest fit the budget."""
        while True:
            with self.lock:
                if sum(self.index.values()) <= self.budget or not self.index:
                    return
                key, _ = self.index.popitem(last=False)
                self.num_evicted += 1
            try:
                self.path(key).unlink()
            except OSError:
                pass

    def flush(self) -> None:
        """Wait until every queued block is on disk."""
        if self._thread is not None:
            self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer. Idempotent."""
        if self.closed:
            return
        self.flush()
        self.closed = True
        if self._readers is not None:
            self._readers.shutdown()
            self._readers = None
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None


# ---- the two tiers together ----------------------------------------------------------------------
class TieredStore:
    """CPU tier above disk tier (either may be absent). `put` is a block evicted from the pool: into
    the CPU tier, whose overflow goes down to disk (when not already there). `persist` is the disk's
    write-through. `get` looks in the CPU tier, then on disk; a hit stays where it is. The `_many`
    forms move a batch; the engine loads through `cpu.gather` and `disk.read_async` (offload.py)."""

    def __init__(self, cpu: CpuTier | None = None, disk: DiskTier | None = None):
        if cpu is None and disk is None:
            raise ValueError("a TieredStore needs a CPU tier, a disk tier, or both")
        self.cpu, self.disk = cpu, disk
        self.dropped = 0  # blocks pushed out of the last tier

    @property
    def tier_names(self) -> list[str]:
        return [n for n, t in (("cpu", self.cpu), ("disk", self.disk)) if t is not None]

    def __contains__(self, key: bytes) -> bool:
        return self.locate(key) is not None

    def locate(self, key: bytes) -> str | None:
        if self.cpu is not None and key in self.cpu:
            return "cpu"
        if self.disk is not None and key in self.disk:
            return "disk"
        return None

    def needs(self, key: bytes) -> bool:
        """Would `put` store new bytes? (False: the key is already in the top tier; `touch` it.)"""
        top = self.cpu if self.cpu is not None else self.disk
        return key not in top

    def touch(self, key: bytes) -> None:
        if self.cpu is not None and key in self.cpu:
            self.cpu.slot_of.move_to_end(key)

    def put(self, key: bytes, value: Value) -> None:
        self.put_many([key], tuple(t.unsqueeze(1) for t in value))

    def put_many(self, keys: list[bytes], planes: tuple) -> None:
        """Blocks evicted from the pool, as planes [num_layers, len(keys), ...]: into the CPU tier in one
        indexed copy per tensor; its overflow goes down to disk."""
        if self.cpu is None:
            self.persist_many(keys, planes)
            return
        for old, old_value in self.cpu.put_many(keys, planes):
            if self.disk is not None and old not in self.disk:
                self.disk.put(old, old_value)
            elif self.disk is None:
                self.dropped += 1

    def persist(self, key: bytes, value: Value) -> None:
        if self.disk is not None:
            self.disk.put(key, value)

    def persist_many(self, keys: list[bytes], planes: tuple) -> None:
        if self.disk is not None:
            for j, k in enumerate(keys):
                self.disk.put(k, tuple(t[:, j] for t in planes))

    def get(self, key: bytes) -> Value | None:
        if self.cpu is not None:
            value = self.cpu.get(key)
            if value is not None:
                return value
        return self.disk.get(key) if self.disk is not None else None

    def clear_memory(self) -> None:
        if self.cpu is not None:
            self.cpu.clear()

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    def stats(self) -> dict:
        out: dict = {}
        if self.cpu is not None:
            out["cpu"] = {"blocks": len(self.cpu), "bytes": self.cpu.used_bytes, "budget": self.cpu.budget}
        if self.disk is not None:
            d = self.disk
            out["disk"] = {"blocks": len(d), "bytes": d.used_bytes, "budget": d.budget, "pending": len(d.pending),
                           "writes": d.num_writes, "bytes_written": d.bytes_written, "reads": d.num_reads,
                           "bytes_read": d.bytes_read, "corrupt_files": d.num_corrupt, "evicted": d.num_evicted,
                           "dir": str(d.dir)}
        out["dropped"] = self.dropped
        return out
