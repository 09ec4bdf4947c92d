"""Block pool and scheduler invariants under random traces (Hypothesis state machine).

The model is left out: a "step" appends one fake token to every sequence the scheduler ran to the
end of its known tokens, exactly where the engine would sample. What is checked after every rule:
  - ref_count of every block == number of block tables holding it; used + free == total
  - every sequence is in exactly one place (waiting / running / swapped / finished)
  - a running sequence holds enough blocks for its computed tokens; others hold none
  - swap space: blocks held by swapped sequences + free == total
  - with a sliding window: every block a running sequence gave back is out of sight of its next
    query, and none it still holds could go back (freed as soon as it falls outside)
  - after the drain, every block and every swap block is free
"""
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minikv.cache.block_manager import BlockManager, blocks_needed
from minikv.cache.blocks.pool import KVPool
from minikv.cache.blocks.swap import SwapSpace
from minikv.cache.blocks.window import NO_BLOCK, first_seen, window_free_rule
from minikv.engine.sampling_params import SamplingParams
from minikv.engine.scheduler import Scheduler
from minikv.engine.sequence import Sequence, SequenceStatus

BLOCK_SIZE = 4
NUM_BLOCKS = 12


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.mode = None
        self.seqs: list[Sequence] = []

    def _setup(self, mode: str, budget: int, chunked: bool, max_seqs: int, swap_blocks: int, window=None):
        pool = KVPool(1, NUM_BLOCKS, BLOCK_SIZE, 1, 2, torch.float32, "cpu")
        self.window = window  # (sliding_window, sink_tokens) or None
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE, **(dict(sliding_window=window[0], sink_tokens=window[1])
                                                         if window else {}))
        swap = SwapSpace(pool, swap_blocks) if mode == "swap" else None
        budget = budget if chunked else max(budget, NUM_BLOCKS * BLOCK_SIZE)
        self.sched = Scheduler(self.bm, max_seqs, budget, chunked, mode, swap)
        self.mode = mode

    @precondition(lambda self: self.mode is None)
    @rule(mode=st.sampled_from(["recompute", "swap"]), budget=st.integers(1, 24), chunked=st.booleans(),
          max_seqs=st.integers(1, 6), swap_blocks=st.integers(0, 16),
          window=st.sampled_from([None, None, (4, 0), (6, 1), (8, 5), (5, 5)]))
    def configure(self, mode, budget, chunked, max_seqs, swap_blocks, window):
        self._setup(mode, budget, chunked, max_seqs, swap_blocks, window)

    @precondition(lambda self: self.mode is not None)
    @rule(prompt_len=st.integers(1, 20), max_tokens=st.integers(1, 16), priority=st.integers(0, 2))
    def arrive(self, prompt_len, max_tokens, priority):
        max_tokens = min(max_tokens, NUM_BLOCKS * BLOCK_SIZE - prompt_len)  # the engine caps at max_model_len
        seq = Sequence(list(range(prompt_len)), SamplingParams(max_tokens=max(1, max_tokens), priority=priority))
        self.seqs.append(seq)
        self.sched.add(seq)

    @precondition(lambda self: self.mode is not None)
    @rule()
    def step(self):
        batch = self.sched.schedule()
        if not batch and self.sched.has_unfinished():
            raise AssertionError(f"scheduler ran nothing while requests wait: {self.sched.all_sequences()}")
        for seq, start, n in zip(batch.seqs, batch.starts, batch.num_new_tokens):
            assert len(seq.block_table) >= blocks_needed(start + n, BLOCK_SIZE)
            if start + n == seq.num_tokens:
                seq.output_token_ids.append(7)
                if len(seq.output_token_ids) >= seq.params.max_tokens:
                    seq.status, seq.finish_reason = SequenceStatus.FINISHED, "length"
        self.sched.update(batch)

    @precondition(lambda self: self.mode is not None and any(not s.is_finished for s in self.seqs))
    @rule(data=st.data())
    def abort(self, data):
        live = [s for s in self.seqs if not s.is_finished]
        seq = data.draw(st.sampled_from(live))
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        self.sched.abort(seq)

    @precondition(lambda self: self.mode is not None)
    @rule()
    def drain(self):
        for _ in range(2000):
            if not self.sched.has_unfinished():
                break
            self.step()
        assert not self.sched.has_unfinished(), "the scheduler did not drain"
        assert self.bm.num_free_blocks == NUM_BLOCKS and all(c == 0 for c in self.bm.ref_count)
        if self.sched.swap is not None:
            assert self.sched.swap.num_free_blocks == self.sched.swap.allocator.num_blocks

    @invariant()
    def blocks_and_queues_are_consistent(self):
        if self.mode is None:
            return
        self.bm.check(self.seqs)
        places = {id(s): 0 for s in self.seqs}
        for q in (self.sched.waiting, self.sched.running, self.sched.swapped):
            for s in q:
                places[id(s)] += 1
        for s in self.seqs:
            expected = 0 if s.is_finished else 1
            assert places[id(s)] == expected, f"{s} is in {places[id(s)]} queues"
            if s.status == SequenceStatus.RUNNING:
                assert len(s.block_table) >= blocks_needed(s.num_computed_tokens, BLOCK_SIZE)
                if self.window:
                    w, sinks = self.window
                    for i, b in enumerate(s.block_table):
                        if b == NO_BLOCK:
                            assert i * BLOCK_SIZE >= sinks and (i + 1) * BLOCK_SIZE <= first_seen(
                                s.num_computed_tokens, w), f"{s}: block {i} given back while still in sight"
                    assert window_free_rule(s.block_table, s.num_computed_tokens, BLOCK_SIZE, w, sinks) == [], \
                        f"{s} still holds blocks outside its window"
                else:
                    assert NO_BLOCK not in s.block_table
            else:
                assert s.block_table == [], f"{s} holds blocks while {s.status.value}"
            if s.status != SequenceStatus.SWAPPED:
                assert s.swap_table == []
        if self.sched.swap is not None:
            held = sum(1 for s in self.sched.swapped for c in s.swap_table if c != NO_BLOCK)
            assert held + self.sched.swap.num_free_blocks == self.sched.swap.allocator.num_blocks


SchedulerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestSchedulerInvariants = SchedulerMachine.TestCase
