"""What one engine step runs: the scheduler's output, the model runner's input.

    seqs            [a,  b,  c ]
    starts          [9,  0,  16]    first position each runs: [start, start + n) this step
    num_new_tokens  [1,  16, 4 ]    a decode, a whole prompt, a chunk of a longer prompt

SimpleScheduler (rungs 1-2) and Scheduler (rungs 4-6) fill one; the model runner flattens it into one
varlen batch; the scheduler's update() reads it back after the step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from minikv.engine.sequence import Sequence


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # tokens each sequence runs this step
    starts: list[int] = field(default_factory=list)  # first position each sequence runs this step
    preempted: list[Sequence] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst), before the forward

    def __len__(self) -> int:
        return len(self.seqs)

    def add(self, seq: Sequence, start: int, n: int) -> None:
        self.seqs.append(seq)
        self.starts.append(start)
        self.num_new_tokens.append(n)
