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
[num_layers, block_size, ...]. The store treats it as opaque bytes.
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Protocol

import torch

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


def value_bytes(value: Value) -> int:
    return sum(t.numel() * t.element_size() for t in value)


# ---- CPU tier ------------------------------------------------------------------------------------
class CpuTier:
    """Blocks in host memory (pinned when the pool is on a GPU), LRU within `budget` bytes.

    Slots of a preallocated slab, one per block: slab[i][slot] holds value[i] of one block."""

    def __init__(self, budget: int, block_bytes: int, pin: bool = False):
        self.capacity = budget // block_bytes
        if self.capacity < 1:
            raise ValueError(f"kv_offload_cpu_bytes={budget:,} holds no block of {block_bytes:,} bytes; "
                             f"give at least {block_bytes:,}")
        self.budget, self.block_bytes, self.pin = budget, block_bytes, pin
        self.slab: list[torch.Tensor] = []  # allocated at the first put, shaped by the values
        self.slot_of: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recently used first
        self.free_slots = list(range(self.capacity - 1, -1, -1))

    def __contains__(self, key: bytes) -> bool:
        return key in self.slot_of

    def __len__(self) -> int:
        return len(self.slot_of)

    @property
    def used_bytes(self) -> int:
        return len(self.slot_of) * self.block_bytes

    def put(self, key: bytes, value: Value) -> list[tuple[bytes, Value]]:
        """Keep `value` as the most recent block; returns the blocks pushed out (least recent first)."""
        if key in self.slot_of:
            self.slot_of.move_to_end(key)
            return []
        if not self.slab:
            self.slab = [torch.empty((self.capacity,) + tuple(t.shape), dtype=t.dtype, pin_memory=self.pin)
                         for t in value]
        out = []
        if not self.free_slots:
            old, slot = self.slot_of.popitem(last=False)
            out.append((old, tuple(s[slot].clone() for s in self.slab)))
            self.free_slots.append(slot)
        slot = self.free_slots.pop()
        for s, t in zip(self.slab, value):
            s[slot].copy_(t)
        self.slot_of[key] = slot
        return out

    def get(self, key: bytes) -> Value | None:
        slot = self.slot_of.get(key)
        if slot is None:
            return None
        self.slot_of.move_to_end(key)
        return tuple(s[slot] for s in self.slab)  # views: copy before the slot is reused

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


def encode_block(identity: str, key: bytes, value: Value) -> bytes:
    return block_file(identity, key, *block_payload(value))


def decode_block(data: bytes | bytearray, identity: str, key: bytes) -> Value | None:
    """The tensors of a block file, or None if anything is off (truncated, corrupted, another key).
    The tensors are views of `data` (no copy): pass a bytearray to get writable ones."""
    if len(data) < HEADER_BYTES or not data.startswith(MAGIC):
        return None
    try:
        header = json.loads(bytes(data[len(MAGIC):HEADER_BYTES]))
        payload = memoryview(data)[HEADER_BYTES:]
        if (header["identity"], header["key"], header["payload"]) != (identity, key.hex(), len(payload)):
            return None
        if hashlib.blake2b(payload, digest_size=16).hexdigest() != header["blake2b"]:
            return None
        out, at = [], HEADER_BYTES
        for dtype, shape in header["tensors"]:
            dt = getattr(torch, dtype)
            n = torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
            if at + n > len(data):
                return None
            buf = data if isinstance(data, bytearray) else bytearray(data[at:at + n])
            start = at if buf is data else 0
            out.append(torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=start).view(dt).reshape(shape))
            at += n
        return tuple(out) if at == len(data) else None
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError):
        return None


def file_bytes(block_bytes: int) -> int:
    return HEADER_BYTES + block_bytes


