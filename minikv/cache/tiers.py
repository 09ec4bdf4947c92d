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
never hits. The weights' fingerprint follows the weights: `weights_fingerprint` hashes every byte
again whenever a tensor's storage, version counter or sampled bytes moved (an in-place change), so
an engine built or derived after a change gets a new identity.

Each file repeats the identity and the key in its header and carries a checksum of its payload: a
corrupted or truncated file is skipped (deleted, counted), never loaded. Files are written under a
temporary name and renamed, so two engines sharing a directory never read half a file.

The disk budget holds for the directory, not for one engine: eviction measures what the directory
holds (every identity's files, and temporary files of writes in progress), so engines sharing it keep
to the budget together. A temporary file whose writer died (kill -9) is removed when the directory is
measured. A directory deleted under a running engine is created again at the next write.

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
import sys
import threading
import time
import weakref
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
STALE_TMP_S = 600.0  # a temporary file this old is a write that died (one block's write takes far less)
RESCAN_S = 1.0  # while writing, the directory's usage is measured again at least this often
FINGERPRINT_SAMPLES = 256  # elements of each tensor whose bytes stamp the weights between full hashes

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


def weights_stamp(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A cheap stamp that moves whenever a weight may have changed: each tensor's storage address,
    version counter (bumped by every in-place op, under no_grad too), dtype, shape, and the bytes of
    FINGERPRINT_SAMPLES evenly spaced elements (a write through `.data` bypasses the counter)."""
    h = hashlib.sha256()
    for name, t in named:
        t = t.detach()
        version = -1 if t.is_inference() else t._version  # inference tensors keep no counter: the sample decides
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|{t.data_ptr()}|{version}|".encode())
        if t.numel():
            flat = t.reshape(-1)
            step = max(1, flat.numel() // FINGERPRINT_SAMPLES)
            sample = torch.cat([flat[::step], flat[-1:]]).to("cpu").contiguous()
            h.update(sample.view(torch.uint8).numpy())
    return h.hexdigest()


_FINGERPRINTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> (stamp, sha256)


def weights_fingerprint(model: torch.nn.Module, fresh: bool = False) -> str:
    """`fingerprint_tensors` of the model's weights, hashed again only when `weights_stamp` moved (or
    `fresh`): an engine derived after an in-place change never takes the old weights' identity, while
    engines derived from unchanged weights skip hashing every byte again (a real model's weights are
    hundreds of MB). A change no stamp sees (one element written through `.data` outside the sample)
    needs `reset_prefix_cache()`, which hashes every byte again."""
    stamp = weights_stamp(model.state_dict().items())
    known = _FINGERPRINTS.get(model)
    if fresh or known is None or known[0] != stamp:
        known = (stamp, fingerprint_tensors(model.state_dict().items()))
        _FINGERPRINTS[model] = known
    return known[1]


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

    def close(self) -> None:
        """Forget every block and give the slab's memory back (a later put allocates it again)."""
        self.clear()
        self.slab = []


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


def _writer_alive(pid: int) -> bool:
    """Is the process that named a temporary file still running (on this machine)?"""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # someone else's process (PermissionError): alive
        return True
    return True


def stale_tmp(name: str, mtime: float, now: float) -> bool:
    """A temporary file `<name>.<pid>.<thread>.tmp` left by a write that will never finish: its
    process is gone (kill -9 mid-write), or it is older than STALE_TMP_S (another machine's, a pid
    reused)."""
    if now - mtime > STALE_TMP_S:
        return True
    parts = name.split(".")
    try:
        return not _writer_alive(int(parts[-3]))
    except (IndexError, ValueError):
        return False


def _is_hex(name: str, n: int) -> bool:
    return len(name) == n and all(c in "0123456789abcdef" for c in name)


class DiskTier:
    """One file per block under `root/<identity[:16]>/`, LRU within `budget` bytes for the whole of
    `root` (engines sharing it keep to the budget together):

        root/                       kv_offload_dir: the budget counts every file below
          <identity[:16]>/          one model and pool format
            <key>.kv                one block: header + payload
            <key>.kv.<pid>.<tid>.tmp   a write in progress (renamed to <key>.kv when complete)

    `put` queues the block for a writer thread (its bytes stay readable from memory until written);
    `close()` writes what is queued and stops the thread. At start the directory's files are indexed
    (oldest first by modification time: a hit touches its file, so the order is LRU across engines)
    and loaded only on a hit, checked against their checksum. `read_async` reads and checks files on
    reader threads; `get` is the same read, waited for.

    Eviction measures the directory (`measure`): at start, at close, whenever this engine's own
    writes since the last measure could take it over the budget, and at least every RESCAN_S while
    writing. Between two measures the directory may go over by what other engines wrote meanwhile,
    until one of them measures. Measuring also removes temporary files whose writer died, and makes
    the index follow the directory (files others evicted leave it, files others wrote join it)."""

    def __init__(self, root: str | os.PathLike, identity: str, budget: int, block_bytes: int):
        if budget < file_bytes(block_bytes):
            raise ValueError(f"kv_offload_disk_bytes={budget:,} holds no block file of {file_bytes(block_bytes):,} "
                             f"bytes; give at least {file_bytes(block_bytes):,}")
        self.identity, self.budget = identity, budget
        self.root = Path(root).expanduser()
        self.dir = self.root / identity[:16]
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".probe.{os.getpid()}.{threading.get_ident()}.tmp"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise ValueError(f"kv_offload_dir={os.fspath(root)!r} cannot be written ({e.strerror or e}); "
                             "give a directory you can create files in") from None
        self.lock = threading.Lock()
        self.index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, least recently used first
        self.forgotten: set[bytes] = set()  # reads failed or hung: never listed again by this engine
        self.pending: dict[bytes, tuple[list, bytes]] = {}  # queued, not yet on disk: (tensors, payload)
        self.num_writes = self.bytes_written = self.num_reads = self.bytes_read = 0
        self.num_corrupt = self.num_evicted = self.num_failed_writes = self.num_stale_tmp = 0
        self.num_recreated = 0  # times the directory was gone at a write and created again
        self.error: str | None = None  # the last write error, if writes fail
        self.dir_bytes = 0  # what the whole of root held at the last measure
        self._measured_at = float("-inf")
        self._written_since = 0  # bytes this engine wrote since the last measure
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._readers: ThreadPoolExecutor | None = None
        self.closed = False
        self.measure()

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
        try:
            os.utime(self.path(key))  # recently used, for every engine measuring the directory
        except OSError:
            pass
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
            self.forgotten.add(key)

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
            except Exception as e:  # noqa: BLE001  the writer must outlive any one block (flush waits on it)
                with self.lock:
                    self.pending.pop(key, None)
                    self.num_failed_writes += 1
                    self.error = f"{type(e).__name__}: {e}"
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
        error = None
        for attempt in range(2):
            try:
                tmp.write_bytes(data)
                os.replace(tmp, final)  # atomic: a reader sees the old file, the new one, or none
                error = None
                break
            except FileNotFoundError as e:  # the directory was deleted under us: create it again, once
                error = e
                if attempt == 0 and self._recreate():
                    continue
            except OSError as e:  # a full disk, lost permissions: counted and reported once
                error = e
            try:
                tmp.unlink()
            except OSError:
                pass
            break
        with self.lock:
            self.pending.pop(key, None)
            if error is not None:
                self.num_failed_writes += 1
                first, self.error = self.error is None, f"{type(error).__name__}: {error.strerror or error}"
            else:
                self.index[key] = len(data)
                self.forgotten.discard(key)  # written again: listed again
                self.num_writes += 1
                self.bytes_written += len(data)
                self._written_since += len(data)
        if error is not None:
            if first:
                print(f"minikv: the KV disk tier cannot write to {self.dir} ({self.error}); blocks it misses are "
                      "computed again; free disk space or fix the directory (stats() counts failed writes)",
                      file=sys.stderr)
            return
        self._trim()

    def _recreate(self) -> bool:
        """The directory vanished (deleted under a running engine): create it again and forget the files
        it held. Returns False if it cannot be created."""
        gone = not self.dir.is_dir()  # else another engine took the temporary file for a dead writer's
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError:
            return False
        if gone:
            with self.lock:
                self.num_recreated += 1
            self.measure()
        return True

    def refresh(self) -> None:
        """If the directory vanished, forget its files now (stats() must not list them)."""
        if not self.dir.is_dir():
            with self.lock:
                self.index.clear()
                self.dir_bytes = 0

    def _trim(self) -> None:
        """Measure the directory (and evict) if this engine's writes may have taken it over the budget,
        or the last measure is older than RESCAN_S."""
        with self.lock:
            fresh = time.monotonic() - self._measured_at < RESCAN_S
            if fresh and self.dir_bytes + self._written_since <= self.budget:
                return
        self.measure()

    def measure(self) -> int:
        """Measure every file of the store under root (all identities; temporary files of live writes
        count, those of dead writers are removed), delete the least recently used block files until the
        total fits the budget (with room to spare: 1/16 of it), and make the index list this identity's
        files. Returns the bytes held."""
        now, files, total = time.time(), [], 0
        try:
            subdirs = [d for d in os.scandir(self.root) if _is_hex(d.name, 16) and d.is_dir(follow_symlinks=False)]
        except OSError:
            subdirs = []
        for d in subdirs:
            try:
                entries = list(os.scandir(d.path))
            except OSError:
                continue
            for e in entries:
                if not e.name.endswith((".kv", ".tmp")):
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue  # gone since the listing
                if e.name.endswith(".tmp") and stale_tmp(e.name, st.st_mtime, now):
                    try:
                        os.unlink(e.path)
                        with self.lock:
                            self.num_stale_tmp += 1
                    except OSError:
                        pass
                    continue
                total += st.st_size
                if e.name.endswith(".kv"):
                    files.append((st.st_mtime, st.st_size, d.name, e.name[:-3]))
        files.sort()
        evicted = []
        # over the budget: down to 15/16 of it, so that a full directory is not measured at every write
        target = self.budget - self.budget // 16 if total > self.budget else total
        while total > target and files:
            _, size, sub, stem = files.pop(0)
            try:
                os.unlink(self.root / sub / f"{stem}.kv")
                evicted.append(stem)
            except FileNotFoundError:
                pass  # another engine evicted it first
            except OSError:
                continue
            total -= size
        mine = self.identity[:16]
        with self.lock:
            self.num_evicted += len(evicted)
            index = OrderedDict()
            for _, size, sub, stem in files:
                if sub == mine and _is_hex(stem, 64):
                    key = bytes.fromhex(stem)
                    if key not in self.forgotten:
                        index[key] = size
            self.index = index
            self.dir_bytes, self._written_since, self._measured_at = total, 0, time.monotonic()
        return total

    def flush(self) -> None:
        """Wait until every queued block is on disk."""
        if self._thread is not None:
            self._queue.join()

    def close(self) -> None:
        """Write what is queued, stop the writer, and measure the directory a last time (the budget
        holds when the engine is gone). Idempotent."""
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
        self.measure()


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
        """The CPU tier's memory goes back; the disk tier finishes its writes and stops its thread."""
        if self.cpu is not None:
            self.cpu.close()
        if self.disk is not None:
            self.disk.close()

    def stats(self) -> dict:
        out: dict = {}
        if self.cpu is not None:
            out["cpu"] = {"blocks": len(self.cpu), "bytes": self.cpu.used_bytes, "budget": self.cpu.budget}
        if self.disk is not None:
            d = self.disk
            d.refresh()
            # bytes: this identity's block files; dir_bytes: the whole directory at the last measure
            out["disk"] = {"blocks": len(d), "bytes": d.used_bytes, "budget": d.budget, "pending": len(d.pending),
                           "writes": d.num_writes, "bytes_written": d.bytes_written, "reads": d.num_reads,
                           "bytes_read": d.bytes_read, "corrupt_files": d.num_corrupt, "evicted": d.num_evicted,
                           "dir_bytes": d.dir_bytes, "failed_writes": d.num_failed_writes, "error": d.error,
                           "recreated": d.num_recreated, "stale_tmp_removed": d.num_stale_tmp, "dir": str(d.dir)}
        out["dropped"] = self.dropped
        return out
