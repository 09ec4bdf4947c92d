"""Pick the next token of every sequence of the batch at once: greedy, or temperature / top-k / top-p.

The whole batch is sampled in a few tensor operations on the logits' device, with no Python loop over
rows and one copy of the chosen ids back to the host. Randomness comes from the Gumbel-max trick
with counter-based noise:

    token = argmax over the allowed set of  logits / T + g,   g = -log(-log(u)),  u = U(key, vocab id)

which picks token i with probability softmax(logits / T)_i (the allowed set renormalised). Here
U is a hash of (the row's key, the vocab id) into (0, 1), and a row's key is a hash of
(the request's seed, the position it samples): a request's draw depends on nothing else, so the
same prompt and seed give the same tokens alone or in any batch, on any device, eager or replayed
from a CUDA graph, and sample i of SamplingParams(n, seed=s) equals a request run with seed s + i.

    allowed set of a row:  top_k  the k largest logits (0 = all)
                           top_p  the smallest set of most likely tokens whose mass reaches top_p
    greedy rows (temperature 0) are an exact argmax of the raw logits
"""
from __future__ import annotations

import torch

from minikv.engine.sampling_params import SamplingParams

MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """A 64-bit mixing function (SplitMix64's finaliser): nearby inputs give unrelated outputs."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def draw_key(seed: int, position: int) -> int:
    """The key of the draw a request with this seed makes for its token number `position`."""
    return splitmix64(splitmix64(seed) ^ position) >> 1  # 63 bits: fits a signed int64 tensor


def _as_int64(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _M1, _M2 = (_as_int64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 lanes (torch's >> keeps the sign)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def uniform_noise(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """u[b, j] in (0, 1), a hash of (keys[b], ids[b, j] or ids[j]): float32 on keys' device. int64 lanes
    wrap on overflow, which is exactly the 64-bit arithmetic the hash needs."""
    x = keys[:, None] ^ (ids * _GOLDEN)
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    x = x ^ _shr(x, 31)
    return (_shr(x, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # 24 random bits, never 0 or 1


def gumbel_argmax(scores: torch.Tensor, keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Index of max(scores + Gumbel noise of (key, vocab id)) per row: a draw from softmax(scores)."""
    u = uniform_noise(keys, ids)
    return (scores - torch.log(-torch.log(u))).argmax(dim=-1)


