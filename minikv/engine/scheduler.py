"""Rung 5: continuous batching. Every step, decide which sequences run and how many tokens each.

    queues:  waiting (new or preempted by recompute) | running | swapped (KV parked in CPU memory)

    one step, token budget = max_num_batched_tokens:
      1. running sequences, oldest first: a decode takes 1 token, an unfinished prefill takes the
         next chunk of its prompt (chunked prefill). A sequence that needs a new block and finds
         none preempts the least important running sequence (lowest priority, then newest). A
         decode whose token lands in a block it holds alone (most of them, most steps) has nothing
         to grow or copy and skips the block manager's checks.
      2. if nothing was preempted: swapped sequences come back when their blocks fit
      3. then waiting sequences are admitted while blocks, budget and max_num_seqs allow (oldest
         first; with schedule_policy="vtc", the least-served tenant's first: minikv/engine/fair.py)

Preemption modes: "recompute" frees the victim's blocks and requeues it at the front of waiting
(its prompt AND generated tokens are prefilled again later); "swap" copies its blocks to the CPU
swap space and frees them (falls back to recompute if the swap space is full).

Forks (parallel samples, beams) share blocks: a step that writes into a shared block first gets a
private copy (`BlockManager.copy_on_write`; the (src, dst) pairs travel in `batch.blocks_to_copy`).
Freeing or swapping out a forked sequence only drops ITS references: shared blocks stay with the
others. A running sequence with nothing to run (a beam waiting for its siblings) is "stalled".

Prefix caching (rung 6): a waiting sequence starts on the longest cached prefix of its tokens,

    [0, hit)            blocks taken from the prefix cache, no compute
    [hit, num_tokens)   prefilled as usual (chunked if long)

and after every step its newly full blocks join the cache. policy="lpm" admits the waiting
sequence with the longest cached prefix first (SGLang's cache-aware scheduling): more hits, but a
request that shares nothing can wait as long as others that share keep arriving (starvation).

Offload tiers (rung 9): a waiting sequence whose hit reads files from the disk tier does not hold
the step up. Its reads start and it waits in `loading` while the others run; once they are done
its blocks go into the pool in one copy and it is admitted first, on its loaded prefix:

    waiting --lookup hits disk--> loading --reads done--> front of waiting --> running
                                     |  abort: its blocks go back, its reads finish unseen
    a step with nothing else to run waits for the oldest load instead of returning an empty batch;
    a loaded sequence that is not admitted (a swapped one goes first, or a longer cached prefix with
    "lpm") gives its blocks back at the end of the pass, and an empty step then looks again: the one
    ahead of it may fit now

Sliding window (rung 8): after every step (and on admission onto a cached prefix) the block
manager gives back the blocks no later query of the sequence sees (`free_outside_window`); their
table entries become -1, and a swapped-out sequence keeps those holes (nothing to copy or restore).

A learner's decision (exercise 05a) plugs in with `Scheduler(..., schedule_step=fn)`, or
`LLM(..., kv_backend="paged", schedule_step=fn)` (the seam: minikv/engine/schedule_step.py). The
scheduler asks it every step in place of steps 1-3, admits the waiting sequences it chose and grows
their block tables; it never preempts: the exercise covers the case where everything fits.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

from minikv.cache.block_manager import BlockManager, blocks_needed, copy_on_write_rule
from minikv.cache.blocks.swap import SwapSpace
from minikv.cache.blocks.window import NO_BLOCK
from minikv.engine.batch import ScheduledBatch
from minikv.engine.fair import VirtualTokenCounter
from minikv.engine.schedule_step import ScheduleStep, checked_decision
from minikv.engine.sequence import Sequence, SequenceStatus

PREEMPTION_MODES = ("recompute", "swap")


class Scheduler:
    """schedule_step: a function deciding each step's batch in place of the built-in policy (see above).
    on_event: called as on_event(step, request_id, event) for every arrive / admit / preempt / swap_out /
    swap_in / fork / finish / abort (the engine hands them to its observers)."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, preemption: str = "recompute",
                 swap_space: SwapSpace | None = None, schedule_step: ScheduleStep | None = None,
                 on_event: Callable[[int, str, str], None] | None = None):
        if preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {PREEMPTION_MODES}, got {preemption!r}")
        if preemption == "swap" and swap_space is None:
            raise ValueError("preemption='swap' needs a swap space (swap_blocks > 0)")
        if schedule_step is not None and not callable(schedule_step):
            raise TypeError("schedule_step must be a function (running, waiting, budget, max_num_seqs, free_blocks, "
                            f"block_size) -> [(request_id, num_tokens), ...], got {schedule_step!r}")
        self.schedule_step = schedule_step
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = enable_chunked_prefill
        self.preemption = preemption
        self.swap = swap_space
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.loading: list[Sequence] = []  # waiting for their prefix to come back from disk (rung 9)
        self.finishing: list[Sequence] = []  # finished, blocks kept while a step on the device may write them
        self.gave_back_loads = False  # the last pass freed loaded sequences it could not admit
        self.num_preemptions = 0
        self.num_recomputes = 0
        self.num_swaps = 0
        self.on_event = on_event
        self.step_index = 0
        self.policy = "fcfs"  # or "lpm": longest cached prefix first (needs a prefix cache)
        self.fair: VirtualTokenCounter | None = None  # set: admit by tenant counters (minikv/engine/fair.py)
        self.num_drafts: Callable[[Sequence], int] | None = None  # rung 11: draft tokens at the end of a sequence

    # ---- queues ---------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if self.fair is not None:
            self.fair.arrive(seq, self.all_sequences())
        self.waiting.append(seq)
        self._trace(seq, "arrive")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.loading)

    def _trace(self, seq: Sequence, event: str) -> None:
        if self.on_event is not None:
            self.on_event(self.step_index, seq.request_id, event)

    # ---- one step -------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        if self.schedule_step is not None:
            return self._schedule_with(self.schedule_step)
        batch = self._schedule()
        while not batch and (self.loading or self.gave_back_loads):
            if not self.gave_back_loads:  # only loads are left: wait for the oldest, then admit it
                self.bm.wait_for_load(self.loading[0])
            # else: loaded sequences that were not admitted (a swapped sequence goes first, or with "lpm" a
            # preempted one with a longer cached prefix) gave their blocks back at the end of that pass,
            # after the one ahead of them had been found not to fit: look again, it may fit now
            batch = self._schedule()
        self.step_index += 1
        return batch

    def _schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preempted_now = False

        # 1. running sequences, oldest first (they hold blocks already)
        bm, preempted = self.bm, batch.preempted
        bs, ref_count = bm.block_size, bm.ref_count
        in_place = bm.copy_on_write_fn is copy_on_write_rule  # a rule of one's own is asked every step
        add_seq, add_start, add_n = batch.seqs.append, batch.starts.append, batch.num_new_tokens.append
        for seq in list(self.running):
            if preempted and seq in preempted:  # preempted earlier in this loop (a short list, mostly empty;
                continue  # a test of `in self.running` was O(running) per sequence: quadratic per step)
            c = seq.num_computed_tokens
            if in_place and budget and len(seq.prompt_token_ids) + len(seq.output_token_ids) - c == 1:
                # a decode whose token goes into a block it holds alone: nothing to grow or copy (the
                # slow path below would find the same); most sequences, most steps
                table, i = seq.block_table, c // bs
                if i < len(table) and table[i] >= 0 and ref_count[table[i]] == 1:
                    add_seq(seq)  # batch.add(seq, c, 1), without the call
                    add_start(c)
                    add_n(1)
                    budget -= 1
                    continue
            n = self._tokens_to_run(seq, budget)
            if n == 0:
                continue
            while not self.bm.can_grow(seq, seq.num_computed_tokens + n):
                if n > seq.num_tokens - seq.num_computed_tokens - self._drafts(seq):
                    n -= 1  # speculation shrinks before anyone is preempted
                    continue
                victim = self._pick_victim(exclude=batch.seqs)
                self._preempt(victim, batch)
                preempted_now = True
                if victim is seq:
                    break
            if seq in batch.preempted:
                continue
            self.bm.grow(seq, seq.num_computed_tokens + n)
            batch.blocks_to_copy += self.bm.copy_on_write(seq, seq.num_computed_tokens + n)
            batch.add(seq, seq.num_computed_tokens, n)
            budget -= n

        # 2. swapped sequences come back first, in the order they left
        while self.swapped and not preempted_now and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            n = self._tokens_to_run(seq, budget)
            holes = sum(1 for c in seq.swap_table if c == NO_BLOCK)  # given back by a window: none needed
            need = blocks_needed(seq.num_computed_tokens + n, self.bm.block_size) - holes
            if n == 0 or need > self.bm.num_free_blocks:
                break
            self.swapped.popleft()
            self._swap_in(seq)
            self.bm.grow(seq, seq.num_computed_tokens + n)
            batch.add(seq, seq.num_computed_tokens, n)
            budget -= n

        # 3. admit waiting sequences (those whose loads are done first)
        loaded = self._finish_loads()
        if self.policy == "lpm":
            self._longest_prefix_first()
        while self.waiting and not preempted_now and not self.swapped and len(self.running) < self.max_num_seqs:
            i = self.fair.next_index(list(self.waiting)) if self.fair is not None else 0
            seq = self.waiting[i]
            hit = self.bm.match_prefix(seq)  # [0, hit.num_tokens) already in the prefix cache
            start = max(seq.num_computed_tokens, hit.num_tokens)
            n = self._tokens_to_run(seq, budget, start)
            if n == 0 or not self.bm.can_admit(seq, hit, start + n):
                break
            if len(self.running) + seq.num_pending_forks >= self.max_num_seqs:  # its n samples need seats
                break
            if self.bm.start_load(seq, hit):  # its prefix is on disk: read it while the others run
                del self.waiting[i]
                self.loading.append(seq)
                self._trace(seq, "load")
                continue
            del self.waiting[i]
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._trace(seq, "admit")
            cached = self.bm.acquire_prefix(seq, hit)  # [0, cached) served by the prefix cache
            if cached is not None:
                seq.num_computed_tokens = cached
                if seq.num_preemptions == 0:  # what the request saved on arrival (a recompute may hit more)
                    seq.num_cached_tokens = cached
                self.bm.free_outside_window(seq)  # a long cached prefix: blocks before the window go back
            if self.fair is not None and seq.num_preemptions == 0:  # its tenant pays for the prompt once
                self.fair.admitted(seq, seq.num_prompt_tokens - seq.num_computed_tokens)
            self.bm.grow(seq, seq.num_computed_tokens + n)
            batch.blocks_to_copy += self.bm.copy_on_write(seq, seq.num_computed_tokens + n)
            batch.add(seq, seq.num_computed_tokens, n)
            budget -= n
        self.gave_back_loads = False
        for seq in loaded:
            if seq.status == SequenceStatus.WAITING:  # not admitted this step: it holds no blocks while it waits
                self.bm.free(seq)
                self.gave_back_loads = True
        return batch

    def _finish_loads(self) -> list[Sequence]:
        """Sequences whose reads are done: their blocks go into the pool and they wait at the front."""
        done = [s for s in self.loading if self.bm.load_ready(s)]
        for seq in reversed(done):
            self.loading.remove(seq)
            self.bm.finish_load(seq)
            self.waiting.appendleft(seq)
        return done

    def _schedule_with(self, schedule_step: ScheduleStep) -> ScheduledBatch:
        """One step decided by `schedule_step`: ask it, check its answer, then apply it the way the
        built-in policy would (admit, grow, copy-on-write), running ones and admitted ones in its order."""
        decision = checked_decision(schedule_step, self.running, list(self.waiting), self.max_num_batched_tokens,
                                    self.max_num_seqs, self.bm, f"at engine step {self.step_index}")
        batch = ScheduledBatch()
        for seq, n in decision:
            if seq.status == SequenceStatus.WAITING:
                self.waiting.remove(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                self._trace(seq, "admit")
            self.bm.grow(seq, seq.num_computed_tokens + n)
            batch.blocks_to_copy += self.bm.copy_on_write(seq, seq.num_computed_tokens + n)
            batch.add(seq, seq.num_computed_tokens, n)
        self.step_index += 1
        return batch

    def _tokens_to_run(self, seq: Sequence, budget: int, start: int | None = None) -> int:
        """Tokens of `seq` that go into this step: 1 for a decode, a chunk (or all) of a prefill."""
        remaining = seq.num_tokens - (seq.num_computed_tokens if start is None else start)
        if remaining <= budget:
            return remaining
        if not self.chunked_prefill and remaining - self._drafts(seq) <= budget:
            return budget  # its draft tokens shrink to the budget
        return budget if self.chunked_prefill else 0

    def _drafts(self, seq: Sequence) -> int:
        """Draft tokens at the end of seq's tokens (speculative decoding: they may shrink, to none)."""
        return self.num_drafts(seq) if self.num_drafts is not None else 0

    def _longest_prefix_first(self) -> None:
        """Reorder the waiting queue: longest cached prefix first, arrival order among equals."""
        if self.bm.prefix_cache is not None and 1 < len(self.waiting) <= 128:  # SGLang's cut-off too
            self.waiting = deque(sorted(self.waiting, key=lambda s: -self.bm.match_prefix(s).num_tokens))

    def _pick_victim(self, exclude: list[Sequence]) -> Sequence:
        """Least important running sequence not yet placed in this step's batch: largest priority
        value, then the newest arrival. The sequence asking for a block is always a candidate."""
        placed = {id(s) for s in exclude}
        candidates = [s for s in self.running if id(s) not in placed]
        return max(candidates, key=lambda s: (s.params.priority, s.arrival_time, s.seq_id))

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.num_preemptions += 1
        seq.num_preemptions += 1
        self.running.remove(seq)
        batch.preempted.append(seq)
        stalled = seq.num_computed_tokens == seq.num_tokens  # nothing to run: it could never swap back in
        use_swap = (self.preemption == "swap" and self.swap is not None and not stalled
                    and self.swap.num_free_blocks >= sum(1 for b in seq.block_table if b != NO_BLOCK))
        if use_swap:
            self.num_swaps += 1
            seq.swap_table = self.swap.swap_out(seq.block_table)
            self.bm.free(seq)
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            self._trace(seq, "swap_out")
        else:
            self.num_recomputes += 1
            self.bm.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)
            self._trace(seq, "preempt")

    def preempt_stalled(self) -> bool:
        """When a step could run nothing: free the blocks of the newest stalled sequence (recompute) so a
        waiting or swapped one can get in. It queues behind the waiting ones. False if there is none."""
        stalled = [s for s in self.running if s.num_computed_tokens == s.num_tokens]
        if not stalled or not (self.waiting or self.swapped):
            return False
        victim = self._pick_victim(exclude=[s for s in self.running if s not in stalled])
        self._preempt(victim, ScheduledBatch())
        self.waiting.remove(victim)
        self.waiting.append(victim)
        return True

    def fork(self, parent: Sequence, child: Sequence, num_computed_tokens: int) -> None:
        """`child` continues from `parent`, whose K/V of tokens [0, num_computed_tokens) are in its blocks.
        A running parent shares its blocks with the child (copy-on-write on the next write into a shared
        one). A parent without blocks (waiting, swapped), or no free seat, gives a child that is prefilled
        from its own tokens, like a recomputed sequence."""
        if parent.status == SequenceStatus.RUNNING and parent.block_table and len(self.running) < self.max_num_seqs:
            self.bm.fork(parent, child)
            child.num_computed_tokens = num_computed_tokens
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
        else:
            child.num_computed_tokens = 0
            child.status = SequenceStatus.WAITING
            self.waiting.append(child)
        self._trace(child, "fork")

    def _swap_in(self, seq: Sequence) -> None:
        holes = frozenset(i for i, c in enumerate(seq.swap_table) if c == NO_BLOCK)
        self.bm.grow(seq, len(seq.swap_table) * self.bm.block_size, holes)
        self.swap.swap_in(seq.swap_table, seq.block_table)
        seq.swap_table = []
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._trace(seq, "swap_in")

    # ---- after the model ran --------------------------------------------------------------------
    def update(self, batch: ScheduledBatch) -> None:
        bm, fair = self.bm, self.fair
        cache, window, bs = bm.prefix_cache is not None, bm.sliding_window is not None, bm.block_size
        each = fair is not None or cache or window
        for seq, start, n in zip(batch.seqs, batch.starts, batch.num_new_tokens):
            seq.num_computed_tokens = start + n
            if not each:  # no tenants to charge, no prefix cache, no window: nothing more per sequence
                continue
            if fair is not None and seq.output_token_ids and start + n == seq.num_tokens - 1:
                fair.generated(seq)  # it sampled a token this step
            if cache and (start + n) // bs > start // bs:  # a block filled up: it joins the prefix cache
                bm.cache_blocks(seq)  # (a decode fills one every block_size steps: the other steps ask nothing)
            if window:
                bm.free_outside_window(seq)  # blocks no later query sees go back
        for seq in [s for s in self.running if s.is_finished]:
            self.finish(seq)
        for seq in [s for s in self.waiting if s.is_finished]:  # a fork that finished on its first token
            self.waiting.remove(seq)                            # before it found a seat: holds no block
            self._trace(seq, "finish")
        bm.flush_offload()  # newly cached blocks go to the offload store's write-through (rung 9)

    def finish(self, seq: Sequence, keep_blocks: bool = False) -> None:
        """seq leaves the running queue and gives its blocks back. keep_blocks: not yet, a step still on
        the device may write into them (overlapped steps, minikv/engine/overlap.py); it waits in
        `finishing` until the engine calls `release(seq)` once that step is done."""
        self.running.remove(seq)
        if keep_blocks:
            self.finishing.append(seq)
        else:
            self.bm.free(seq)
        self._trace(seq, "finish" if seq.finish_reason != "abort" else "abort")

    def release(self, seq: Sequence) -> None:
        """A finishing sequence's blocks go back: no step on the device uses them any more."""
        self.finishing.remove(seq)
        self.bm.free(seq)

    def abort(self, seq: Sequence) -> None:
        if seq in self.running:
            self.finish(seq)
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.loading:  # its blocks go back below; its reads finish unseen
            self.loading.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
            self.swap.release(seq.swap_table)
            seq.swap_table = []
        self.bm.free(seq)
        self._trace(seq, "abort")

    def restart(self, block_manager: BlockManager, seqs: list[Sequence]) -> None:
        """Start over after a fault on a fresh block manager: these sequences wait to be computed again
        from their tokens (recompute, as after a preemption), in the order given; nothing is swapped."""
        self.bm = block_manager
        if self.swap is not None:
            self.swap.reset()
        for seq in seqs:
            seq.block_table, seq.swap_table = [], []
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
        self.running, self.swapped, self.loading, self.finishing = [], deque(), [], []
        self.waiting = deque(seqs)

    def all_sequences(self) -> list[Sequence]:
        """Every sequence queued or holding blocks (loading and finishing ones included)."""
        return list(self.waiting) + self.running + list(self.swapped) + self.loading + self.finishing
