"""The tiered store: the CPU tier above the disk tier, behind the `BlockStore` interface."""
from __future__ import annotations

from minikv.cache.tiers.cpu import CpuTier
from minikv.cache.tiers.disk import DiskTier
from minikv.cache.tiers.store import Value


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
