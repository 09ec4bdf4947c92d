"""The CPU tier: blocks in host memory, moved in batches.

A value (store.py) is one block's tensors, each [num_layers, block_size, ...]. Blocks move in batches, shaped
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
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from minikv.cache.blocks.pool import runs
from minikv.cache.tiers.store import Value


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
