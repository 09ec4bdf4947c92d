"""Scheduler and block pool invariants with a prefix cache and offload tiers, under random traces in
which Hypothesis decides when each disk load is ready (a state machine, like
test_scheduler_properties.py: no model, a step appends one fake token where the engine samples).

Prompts share prefixes (a few documents, and follow-up turns of finished conversations) and the pool
is small, so cached blocks are evicted to the tiers (CPU, disk) and hit again; a hit on disk loads
beside the other requests (`scheduler.loading`). When a load is ready is the trace's, not the threads':

    bm.load_ready(seq)     drawn; a "ready" first waits for the real reads to finish (no sleeps,
                           no dependence on thread timing); once ready, always ready
    bm.wait_for_load(seq)  really waits; the load is ready from then on

Rules: arrive, follow_up (the next turn of a finished conversation), abort (a loading request half the
time), step, a_block_file_fails (every later read of one document block fails), each ending with one
engine step as the engine loop runs between events; reset_prefix_cache (deferred, as LLM's defer=True);
drain. Preemption by recompute or swap, chunked prefill or not, fcfs or longest-prefix-first, a CPU tier
or none, a disk already warm with the documents or empty.

The "model" writes into every slot it computes a fingerprint of the prefix ending there, so a block
that comes back (prefix hit, swap in, load from a tier) must hold the K/V of the tokens it stands for.

Checked after every rule (outside `schedule`, where a loaded sequence it did not admit has given its
blocks back already):
  - ref_count of every block == block tables holding it; the prefix cache's own bookkeeping (bm.check)
  - every sequence in exactly one place: waiting / running / swapped / loading, or finished in none
  - running: holds blocks for its computed tokens, and they hold its K/V
  - loading: holds exactly its hit, [0, m) cached blocks of its own prefix + [m, m + loads) fresh
    blocks only it holds (not cached yet), and its load is the one in flight (bm.tier_loads.loads, offload.inflight)
  - waiting, swapped, finished: no block, no load, no loaded prefix
  - swap space: blocks held by swapped sequences + free == total
  - a step that runs nothing while requests wait fails (unless preempting a stalled sequence helps,
    as LLM._schedule does); every block a step writes is private and not cached
  - after the drain: every block and swap block free, no load pending
"""
import shutil
import tempfile
from concurrent.futures import wait
from typing import NamedTuple

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minikv.cache.block_manager import BlockManager, blocks_needed
from minikv.cache.blocks.pool import KVPool
from minikv.cache.blocks.swap import SwapSpace
from minikv.cache.prefix.hash_chain import HashChainCache, block_hashes
from minikv.cache.tiers.block_file import file_bytes
from minikv.cache.tiers.cpu import CpuTier
from minikv.cache.tiers.disk import DiskTier
from minikv.cache.tiers.identity import store_identity
from minikv.cache.tiers.offload import Offload
from minikv.cache.tiers.tiered import TieredStore
from minikv.engine.sampling_params import SamplingParams
from minikv.engine.scheduler import Scheduler
from minikv.engine.sequence import Sequence, SequenceStatus

BS = 2
DOCS = [[11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24, 25, 26], [11, 12, 13, 14, 31, 32, 33, 34]]
SAMPLED = 7  # the fake token a step appends


class Request(NamedTuple):
    """A prompt: the first `doc_blocks` blocks of document `doc`, then `suffix`."""
    doc: int
    doc_blocks: int
    suffix: list
    max_tokens: int
    priority: int

    @property
    def prompt(self) -> list[int]:
        return DOCS[self.doc][:self.doc_blocks * BS] + self.suffix or [1]


REQUESTS = st.builds(Request, doc=st.sampled_from(range(len(DOCS))), doc_blocks=st.integers(0, 4),
                     suffix=st.lists(st.integers(1, 3), max_size=3), max_tokens=st.integers(1, 6),
                     priority=st.integers(0, 1))


