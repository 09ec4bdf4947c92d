"""One request's state as it moves through the engine.

    WAITING -> RUNNING -> FINISHED
                 |  ^
    (preempted)  v  |
            WAITING (recompute) or SWAPPED (KV copied to CPU)

    token_ids = prompt_token_ids + output_token_ids
    [0, num_computed_tokens)              K/V already in the cache
    [num_computed_tokens, num_tokens)     still to run through the model
"""
from __future__ import annotations

import enum
import itertools
import time

from minikv.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


_ids = itertools.count()


class Sequence:
    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                 cache_salt: str | None = None, prompt: str | None = None):
        self.seq_id = next(_ids)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.prompt_bytes: bytes | None = None  # the prompt's ids as 8 little-endian bytes each, where known
        self.output_token_ids: list[int] = []
        self.params = params
        self.cache_salt = cache_salt
        self.tenant: str | None = None  # who sent it (fair scheduling between tenants, minikv/engine/fair.py)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache
        self.block_table: list[int] = []  # paged: physical block ids, in order
        self.cache_row: int | None = None  # contiguous: the row it owns
        self.swap_table: list[int] = []  # swapped: CPU swap blocks holding its KV, in order
        self.finish_reason: str | None = None  # stop, length, abort, or error (then `error` says why)
        self.error: str | None = None
        self.text = ""
        self.decode_state = None  # its incremental detokenizer's window (minikv/engine/detokenizer.py)
        self.seed = 0  # its draws are keyed by (seed, position) (minikv/engine/sampler.py)
        # forks (parallel sampling, beam search; see minikv/engine/fork.py)
        self.index = 0  # which of its request's samples / beams this sequence is
        self.root: Sequence = self  # the sequence its request started as (forks point to it)
        self.num_pending_forks = 0  # n - 1 until the prompt's logits come, then the samples are forked
        self.forks: list[Sequence] = []  # the samples forked from this one, in index order
        self.beam_search = None  # the BeamSearch this sequence is a beam of, if any
        self.cumulative_logprob = 0.0
        # timings (perf_counter seconds)
        self.arrival_time = time.perf_counter()
        self.token_times: list[float] = []
        self.num_preemptions = 0
        # speculative decoding (rung 11): draft tokens verified, and how many the target kept
        self.num_drafted_tokens = 0
        self.num_accepted_tokens = 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def status(self) -> SequenceStatus:
        return self._status

    @status.setter
    def status(self, status: SequenceStatus) -> None:
        self._status = status
        # a plain attribute, set with the status: read several times per sequence and step
        self.is_finished = status is SequenceStatus.FINISHED

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    def __repr__(self) -> str:
        return (f"Sequence(id={self.request_id}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")
