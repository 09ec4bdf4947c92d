"""The overlapped step (async scheduling): the host prepares step t+1 while the device runs step t.

A plain step takes turns with the device. The host schedules and builds the batch with the device
idle, launches the model, then waits for the sampled ids before it can append them and schedule
again:

    host    | schedule t | prepare t | launch |  wait ............ | append t | schedule t+1 | ...
    device  |            idle                 | forward t, sample t |      idle                | ...

SGLang's overlap scheduler and vLLM's async scheduling break the turn-taking: a sequence that samples
at step t is one token longer at step t+1 whatever that token is, so step t+1 can be scheduled and
prepared before the token is known. Its input id stays on the device, in step t's sampled-ids
tensor, and is gathered from there into step t+1's input ids (stream order makes that correct):

    host    | schedule t+1 | prepare t+1 | sample t, launch t+1 | wait t | append t | schedule t+2 ...
    device  | ........ forward t ..........| sample t | forward t+1 ..................| sample t+1 ...

One engine call (`LLM.step`) with a step t in flight:
    1. t's sampling sequences get a PLACEHOLDER token and t counts as computed (the scheduler's own
       update, nothing finishes yet);
    2. step t+1 is scheduled and prepared on the host: its rows of those sequences are "fed";
    3. t is sampled on the device (ids copied to pinned host memory, an event recorded), then t+1 is
       launched with its fed rows gathered from t's ids;
    4. the host waits for t's ids only now, writes them over the placeholders, applies the stop rules,
       detokenizes and publishes the events of t, while t+1 runs. Step t+1 stays in flight.
t is sampled only after t+1 is prepared: top-k / top-p rows wait for the device inside the sampler
(did each row's set fit among its candidates?), and there that wait costs nothing, as the host has
nothing left to do before the launch.

Every call still returns the events of exactly one step, so `step()` keeps its meaning (one step's
tokens, at most one per sequence). One thing moves: a request added between two calls is scheduled
a step later than without the overlap, since the step after the last call is already on the device.
Its tokens are the same (a draw depends on the seed and the position, not on the batch).

A sequence that finishes at t (EOS, a stop string, max_tokens) was already scheduled in t+1: that row
is wasted, its token discarded, and the sequence leaves the running queue at once; its blocks go back
only after t+1 is done on the device (`InFlight.free_after`): a block the device may still write is
never handed out again. An abort between steps is deferred the same way.

Overlap is only used where it is simple and right (`LLM._can_overlap`): no beam search, no forks
still to make (n > 1 samples fork when their prompt is done), nothing swapped out, no offload store
(its loads copy blocks outside the step), no deferred prefix-cache reset, and enough free blocks that
step t+1 cannot preempt anyone (`min_free_blocks`: a preempted sequence would leave with a
placeholder as its last token). Otherwise the step in flight finishes the plain way first and the
next step is scheduled as usual. Steps that only run prefill chunks (nothing sampled) overlap too.

Observers hear `on_schedule` of step t+1 once it is launched, before `on_step` of step t: in the
batch they see, the sequences of step t end with a PLACEHOLDER token.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minikv.engine.batch import ScheduledBatch
from minikv.engine.sequence import Sequence

PLACEHOLDER = -1  # the token of a sequence whose sampled id is still on the device (never a real id)


@dataclass
class InFlight:
    """A step launched on the device whose sampled ids the host has not read yet."""

    batch: ScheduledBatch
    logits: torch.Tensor  # [len(seqs), vocab] of the sampling rows
    seqs: list[Sequence]  # the sequences of the sampling rows, in row order
    keys: list[int]  # each row's draw key, taken when the step was prepared
    free_after: list[Sequence] = field(default_factory=list)  # finished; blocks go back once the step is done
    failed_rows: set[int] = field(default_factory=set)  # rows whose sampling failed (finish_reason "error")
    done: torch.cuda.Event | None = None  # recorded after the step's sampled ids were copied to the host
    plan: object = None  # the sampling rows' DrawPlan (minikv/engine/sampler.py), None: made when sampled

    def wait(self) -> None:
        """Block until the device has finished this step (its ids are on the host)."""
        if self.done is not None:
            self.done.synchronize()
        elif self.logits.device.type == "cuda":
            torch.cuda.current_stream(self.logits.device).synchronize()


def min_free_blocks(num_running: int, max_num_batched_tokens: int, block_size: int) -> int:
    """Free blocks that guarantee the next step preempts nobody. A running sequence writing n tokens
    from position c needs ceil((c + n) / block_size) - ceil(c / block_size) <= n / block_size + 1 new
    blocks, plus at most one private copy (copy-on-write) of the shared block holding position c;
    the n of all of them add up to at most the token budget."""
    return 2 * num_running + -(-max_num_batched_tokens // block_size)


def without_finished(batch: ScheduledBatch) -> ScheduledBatch:
    """The batch without its finished sequences (wasted rows and aborts): what the scheduler updates."""
    if not any(s.is_finished for s in batch.seqs):
        return batch
    kept = ScheduledBatch(preempted=batch.preempted, blocks_to_copy=batch.blocks_to_copy)
    for seq, start, n in zip(batch.seqs, batch.starts, batch.num_new_tokens):
        if not seq.is_finished:
            kept.add(seq, start, n)
    return kept