def allowed_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits / T with everything outside each row's top_k and top_p set at -inf.

    Returns (scaled logits, order): when a row filters, the logits come back sorted in descending order
    and `order[b, j]` is the vocab id at rank j; without filtering, order is None (vocab order)."""
    scaled = logits / temperature[:, None]
    if not bool(((top_k > 0) | (top_p < 1.0)).any()):
        return scaled, None
    scaled, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(scaled.shape[-1], device=scaled.device)[None, :]
    k = torch.where(top_k > 0, top_k, scaled.shape[-1])
    outside = rank >= k[:, None]
    probs = torch.softmax(scaled.masked_fill(outside, float("-inf")), dim=-1)
    # the smallest prefix whose mass reaches top_p: drop a token when the mass BEFORE it already does
    outside |= (probs.cumsum(-1) - probs) >= top_p[:, None]
    return scaled.masked_fill(outside, float("-inf")), order


CANDIDATES = (64, 1024)  # a filtered row looks for its top-k / top-p set among its 64, then 1,024 most likely tokens


def sample(logits: torch.Tensor, params: list[SamplingParams], keys: list[int]) -> list[int]:
    """logits: [B, vocab] -> one token id per row. keys: each row's draw key (`draw_key`); greedy rows
    ignore theirs. Which rows filter is known on the host from `params`: no device round trip to ask."""
    return sample_on_device(logits, params, keys).tolist()


def sample_on_device(logits: torch.Tensor, params: list[SamplingParams], keys: list[int]) -> torch.Tensor:
    """`sample`, with the chosen ids left on the logits' device (int64 [B]): the engine's overlapped
    step feeds them straight into the next step's input ids and copies them to the host meanwhile.
    Greedy and plain-temperature rows never wait for the device; rows with a top-k / top-p set wait
    once to learn whether their set fit among the candidates (see `_sample_filtered`)."""
    greedy = logits.argmax(dim=-1)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled_rows:
        return greedy
    dev, vocab = logits.device, logits.shape[-1]
    plain = [j for j, i in enumerate(sampled_rows) if params[i].top_k == 0 and params[i].top_p >= 1.0]
    filt = [j for j, i in enumerate(sampled_rows) if params[i].top_k > 0 or params[i].top_p < 1.0]
    # [temperature, top_p, top_k] as float32 bits beside the 63-bit key: every row's settings in one copy
    settings = torch.tensor([[params[i].temperature, params[i].top_p, params[i].top_k] for i in sampled_rows],
                            dtype=torch.float32).view(torch.int32).to(torch.int64)
    packed = torch.cat([settings, torch.tensor([keys[i] for i in sampled_rows], dtype=torch.int64)[:, None]], 1)
    packed = packed.to(dev, non_blocking=dev.type == "cuda")
    temperature, top_p, top_k = packed[:, :3].to(torch.int32).view(torch.float32).unbind(1)
    top_k, key = top_k.long(), packed[:, 3]
    rows = _index(sampled_rows, dev)
    scaled = logits.index_select(0, rows).float() / temperature[:, None]
    choice = torch.empty(len(sampled_rows), dtype=torch.long, device=dev)
    if plain:  # rows that filter nothing: the whole vocabulary
        a = _index(plain, dev) if len(plain) < len(sampled_rows) else slice(None)
        choice[a] = gumbel_argmax(scaled[a], key[a], torch.arange(vocab, device=dev))
    if filt:
        f = _index(filt, dev) if len(filt) < len(sampled_rows) else slice(None)
        max_k = max(params[sampled_rows[j]].top_k for j in filt)
        choice[f] = _sample_filtered(scaled[f], key[f], top_k[f], top_p[f], max_k)
    greedy[rows] = choice
    return greedy


def _index(rows: list[int], dev: torch.device) -> torch.Tensor:
    """Row indexes on the device without waiting for it (`torch.tensor(rows, device=dev)` copies
    synchronously, after every kernel queued before it)."""
    return torch.tensor(rows, dtype=torch.long).to(dev, non_blocking=dev.type == "cuda")


def _sample_filtered(scaled: torch.Tensor, key: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     max_k: int) -> torch.Tensor:
    """Draws for rows with a top-k / top-p set, found among their CANDIDATES most likely tokens (a partial
    top-k instead of sorting the vocabulary): 64 first, then 1,024 for the rows whose set may reach past
    64. A row whose top-p set may reach past those too (a flat distribution) is redone exactly over the
    whole sorted vocabulary. The noise is keyed by vocab id, not rank, so a row draws the same token
    from any candidate list that holds its whole set: the batch it sits in changes nothing."""
    vocab = scaled.shape[-1]
    lse = torch.logsumexp(scaled, dim=-1, keepdim=True)
    choice = torch.empty(scaled.shape[0], dtype=torch.long, device=scaled.device)
    todo: torch.Tensor | None = None  # rows still to draw (None: all)
    for n in CANDIDATES:
        if n < max_k and n != CANDIDATES[-1]:
            continue
        k_cap = min(vocab, max(n, max_k))
        sub = (lambda t: t) if todo is None else (lambda t: t[todo])
        got, exact = _draw_among(sub(scaled), sub(lse), sub(key), sub(top_k), sub(top_p), k_cap)
        if todo is None:
            choice = got
        else:
            choice[todo] = got
        if bool(exact.all()):
            return choice
        todo = (~exact).nonzero()[:, 0] if todo is None else todo[~exact]
    allowed, order = allowed_logits(scaled[todo], torch.ones_like(top_p[todo]), top_k[todo], top_p[todo])
    choice[todo] = order.gather(1, gumbel_argmax(allowed, key[todo], order)[:, None])[:, 0]
    return choice


def _draw_among(scaled, lse, key, top_k, top_p, k_cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw among each row's k_cap most likely tokens; `exact` says whose whole set lay among them."""
    vals, ids = scaled.topk(k_cap, dim=-1)  # sorted, most likely first
    probs = torch.exp(vals - lse)  # true probabilities
    rank = torch.arange(k_cap, device=scaled.device)[None, :]
    outside = rank >= torch.where(top_k > 0, top_k, k_cap)[:, None]
    kept = probs.masked_fill(outside, 0.0)
    # top-p acts on the distribution left after top-k (renormalised); without top-k, on the whole one
    kept = kept / torch.where(top_k > 0, kept.sum(-1), torch.ones_like(top_p))[:, None]
    outside |= (kept.cumsum(-1) - kept) >= top_p[:, None]
    choice = ids.gather(1, gumbel_argmax(vals.masked_fill(outside, float("-inf")), key, ids)[:, None])[:, 0]
    exact = (top_k > 0) | (top_p >= 1.0) | (probs.sum(-1) >= top_p)
    return choice, exact


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution `sample` draws one row from: softmax(logits / T) over the allowed set, in vocab
    order (zero outside it). For tests and notebooks."""
    t = torch.tensor([p.temperature], dtype=torch.float32)
    scaled, order = allowed_logits(logits.float()[None], t, torch.tensor([p.top_k]), torch.tensor([p.top_p]))
    probs = torch.softmax(scaled, dim=-1)[0]
    return probs if order is None else torch.zeros_like(probs).scatter_(0, order[0], probs)
