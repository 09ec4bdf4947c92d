"""The test oracle for beam search: the engine's rule with no cache, no blocks and no sharing.

Each step runs every beam's WHOLE token list through the model again (rung 1) and keeps the best
beam_width extensions with the engine's own `best_candidates` and `rank`. Slow and obviously right:
tests/test_beam.py, tests/test_fork.py and notebook 07 check the engine's beams against it.
"""
from __future__ import annotations

import torch

from minikv.attention.metadata import AttentionMetadata
from minikv.attention.naive import NaiveBackend
from minikv.engine.beam import Hypothesis, best_candidates, rank


@torch.inference_mode()
def reference_beam_search(model, prompt_token_ids: list[int], beam_width: int, max_tokens: int,
                          eos_token_ids: set[int], ignore_eos: bool = False, length_penalty: float = 1.0,
                          max_model_len: int = 2048) -> list[Hypothesis]:
    """The same search with no cache and no sharing: each beam's whole token list runs through the
    model again at every step (rung 1). Slow and obviously right: the engine is checked against it."""
    beams: list[tuple[list[int], float]] = [([], 0.0)]  # (generated tokens, cumulative logprob)
    finished: list[Hypothesis] = []
    backend = NaiveBackend(model.config.sliding_window)
    device = next(model.parameters()).device
    while beams:
        seqs = [prompt_token_ids + out for out, _ in beams]  # one flattened batch, every beam whole
        lens = [len(s) for s in seqs]
        meta = AttentionMetadata.build(lens, lens, device)
        ids = torch.tensor([t for s in seqs for t in s], device=device)
        positions = torch.tensor([p for n in lens for p in range(n)], device=device)
        logits = model(ids, positions, meta, backend, logits_indices=meta.query_start_loc[1:] - 1)
        logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()  # [beams, vocab]
        chosen = best_candidates([c for _, c in beams], logprobs, beam_width)
        nxt = []
        for b, token, score in chosen:
            out = beams[b][0] + [token]
            if token in eos_token_ids and not ignore_eos:
                finished.append(Hypothesis(out, score, "stop"))
            else:
                nxt.append((out, score))
        beams = nxt
        if beams and (len(beams[0][0]) >= max_tokens or len(prompt_token_ids) + len(beams[0][0]) >= max_model_len):
            finished += [Hypothesis(out, score, "length") for out, score in beams]
            beams = []
    return rank(finished, beam_width, length_penalty, eos_token_ids)