class DiskTier:
    """One file per block under `root/<identity[:16]>/`, LRU within `budget` bytes of files.

    `put` queues the block for a writer thread (it stays readable from memory until written);
    `close()` writes what is queued and stops the thread. At start the directory's files are indexed
    (oldest first by modification time) and loaded only on a hit, checked against their checksum."""

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
        self.pending: dict[bytes, Value] = {}  # queued, not yet on disk
        self._payloads: dict[bytes, tuple[list, bytes]] = {}  # the same blocks as bytes, for the writer
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
            value = tuple(t.detach().to("cpu") for t in value)
            self.pending[key] = value
            # torch work stays on the caller's thread: a thread that ran torch ops and then exits can
            # leave the process's OpenMP threads slow (seen: every later forward pass 25x slower)
            self._payloads[key] = block_payload(value)
        if self._thread is None:
            self._thread = threading.Thread(target=self._write_loop, name="minikv-disk-writer", daemon=True)
            self._thread.start()
        self._queue.put(key)

    def get(self, key: bytes) -> Value | None:
        with self.lock:
            if key in self.pending:
                return self.pending[key]
            if key not in self.index:
                return None
            self.index.move_to_end(key)
        try:
            with open(self.path(key), "rb") as f:  # one copy: into a buffer the tensors then view
                data = bytearray(os.fstat(f.fileno()).st_size)
                f.readinto(data)
        except OSError:  # deleted under us (another engine's budget, a person): a miss
            with self.lock:
                self.index.pop(key, None)
            return None
        value = decode_block(data, self.identity, key)
        if value is None:
            with self.lock:
                self.num_corrupt += 1
            self.drop(key)
            return None
        with self.lock:
            self.num_reads += 1
            self.bytes_read += len(data)
        return value

    def get_many(self, keys: list[bytes]) -> list[Value | None]:
        """`get` of each key, the files read and checked in parallel (file reads and hashing release
        the GIL)."""
        if len(keys) < 2:
            return [self.get(k) for k in keys]
        if self._readers is None:
            self._readers = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="minikv-disk-read")
        return list(self._readers.map(self.get, keys))

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
            payload = self._payloads.get(key)
        if payload is None:
            return
        data = block_file(self.identity, key, *payload)
        final = self.path(key)
        tmp = final.with_name(f"{final.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, final)  # atomic: a reader sees the old file, the new one, or none
        except OSError:
            tmp.unlink(missing_ok=True)
            with self.lock:
                self.pending.pop(key, None)
                self._payloads.pop(key, None)
            return
        with self.lock:
            self.pending.pop(key, None)
            self._payloads.pop(key, None)
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
    write-through. `get` looks in the CPU tier, then on disk; a hit stays where it is."""

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
        if self.cpu is None:
            self.persist(key, value)
            return
        for old, old_value in self.cpu.put(key, value):
            if self.disk is not None and old not in self.disk:
                self.disk.put(old, old_value)
            elif self.disk is None:
                self.dropped += 1

    def persist(self, key: bytes, value: Value) -> None:
        if self.disk is not None:
            self.disk.put(key, value)

    def get(self, key: bytes) -> Value | None:
        if self.cpu is not None:
            value = self.cpu.get(key)
            if value is not None:
                return value
        return self.disk.get(key) if self.disk is not None else None

    def get_many(self, keys: list[bytes]) -> list[tuple[str, Value | None]]:
        """(tier, value or None) of each key up to the first miss: CPU hits at once, the disk's read
        in parallel."""
        tiers = []
        for k in keys:
            tier = self.locate(k)
            if tier is None:
                break
            tiers.append(tier)
        on_disk = [k for k, t in zip(keys, tiers) if t == "disk"]
        from_disk = iter(self.disk.get_many(on_disk) if on_disk else [])
        out = []
        for k, t in zip(keys, tiers):
            value = self.cpu.get(k) if t == "cpu" else next(from_disk)
            out.append((t, value))
            if value is None:
                break
        if len(out) < len(keys) and (not out or out[-1][1] is not None):
            out.append((None, None))  # a key listed by no tier: the hit ends here
        return out

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
