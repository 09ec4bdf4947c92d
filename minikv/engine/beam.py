"""Beam search on shared blocks: keep the beam_width most likely continuations, not one.

    beam_width 2, each step: every live beam proposes its tokens, scored by cumulative logprob;
    the best 2 (beam, token) pairs over ALL beams survive.

    step t     beam A [p p p | a1]  -1.2        beam B [p p p | b1]  -1.9
    candidates A+a2 -1.5   A+x -1.7   B+b2 -2.6 ...         best two: A+a2, A+x
    step t+1   A   [p p p | a1 a2]   (A itself continues)
               A'  [p p p | a1 x ]   (fork of A: shares A's blocks, copy-on-write on its next write)
               B   dropped: its blocks go back (the prompt blocks stay, A and A' still hold them)

A beam whose best token is EOS becomes a finished hypothesis and leaves the live set. The search
ends when no beam is live or the beams reach max_tokens; the hypotheses are ranked by
cumulative_logprob / num_generated_tokens ** length_penalty (EOS not counted), best first.

In the engine a beam is an ordinary sequence: the scheduler batches, preempts and swaps it like any
other. Its logits are not sampled: they go to its BeamSearch, which moves only once every live beam
has handed in its next-token log-probabilities (a beam that is done waits, "stalled", for the
others). The tests check it against the same rule run with no cache at all, every beam recomputed
from scratch each step (tests/beam_reference.py): the engine must return the same beams.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from minikv.engine.fork import clone
from minikv.engine.sequence import Sequence, SequenceStatus


@dataclass
class Hypothesis:
    """A finished beam: what it generated and how likely it was."""

    token_ids: list[int]
    cumulative_logprob: float
    finish_reason: str  # "stop" (EOS) or "length"
    token_times: list[float] = field(default_factory=list)

    def score(self, length_penalty: float, eos_token_ids: set[int]) -> float:
        n = len(self.token_ids) - (self.finish_reason == "stop" and self.token_ids[-1] in eos_token_ids)
        return self.cumulative_logprob / max(1, n) ** length_penalty


def best_candidates(cumulative: list[float], logprobs: torch.Tensor, k: int) -> list[tuple[int, int, float]]:
    """The k best extensions (beam, token, new cumulative logprob) of the beams, best first.

    cumulative: [num_beams]; logprobs: [num_beams, vocab] of each beam's next token. Ties go to the
    lower beam, then the lower token id (a stable sort), so two runs on equal numbers agree.
    """
    scores = torch.tensor(cumulative, dtype=torch.float64)[:, None] + logprobs.double()  # [beams, vocab]
    vocab = scores.shape[1]
    k = min(k, scores.numel())
    # the best k overall are among each beam's best k: sort only those
    top = torch.topk(scores, min(k, vocab), dim=1).indices  # [beams, k]
    flat = (top + torch.arange(scores.shape[0])[:, None] * vocab).flatten().sort().values
    order = torch.sort(scores.flatten()[flat], descending=True, stable=True).indices[:k]
    return [(int(i) // vocab, int(i) % vocab, float(scores.flatten()[i])) for i in flat[order]]


class BeamSearch:
    """The beams of one prompt inside the engine."""

    def __init__(self, root: Sequence, beam_width: int, max_tokens: int, eos_token_ids: set[int],
                 ignore_eos: bool, max_model_len: int):
        self.root = root
        self.beam_width, self.max_tokens = beam_width, max_tokens
        self.eos_token_ids, self.ignore_eos, self.max_model_len = eos_token_ids, ignore_eos, max_model_len
        self.beams: list[Sequence] = [root]  # live beams
        self.finished: list[Hypothesis] = []
        self.pending: dict[int, torch.Tensor] = {}  # seq_id -> logprobs [vocab] of its next token
        self.num_beams_made = 1
        root.beam_search = self

    @property
    def done(self) -> bool:
        return not self.beams

    def receive(self, seq: Sequence, logits: torch.Tensor) -> bool:
        """A beam's next-token logits [vocab]; True once every live beam has handed its in."""
        self.pending[seq.seq_id] = torch.log_softmax(logits.float(), dim=-1)
        return all(b.seq_id in self.pending for b in self.beams)

    def advance(self, scheduler) -> None:
        """Pick the best beam_width extensions, fork beams with several survivors, drop the others."""
        beams = self.beams
        logprobs = torch.stack([self.pending[b.seq_id] for b in beams]).cpu()  # [beams, vocab]
        self.pending.clear()
        chosen = best_candidates([b.cumulative_logprob for b in beams], logprobs, self.beam_width)
        plan: list[tuple[Sequence, int, float]] = []
        kept: set[int] = set()
        for b, token, score in chosen:
            parent = beams[b]
            if token in self.eos_token_ids and not self.ignore_eos:
                self.finished.append(Hypothesis(parent.output_token_ids + [token], score, "stop",
                                                parent.token_times + [time.perf_counter()]))
                continue
            if parent.seq_id in kept:  # a second survivor of the same beam: fork it, blocks shared
                child = clone(parent, self.num_beams_made)
                self.num_beams_made += 1
                scheduler.fork(parent, child, num_computed_tokens=parent.num_computed_tokens)
            else:
                child = parent
                kept.add(parent.seq_id)
            plan.append((child, token, score))
        # every fork above copied its parent's tokens before any beam grows
        now = time.perf_counter()
        for seq, token, score in plan:
            seq.output_token_ids.append(token)
            seq.token_times.append(now)
            seq.cumulative_logprob = score
        for beam in beams:
            if beam.seq_id not in kept:
                _retire(scheduler, beam, "abort")
        self.beams = [seq for seq, _, _ in plan]
        if self.beams and (len(self.beams[0].output_token_ids) >= self.max_tokens
                           or self.beams[0].num_tokens >= self.max_model_len):
            for seq in self.beams:
                self.finished.append(Hypothesis(list(seq.output_token_ids), seq.cumulative_logprob, "length",
                                                list(seq.token_times)))
                _retire(scheduler, seq, "length")
            self.beams = []

    def results(self, length_penalty: float) -> list[Hypothesis]:
        """The best beam_width hypotheses, best first."""
        return rank(self.finished, self.beam_width, length_penalty, self.eos_token_ids)


def rank(hyps: list[Hypothesis], k: int, length_penalty: float, eos_token_ids: set[int]) -> list[Hypothesis]:
    order = sorted(range(len(hyps)), key=lambda i: (-hyps[i].score(length_penalty, eos_token_ids), i))
    return [hyps[i] for i in order[:k]]


def _retire(scheduler, seq: Sequence, reason: str) -> None:
    """Take a beam out of the engine, wherever it is (running, waiting, swapped); its blocks go back."""
    seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
    scheduler.abort(seq)


def take_beam_rows(seqs: list[Sequence], logits: torch.Tensor
                   ) -> tuple[list[Sequence], torch.Tensor, list[BeamSearch]]:
    """Hand the logits of beams to their BeamSearch. Returns the other sequences and rows (to sample
    as usual) and the searches that have every beam's logits and can move."""
    keep, ready = [], []
    for row, seq in enumerate(seqs):
        search = seq.beam_search
        if search is None:
            keep.append(row)
        elif search.receive(seq, logits[row]) and search not in ready:
            ready.append(search)
    if len(keep) == len(seqs):
        return seqs, logits, ready
    return [seqs[r] for r in keep], logits[keep], ready
