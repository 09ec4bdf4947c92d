"""Drill: one scheduler step over the running sequences, with preemption (30 minutes).

A RunningSeq (minikv.checks.preemption.RunningSeq) has request_id, num_tokens, num_computed_tokens,
num_blocks, priority (lower = more important) and arrival (larger = newer).

1. pick_victim(candidates) -> RunningSeq
       the least important: the largest priority value, then the newest arrival

2. schedule_running(running, budget, free_blocks, block_size, preemption, swap_free_blocks)
       -> (batch, preempted)
   Go through `running` (oldest first). Each sequence wants n = min(tokens left to run, budget) tokens
   (skip it if n == 0) and needs ceil((num_computed_tokens + n) / block_size) - num_blocks new blocks.
   While they do not fit in free_blocks, preempt pick_victim(...) among the sequences still running
   and not already in this step's batch: its blocks become free; it is preempted by "swap" when
   preemption == "swap" and swap_free_blocks holds all its blocks (which uses them up), else by
   "recompute". A sequence that preempts itself does not run this step.
       batch      [(request_id, num_tokens)] in order
       preempted  [(request_id, "recompute" | "swap")] in the order they were preempted

Check it with: minikv drill check scheduler-preemption
"""


def pick_victim(candidates):
    raise NotImplementedError("write pick_victim")


def schedule_running(running, budget: int, free_blocks: int, block_size: int, preemption: str,
                     swap_free_blocks: int):
    raise NotImplementedError("write schedule_running")
