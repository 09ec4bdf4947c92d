"""The tiered store under random operations: insert (a block evicted from the pool), write-through,
a batch of them at once, lookup, a disk read started on a reader thread and finished later (a load
pending while the rest goes on), restart (a new store on the same directory), corrupt a file, put one
key's file under another key's name. Whatever happens:

    a lookup, or a read finished later, returns the bytes stored under that key, or nothing: never
    another key's data (whatever happened to the file after the read started)
    a key held by both tiers holds the same bytes in both
    the CPU tier never holds more blocks than its budget, the directory never more bytes than its
    the block just inserted is found
"""
import hashlib
import shutil
import tempfile
from pathlib import Path

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minikv.cache.tiers.block_file import decode_block, file_bytes, payload_tensors
from minikv.cache.tiers.cpu import CpuTier
from minikv.cache.tiers.disk import DiskTier
from minikv.cache.tiers.identity import store_identity
from minikv.cache.tiers.tiered import TieredStore

SHAPE = (2, 4, 2, 3)  # [num_layers, block_size, kv_heads, head_dim]
BLOCK_BYTES = 2 * torch.Size(SHAPE).numel() * 4
KEYS = [hashlib.sha256(bytes([i])).digest() for i in range(12)]


class FakePool:
    block_size, kv_layout = 4, "nhd"

    def __init__(self, dtype=torch.float32):
        self.k_cache = torch.zeros(2, 1, 4, 2, 3, dtype=dtype)
        self.v_cache = torch.zeros(2, 1, 4, 2, 3, dtype=dtype)


IDENTITY = store_identity("weights-a", torch.float32, FakePool())


