"""The disk tier: one file per block (block_file.py), LRU within a budget for the whole directory
(disk_budget.py), written by a writer thread, read by reader threads.

Disk reads run on reader threads that only move and hash bytes (`DiskTier.read_async`): turning
bytes into tensors is left to the engine's thread, so a read never holds up torch work.
"""
from __future__ import annotations

import os
import queue
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from minikv.cache.tiers.block_file import (
    HEADER_BYTES,
    block_file,
    block_payload,
    check_block,
    file_bytes,
    payload_tensors,
)
from minikv.cache.tiers.disk_budget import RESCAN_S, is_hex, stale_tmp
from minikv.cache.tiers.store import Value


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
            subdirs = [d for d in os.scandir(self.root) if is_hex(d.name, 16) and d.is_dir(follow_symlinks=False)]
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
                if sub == mine and is_hex(stem, 64):
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