def fingerprints(tokens: list[int]) -> list[float]:
    """What the "model" writes at position p: a number standing for tokens[0..p] (exact in float32)."""
    out, h = [], 0
    for t in tokens:
        h = (h * 131 + t + 1) % 16_777_213
        out.append(float(h))
    return out


class LoadsMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.sched = None
        self.seqs: list[Sequence] = []
        self.dir = tempfile.mkdtemp(prefix="minikv-loads-")
        self.ready: set = set()  # loads (PendingLoad) found ready or waited for
        self.reads: list = []  # every disk read started (Futures)
        self.failing: set[bytes] = set()  # store keys whose file can no longer be read
        self.reset_pending = False
        self.asked = 0  # load_ready calls in the current step

    def teardown(self):
        if self.sched is not None:
            self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # ---- set-up ---------------------------------------------------------------------------------
    @initialize(mode=st.sampled_from(["recompute", "swap"]), num_blocks=st.integers(5, 10), budget=st.integers(1, 12),
                chunked=st.booleans(), max_seqs=st.integers(1, 4), swap_blocks=st.integers(0, 10),
                cpu_blocks=st.sampled_from([0, 0, 2, 4]), policy=st.sampled_from(["fcfs", "lpm"]),
                eviction=st.sampled_from(["lru", "fifo"]), warm=st.booleans(),
                first=st.lists(REQUESTS, min_size=1, max_size=4))
    def configure(self, mode, num_blocks, budget, chunked, max_seqs, swap_blocks, cpu_blocks, policy, eviction,
                  warm, first):
        """The engine (built as LLM builds it), and the requests it starts with."""
        self.num_blocks = num_blocks
        self.pool = KVPool(1, num_blocks, BS, 1, 1, torch.float32, "cpu")
        identity = store_identity("loads-machine", torch.float32, self.pool)
        block_bytes = self.pool.block_bytes
        cpu = CpuTier(cpu_blocks * block_bytes, block_bytes) if cpu_blocks else None
        self.store = TieredStore(cpu, DiskTier(self.dir, identity, 10_000 * file_bytes(block_bytes), block_bytes))
        self._watch_reads(self.store.disk)
        self.bm = BlockManager(num_blocks, BS)
        self.cache = HashChainCache(BS, eviction)
        self.bm.attach_prefix_cache(self.cache)
        self.bm.attach_offload(Offload(self.pool, self.cache, self.store, identity))
        if warm:  # an earlier engine left every document's blocks on disk: their first hits load
            self._write_documents()
        self._readiness_from_the_trace()
        swap = SwapSpace(self.pool, swap_blocks) if mode == "swap" else None
        budget = budget if chunked else max(budget, num_blocks * BS)
        self.sched = Scheduler(self.bm, max_seqs, budget, chunked, mode, swap)
        self.sched.policy = policy
        for req in first:
            self._add(req.prompt, req.max_tokens, req.priority)

    def _readiness_from_the_trace(self) -> None:
        """bm.load_ready asks self.draw_ready (set by each rule); a ready load has its reads done."""
        wait_for_load = self.bm.wait_for_load
        self.draw_ready = lambda seq: True

        def load_ready(seq: Sequence) -> bool:
            self.asked += 1
            assert self.asked < 1_000, "the scheduler keeps asking whether loads are ready without waiting"
            pending = self.bm.tier_loads.loads[seq.seq_id][1]  # a sequence may load again later: another load
            if pending not in self.ready and self.draw_ready(seq):
                wait_for_load(seq)
                self.ready.add(pending)
            return pending in self.ready

        def waited(seq: Sequence) -> None:
            wait_for_load(seq)
            self.ready.add(self.bm.tier_loads.loads[seq.seq_id][1])

        self.bm.load_ready, self.bm.wait_for_load = load_ready, waited

    def _watch_reads(self, disk: DiskTier) -> None:
        """Record every read started; a read of a failing key raises (on the reader thread, which changes
        nothing: the engine's thread sees the error when the load finishes and forgets the key). A key
        whose write is still queued would be listed again once the writer gets to it, whenever that is:
        the queued writes finish before a key is forgotten, so that the trace alone decides."""
        read, read_async, forget = disk.read, disk.read_async, disk.forget

        def failing_read(key: bytes):
            if key in self.failing:
                raise OSError("the disk could not read this block")
            return read(key)

        def watched(key: bytes):
            future = read_async(key)
            self.reads.append(future)
            return future

        def forget_once_written(key: bytes) -> None:
            disk.flush()
            forget(key)

        disk.read, disk.read_async, disk.forget = failing_read, watched, forget_once_written

    def _write_documents(self) -> None:
        """Put every full block of DOCS on disk, holding what the "model" would have written."""
        offload = self.bm.offload
        for doc in DOCS:
            n = len(doc) // BS
            fp = torch.tensor(fingerprints(doc)[:n * BS]).view(1, n, BS, 1, 1)
            keys = [offload.key(h) for h in block_hashes(doc, BS)]
            self.store.persist_many(keys, (fp, -fp))
        self.store.flush()

    # ---- between steps: requests come and go, a file goes bad -----------------------------------
    def _add(self, prompt: list[int], max_tokens: int, priority: int) -> None:
        max_len = self.num_blocks * BS  # the engine refuses what the pool can never hold
        prompt = prompt[:max_len - 1]
        params = SamplingParams(max_tokens=max(1, min(max_tokens, max_len - len(prompt))), priority=priority)
        seq = Sequence(prompt, params)
        self.seqs.append(seq)
        self.sched.add(seq)

    @rule(reqs=st.lists(REQUESTS, min_size=1, max_size=3), data=st.data())
    def arrive(self, reqs, data):
        """Requests arrive, then a step."""
        for req in reqs:
            self._add(req.prompt, req.max_tokens, req.priority)
        self._step(data)

    @precondition(lambda self: any(s.finish_reason == "length" for s in self.seqs))
    @rule(data=st.data(), suffix=st.lists(st.integers(1, 3), max_size=2), max_tokens=st.integers(1, 6))
    def follow_up(self, data, suffix, max_tokens):
        """The next turn of a finished conversation (its whole history, answer included, then more),
        then a step."""
        done = data.draw(st.sampled_from([s for s in self.seqs if s.finish_reason == "length"]))
        self._add(done.token_ids + suffix, max_tokens, 0)
        self._step(data)

    @precondition(lambda self: any(not s.is_finished for s in self.seqs))
    @rule(data=st.data())
    def abort(self, data):
        """A request is aborted (a loading one when there is one, half the time), then a step."""
        live = [s for s in self.seqs if not s.is_finished]
        pick = self.sched.loading if self.sched.loading and data.draw(st.booleans()) else live
        seq = data.draw(st.sampled_from(pick))
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        self.sched.abort(seq)
        self._step(data)

    @rule(doc=st.sampled_from(range(len(DOCS))), block=st.integers(0, 3), data=st.data())
    def a_block_file_fails(self, doc, block, data):
        """From now on every read of this document block's file fails (an I/O error), then a step.
        Reads in flight finish first, so which reads fail does not depend on the reader threads."""
        keys = block_hashes(DOCS[doc], BS)
        wait(self.reads)
        self.reads.clear()
        self.failing.add(self.bm.offload.key(keys[min(block, len(keys) - 1)]))
        self._step(data)

    @rule()
    def reset_prefix_cache(self):
        """LLM.reset_prefix_cache(defer=True): no hits and no new entries from now on; cleared as soon as
        no request holds blocks (the disk keeps its files: the weights did not change)."""
        if self._holds_blocks():
            self.cache.enabled = False
            self.reset_pending = True
        else:
            self._reset()

    def _holds_blocks(self) -> bool:
        return bool(self.sched.running or self.sched.swapped or self.sched.loading)

    def _reset(self) -> None:
        self.bm.reset_prefix_cache()
        self.store.clear_memory()
        self.reset_pending = False

    # ---- engine steps ---------------------------------------------------------------------------
    def _step(self, data=None, loads_wait: bool = False) -> None:
        """One engine step. Whether each load asked about is ready: drawn from `data`; without it, ready
        at once, or (loads_wait) only once the scheduler waits for it."""
        self.asked = 0
        if data is not None:
            self.draw_ready = lambda seq: data.draw(st.booleans(), label=f"load of request {seq.request_id} ready")
        else:
            self.draw_ready = lambda seq: not loads_wait
        batch = self.sched.schedule()
        while not batch and self.sched.preempt_stalled():  # what LLM._schedule does
            batch = self.sched.schedule()
        if not batch and self.sched.has_unfinished():
            raise AssertionError(f"the scheduler could run nothing this step while requests wait: "
                                 f"{self.sched.all_sequences()}")
        self.pool.copy_blocks(batch.blocks_to_copy)
        for seq, start, n in zip(batch.seqs, batch.starts, batch.num_new_tokens):
            assert len(seq.block_table) >= blocks_needed(start + n, BS)
            fp = fingerprints(seq.token_ids)
            for p in range(start, start + n):  # the forward pass writes K/V [start, start + n)
                block = seq.block_table[p // BS]
                assert self.bm.ref_count[block] == 1 and not self.cache.holds(block), \
                    f"{seq} writes position {p} into block {block}, shared or cached"
                self.pool.k_cache[0, block, p % BS] = fp[p]
                self.pool.v_cache[0, block, p % BS] = -fp[p]
            if start + n == seq.num_tokens:
                seq.output_token_ids.append(SAMPLED)
                if len(seq.output_token_ids) >= seq.params.max_tokens:
                    seq.status, seq.finish_reason = SequenceStatus.FINISHED, "length"
        self.sched.update(batch)
        if self.reset_pending and not self._holds_blocks():
            self._reset()  # the deferred reset, as LLM._end_step does it

    @rule(data=st.data())
    def step(self, data):
        self._step(data)

    @rule(loads_wait=st.booleans())
    def drain(self, loads_wait):
        """Run to the end. loads_wait: loads are ready only when the scheduler waits for them (slow
        reads); else each is ready the first time it is asked about (fast reads)."""
        for _ in range(500):
            if not self.sched.has_unfinished():
                break
            self._step(loads_wait=loads_wait)
        assert not self.sched.has_unfinished(), "the scheduler did not drain"
        assert self.bm.num_free_blocks == self.num_blocks and not any(self.bm.ref_count)
        assert not self.bm.tier_loads.loads and not self.bm.tier_loads.loaded and not self.bm.offload.inflight
        if self.sched.swap is not None:
            assert self.sched.swap.num_free_blocks == self.sched.swap.allocator.num_blocks

    # ---- invariants -----------------------------------------------------------------------------
    @invariant()
    def blocks_queues_and_loads_are_consistent(self):
        sched, bm = self.sched, self.bm
        bm.check(self.seqs)
        places = {id(s): [] for s in self.seqs}
        for name in ("waiting", "running", "swapped", "loading"):
            for s in getattr(sched, name):
                places[id(s)].append(name)
        k = self.pool.k_cache[0, :, :, 0, 0].flatten().tolist()  # slot -> what the "model" wrote there
        for s in self.seqs:
            where = places[id(s)]
            assert len(where) == (0 if s.is_finished else 1), f"{s} is in {where or 'no queue'}"
            assert (s.status == SequenceStatus.RUNNING) == (where == ["running"])
            assert (s.status == SequenceStatus.SWAPPED) == (where == ["swapped"])
            if where == ["running"]:
                assert len(s.block_table) >= blocks_needed(s.num_computed_tokens, BS)
                fp = fingerprints(s.token_ids)
                for p in range(s.num_computed_tokens):
                    assert k[s.block_table[p // BS] * BS + p % BS] == fp[p], \
                        f"{s}: position {p} does not hold its K/V (block {s.block_table[p // BS]})"
            elif where == ["loading"]:
                self._check_loading(s)
            else:
                assert s.block_table == [], f"{s} holds blocks while {where or 'finished'}"
                assert s.seq_id not in bm.tier_loads.loads and s.seq_id not in bm.tier_loads.loaded
            if where != ["swapped"]:
                assert s.swap_table == []
        assert set(bm.tier_loads.loads) == {s.seq_id for s in sched.loading}
        assert not bm.tier_loads.loaded, "a loaded sequence kept its blocks after the pass that did not admit it"
        assert bm.offload.inflight == {pending for _, pending in bm.tier_loads.loads.values()}
        if sched.swap is not None:
            held = sum(1 for s in sched.swapped for c in s.swap_table if c >= 0)
            assert held + sched.swap.num_free_blocks == sched.swap.allocator.num_blocks

    def _check_loading(self, s: Sequence) -> None:
        """A loading sequence holds its hit: [0, m) cached blocks of its own prefix, then the blocks its
        reads will fill, which nobody else holds and the cache does not list yet."""
        assert s.status == SequenceStatus.WAITING
        hit, pending = self.bm.tier_loads.loads[s.seq_id]
        m = len(hit.blocks)
        assert s.block_table[:m] == hit.blocks and len(s.block_table) == hit.num_tokens // BS
        keys = block_hashes(s.token_ids, BS, s.cache_salt)
        for i, b in enumerate(hit.blocks):
            assert self.cache.key_of(b) == keys[i], f"{s}: hit block {b} is not its prefix's block {i}"
        for b in s.block_table[m:]:
            assert self.bm.ref_count[b] == 1 and not self.cache.holds(b), f"{s}: load block {b} shared or cached"
        assert pending.blocks == s.block_table[m:m + len(pending.blocks)]


LoadsMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
# slow: 300 runs of up to 40 steps (the test below keeps a quick check of loads in `make test-fast`)
TestSchedulerWithLoads = pytest.mark.slow(LoadsMachine.TestCase)


def test_a_sequence_preempted_while_a_load_holds_the_pool_runs_once_the_loaded_one_gives_way():
    """The machine's shrunk trace of the stall 23d4b8f fixed, on a path without swap. The second request,
    decoding, outgrows the pool while the fourth's prefix loads from disk, and preempts itself (recompute).
    The scheduler waits for the load; the loaded request may not pass the preempted one (longest cached
    prefix first: the preempted one's is longer), which does not fit beside it, so it gives its blocks back
    at the end of the pass. Nothing is loading any more: the scheduler must look again (before the fix it
    stopped: 'could run nothing this step while requests wait'), and the preempted one fits."""
    m = LoadsMachine()
    try:
        m.configure(mode="recompute", num_blocks=6, budget=12, chunked=False, max_seqs=1, swap_blocks=0,
                    cpu_blocks=0, policy="lpm", eviction="lru", warm=True,
                    first=[Request(doc=1, doc_blocks=3, suffix=[1], max_tokens=1, priority=0),
                           Request(doc=1, doc_blocks=1, suffix=[1, 1], max_tokens=6, priority=0)])
        for req in [Request(doc=0, doc_blocks=0, suffix=[], max_tokens=1, priority=0),
                    Request(doc=0, doc_blocks=2, suffix=[1], max_tokens=1, priority=0)]:
            m._add(req.prompt, req.max_tokens, req.priority)
        m._step(loads_wait=True)  # reads are slow: a load is ready only once the scheduler waits for it
        m.blocks_queues_and_loads_are_consistent()
        m.drain(loads_wait=True)
        assert m.sched.num_recomputes >= 1 and m.bm.offload.num_async_loads >= 2
    finally:
        m.teardown()