def value_of(key: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    """The one right value of a key (K/V are a function of the prefix the key names)."""
    g = torch.Generator().manual_seed(int.from_bytes(key[:4], "little"))
    return torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def files_bytes(folder: Path) -> int:
    """Bytes of the block files in `folder`. A file may go between the listing and its stat (a reader
    thread dropping a damaged file, the writer trimming to the budget): it counts as gone."""
    total = 0
    for p in folder.glob("*.kv"):
        try:
            total += p.stat().st_size
        except FileNotFoundError:
            pass
    return total


class TieredStoreMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="minikv-tiers-"))
        self.cpu_blocks, self.disk_files = 3, 5
        self.store = self.new_store()
        self.last_put: bytes | None = None
        self.reads: list = []  # (key, Future of DiskTier.read): loads in flight

    def new_store(self) -> TieredStore:
        return TieredStore(CpuTier(self.cpu_blocks * BLOCK_BYTES, BLOCK_BYTES),
                           DiskTier(self.root, IDENTITY, self.disk_files * file_bytes(BLOCK_BYTES), BLOCK_BYTES))

    def teardown(self):
        self.store.close()
        try:
            self.check_disk_at_rest()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    @property
    def disk(self) -> DiskTier:
        return self.store.disk

    # ---- operations -------------------------------------------------------------------------------
    @rule(i=st.integers(0, len(KEYS) - 1))
    def insert(self, i):
        """A block evicted from the pool: into the CPU tier, its overflow down to disk."""
        self.store.put(KEYS[i], value_of(KEYS[i]))
        self.store.flush()
        self.last_put = KEYS[i]

    @rule(ids=st.lists(st.integers(0, len(KEYS) - 1), min_size=1, max_size=6))
    def insert_batch(self, ids):
        """Blocks evicted together (one spill, planes [num_layers, n, ...]): possibly more than the CPU
        tier holds, possibly a key twice. The batch's last block is the most recent."""
        keys = [KEYS[i] for i in ids]
        planes = tuple(torch.stack([value_of(k)[t] for k in keys], dim=1) for t in range(2))
        self.store.put_many(keys, planes)
        self.store.flush()
        assert keys[-1] in self.store.cpu
        self.last_put = keys[-1]

    @rule(i=st.integers(0, len(KEYS) - 1))
    def write_through(self, i):
        self.store.persist(KEYS[i], value_of(KEYS[i]))
        self.store.flush()

    @rule(i=st.integers(0, len(KEYS) - 1))
    def lookup(self, i):
        got = self.store.get(KEYS[i])
        assert got is None or same(got, value_of(KEYS[i])), f"key {i} returned another key's bytes"

    @rule(i=st.integers(0, len(KEYS) - 1))
    def start_read(self, i):
        """A load starts: the file is read and checked on a reader thread while other operations go on."""
        self.reads.append((KEYS[i], self.disk.read_async(KEYS[i])))

    def settle_reads(self):
        """Finish every read in flight (each checked as finish_read checks it) before files are damaged:
        the counts and the index a rule then looks at no longer depend on the reader threads' timing."""
        while self.reads:
            self.finish_read()

    @precondition(lambda self: self.reads)
    @rule()
    def finish_read(self):
        key, future = self.reads.pop(0)
        found = future.result(timeout=30)
        assert found is None or same(payload_tensors(*found), value_of(key)), "a read returned another key's bytes"

    @rule()
    def restart(self):
        """The engine stops (close writes what is queued) and a new one opens the same directory."""
        self.store.close()
        self.check_disk_at_rest()
        self.store = self.new_store()

    @precondition(lambda self: len(self.store.disk.index) > 0)
    @rule(data=st.data(), how=st.sampled_from(["flip", "truncate", "empty", "header"]))
    def corrupt(self, data, how):
        # every draw first, each from a fixed range: what the files look like (a writer thread's work)
        # must never change what Hypothesis draws, or a replay of the same case draws differently
        pick, at, bit = (data.draw(st.integers(0, 2**16)), data.draw(st.integers(0, 2**20)),
                         data.draw(st.integers(0, 7)))
        self.settle_reads()  # a read still in flight could find the damage first and count it
        if not self.disk.index:
            return
        listed = sorted(self.disk.index)
        key = listed[pick % len(listed)]
        path = self.disk.path(key)
        raw = bytearray(path.read_bytes())
        if not raw:  # emptied before, still listed (its key was in the CPU tier when looked up)
            return
        if how == "flip":
            raw[len(raw) // 2 + at % (len(raw) - len(raw) // 2)] ^= 1 << bit  # in the second half
        elif how == "truncate":
            raw = raw[:at % len(raw)]
        elif how == "empty":
            raw = bytearray()
        else:
            raw[20:30] = b"x" * 10
        path.write_bytes(bytes(raw))
        damaged = decode_block(bytes(raw), IDENTITY, key) is None  # a second flip of one bit repairs a file
        corrupt_before = self.disk.num_corrupt
        in_cpu = key in self.store.cpu
        got = self.store.get(key)
        if in_cpu or not damaged:
            assert same(got, value_of(key))
        else:
            assert got is None, "a damaged file was loaded"
            assert self.disk.num_corrupt == corrupt_before + 1 and key not in self.disk

    @precondition(lambda self: len(self.store.disk.index) > 1)
    @rule(data=st.data())
    def misfile(self, data):
        """Another key's file under this key's name (a copy gone wrong): never served as this key."""
        i, j = data.draw(st.integers(0, 2**16)), data.draw(st.integers(0, 2**16))  # fixed ranges: see corrupt
        self.settle_reads()
        if len(self.disk.index) < 2:
            return
        listed = sorted(self.disk.index)
        a = listed[i % len(listed)]
        b = listed[(i + 1 + j % (len(listed) - 1)) % len(listed)]  # another one
        shutil.copyfile(self.disk.path(a), self.disk.path(b))
        got = self.store.get(b)  # from the CPU tier, or b's own bytes (a's file may hold b's block after an
        assert got is None or same(got, value_of(b))  # earlier misfile), or nothing: never a's

    # ---- invariants -------------------------------------------------------------------------------
    @invariant()
    def cpu_budget_never_exceeded(self):
        assert len(self.store.cpu) <= self.cpu_blocks

    def check_disk_at_rest(self):
        """With the writer done (after close): the files fit the budget and no temporary file is left.
        (While the writer runs, a file is renamed into place a moment before the oldest is trimmed.)"""
        assert files_bytes(self.disk.dir) <= self.disk_files * file_bytes(BLOCK_BYTES)
        assert not list(self.disk.dir.glob("*.tmp")), "a temporary file was left behind"

    @invariant()
    def tiers_agree(self):
        """A key in both tiers holds the same bytes in both, and each is its own key's."""
        for key in list(self.store.cpu.slot_of):
            slot = self.store.cpu.slot_of[key]
            assert same(tuple(s[:, slot] for s in self.store.cpu.slab), value_of(key))
            path = self.disk.path(key)
            if key in self.disk.index and path.exists():
                on_disk = decode_block(path.read_bytes(), IDENTITY, key)
                assert on_disk is None or same(on_disk, value_of(key))

    @invariant()
    def the_last_insert_is_found(self):
        if self.last_put is not None and self.last_put in self.store.cpu:
            assert same(self.store.cpu.get(self.last_put), value_of(self.last_put))


TieredStoreMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
test_tiered_store_keeps_every_key_its_own_within_budgets = TieredStoreMachine.TestCase


def test_another_identity_never_reads_the_files():
    """The same directory, another model (or kv dtype): another subdirectory, and a header check."""
    root = Path(tempfile.mkdtemp())
    try:
        a = DiskTier(root, IDENTITY, 10 * file_bytes(BLOCK_BYTES), BLOCK_BYTES)
        a.put(KEYS[0], value_of(KEYS[0]))
        a.close()
        for other in (store_identity("weights-b", torch.float32, FakePool()),
                      store_identity("weights-a", torch.float32, FakePool(torch.float16))):
            assert other != IDENTITY
            b = DiskTier(root, other, 10 * file_bytes(BLOCK_BYTES), BLOCK_BYTES)
            assert KEYS[0] not in b and b.get(KEYS[0]) is None
            b.close()
        data = a.path(KEYS[0]).read_bytes()
        assert decode_block(data, IDENTITY, KEYS[0]) is not None
        assert decode_block(data, IDENTITY[::-1], KEYS[0]) is None  # a header naming another identity
    finally:
        shutil.rmtree(root)
