"""Parallel sampling on shared blocks: prefill a prompt ONCE, then fork it into n samples.

    SamplingParams(n=3), prompt of 10 tokens, block_size 4

    after the prefill:   parent  [b0 b1 b2]        b2 holds positions 8-9 (2 of 4 slots used)
    fork x2:             parent  [b0 b1 b2]        ref_count: b0 3, b1 3, b2 3
                         child 1 [b0 b1 b2]
                         child 2 [b0 b1 b2]
    each samples its first token from the SAME prompt logits, with its own generator

    next step, every sample writes position 10 into b2 (shared): copy-on-write
                         parent  [b0 b1 b3]        b3 = copy of b2   (copy 1)
                         child 1 [b0 b1 b4]        b4 = copy of b2   (copy 2)
                         child 2 [b0 b1 b2]        last owner: b2's ref_count is 1, it writes in place

Blocks b0, b1 stay shared for the whole generation: n samples of a long prompt cost the prompt's
blocks once, plus one block per sample for every block_size generated tokens.

Reproducible: with `seed=s`, sample i draws with seed `s + i` (minikv/engine/sampler.py), so sample i equals
a single request run with `seed=s + i`.
"""
from __future__ import annotations

import torch

from minikv.engine.sequence import Sequence


def sample_seed(seq: Sequence, index: int, engine_rng: torch.Generator) -> int:
    """Sample `index` of a request draws with seed + index (without a seed: a fresh one from the engine's)."""
    seed = seq.params.seed
    return seed + index if seed is not None else new_seed(engine_rng)


def new_seed(engine_rng: torch.Generator) -> int:
    """A seed for a request that gave none, drawn from the engine's generator (LLM(seed=...))."""
    return int(torch.randint(0, 2**62, (1,), generator=engine_rng))


def clone(parent: Sequence, index: int) -> Sequence:
    """A new sequence with the parent's tokens and bookkeeping; it holds no blocks yet."""
    root = parent.root
    child = Sequence(parent.prompt_token_ids, parent.params, request_id=f"{root.request_id}/{index}",
                     cache_salt=parent.cache_salt, prompt=parent.prompt)
    child.index, child.root = index, root
    child.output_token_ids = list(parent.output_token_ids)
    child.text = parent.text
    child.arrival_time = parent.arrival_time
    child.token_times = list(parent.token_times)
    child.num_cached_tokens = parent.num_cached_tokens
    child.cumulative_logprob = parent.cumulative_logprob
    child.beam_search = parent.beam_search
    child.seed = parent.seed
    return child


def fork_samples(scheduler, seqs: list[Sequence], logits: torch.Tensor, shared: torch.Generator
                 ) -> tuple[list[Sequence], torch.Tensor]:
    """Called with the sequences that are about to sample and their logits [len(seqs), vocab].

    A sequence with pending forks has just finished its prompt: fork it into its n - 1 other
    samples, which share its blocks and sample from the same logits row. Returns the sequences and
    logits rows to sample from, children appended after the others.
    """
    rows = list(range(len(seqs)))
    out = list(seqs)
    for row, seq in enumerate(seqs):
        if not seq.num_pending_forks:
            continue
        while seq.num_pending_forks:  # one at a time: a fault half-way never forks a sample twice
            i = len(seq.forks) + 1
            child = clone(seq, i)
            child.seed = sample_seed(seq, i, shared)
            # the prompt's K/V are all in the parent's blocks once this step is done
            scheduler.fork(seq, child, num_computed_tokens=seq.num_tokens)
            seq.forks.append(child)
            seq.num_pending_forks -= 1
            out.append(child)
            rows.append(row)
    if len(out) == len(seqs):
        return seqs, logits
    return out, logits[rows]


def samples_of(seq: Sequence) -> list[Sequence]:
    """Every sample of the request `seq` started: itself, then its forks, by index."""
    return [seq] + seq.forks
