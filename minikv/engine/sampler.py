"""Pick the next token of each sequence from its logits: greedy, or temperature / top-k / top-p."""
from __future__ import annotations

import torch

from minikv.engine.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits: [B, vocab] float32 -> one token id per row. Greedy rows need no randomness."""
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = _sample_one(logits[i], p, generators[i])
    return out


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """softmax(logits / T) with everything outside top_k and the top_p nucleus zeroed, renormalised."""
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        outside = sorted_p.cumsum(-1) - sorted_p >= p.top_p
        sorted_p = sorted_p.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return probs / probs.sum()


def _sample_one(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    probs = filtered_probs(logits.float(), p)
    if gen is not None:  # the generators live on the CPU: draw there (the same draw whatever the device)
        probs = probs.to(gen.device)
    return int(torch.multinomial(probs, 1, generator=gen).item())
