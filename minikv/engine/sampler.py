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
                                  (ties ordered by vocab id, the lower first)
    greedy rows (temperature 0) are an exact argmax of the raw logits

Nothing waits for the device. On a GPU, rows without a top-k go to one Triton kernel that finds the
top-p set by pivoting instead of sorting (minikv/kernels/sample.py); it draws the same token as the
torch code here, which the CPU runs, except its top-p rows: those are drawn in C where the machine has
a compiler (minikv/engine/cpu_topp.c, the same tokens), else by a block search in torch ops
(`_sample_nucleus_cpu`).
"""
from __future__ import annotations

import numpy as np
import torch

from minikv.engine import cpu_topp
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


def _splitmix64_lanes(x: np.ndarray) -> np.ndarray:
    """splitmix64 over uint64 lanes (numpy's uint64 arithmetic wraps as the hash needs)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def draw_keys(seeds: list[int], positions: list[int]) -> np.ndarray:
    """`draw_key` of many (seed, position) pairs at once, as int64: one numpy pass instead of a Python
    hash per row (the engine takes a key for every sampled row of every step)."""
    seeds64 = np.array(seeds, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = _splitmix64_lanes(_splitmix64_lanes(seeds64) ^ np.array(positions, dtype=np.uint64))
    return (x >> np.uint64(1)).astype(np.int64)


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
    return unit_float(x ^ _shr(x, 31))


def unit_float(x: torch.Tensor) -> torch.Tensor:
    """The top 23 bits of 64-bit hashes as float32 in (0, 1): (k + 0.5) / 2**23 is exact in float32, so u
    is never 0 or 1. (With 24 bits, the top value k + 0.5 = 2**24 - 0.5 rounds up to 2**24: u = 1 gives
    infinite noise, and a token drawn whatever its probability about once in 110 draws over a 152k
    vocabulary.)"""
    return (_shr(x, 41).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


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
    scaled, order = scaled.sort(dim=-1, descending=True, stable=True)  # ties: the lower id first
    rank = torch.arange(scaled.shape[-1], device=scaled.device)[None, :]
    k = torch.where(top_k > 0, top_k, scaled.shape[-1])
    outside = rank >= k[:, None]
    probs = torch.softmax(scaled.masked_fill(outside, float("-inf")), dim=-1)
    # the smallest prefix whose mass reaches top_p: drop a token when the mass BEFORE it already does
    outside |= (probs.cumsum(-1) - probs) >= top_p[:, None]
    return scaled.masked_fill(outside, float("-inf")), order


CANDIDATES = (64, 1024)  # on the CPU, a top-p row looks for its nucleus among its 64, then 1,024 most likely tokens


def sample(logits: torch.Tensor, params: list[SamplingParams], keys: list[int]) -> list[int]:
    """logits: [B, vocab] -> one token id per row. keys: each row's draw key (`draw_key`); greedy rows
    ignore theirs. Which rows filter is known on the host from `params`: no device round trip to ask."""
    return sample_on_device(logits, params, keys).tolist()


class DrawPlan:
    """What `sample_on_device` works out from a batch's params alone: which rows draw, of which kind, and their
    packed temperature, top-p, top-k and row (`pack_draws`; each step fills in the keys). The engine's
    overlapped step keeps one while its batch's sequences stay the same (minikv/engine/core.py): a decode
    batch of 218 sampled rows spent ~60 us a step on this on a CPU core, every step, for the same answer."""

    def __init__(self, params: list[SamplingParams]):
        self.sampled_rows: list[int] = []  # rows of the batch that draw; the lists below index into it
        self.top_k_rows: list[int] = []
        self.top_p_rows: list[int] = []
        self.plain_rows: list[int] = []
        for i, p in enumerate(params):
            if not p.greedy:
                kind = self.top_k_rows if p.top_k > 0 else self.top_p_rows if p.top_p < 1.0 else self.plain_rows
                kind.append(len(self.sampled_rows))
                self.sampled_rows.append(i)
        self.rows = np.asarray(self.sampled_rows, dtype=np.int64)
        self._packed = pack_draws(params, np.zeros(len(params), dtype=np.int64), self.sampled_rows)

    def packed(self, keys) -> torch.Tensor:
        """The sampled rows packed as `pack_draws` packs them, with these keys (one per row of the batch)."""
        out = self._packed.clone()
        out[:, KEY] = torch.from_numpy(np.asarray(keys, dtype=np.int64)[self.rows])
        return out


def sample_on_device(logits: torch.Tensor, params: list[SamplingParams], keys: list[int],
                     plan: DrawPlan | None = None) -> torch.Tensor:
    """`sample`, with the chosen ids left on the logits' device (int64 [B]): the engine's overlapped
    step feeds them straight into the next step's input ids and copies them to the host meanwhile.

    Nothing here waits for the device. Greedy rows are an argmax; top-k rows draw among their k most
    likely tokens (a partial top-k: the set always fits). On a GPU, the other sampled rows (temperature,
    top-p) are drawn by one Triton kernel that finds the nucleus by pivoting, without a sort
    (minikv/kernels/sample.py). On the CPU, where asking the device is free, top-p rows look among their
    most likely candidates, found from the maxima of blocks of the vocabulary (`_sample_nucleus_cpu`).
    plan: the batch's `DrawPlan`, kept from an earlier step with the same params (None: made here)."""
    plan = plan if plan is not None else DrawPlan(params)
    sampled_rows, top_k_rows, top_p_rows, plain_rows = plan.sampled_rows, plan.top_k_rows, plan.top_p_rows, \
        plan.plain_rows
    if not sampled_rows:
        return greedy_argmax(logits)
    dev, vocab = logits.device, logits.shape[-1]
    packed = _to_device(plan.packed(keys), dev)
    rows = packed[:, ROW]
    if _use_kernel(dev):  # one kernel for the rows without a top-k
        groups = [(top_k_rows, "top_k"), (top_p_rows + plain_rows, "kernel")]
    else:
        groups = [(top_k_rows, "top_k"), (top_p_rows, "top_p"), (plain_rows, "plain")]
    choice = torch.empty(len(sampled_rows), dtype=torch.long, device=dev)
    for group, how in groups:
        if not group:
            continue
        g = _index(group, dev) if len(group) < len(sampled_rows) else slice(None)
        mine = packed[g]
        if how == "kernel":
            choice[g] = _gpu_sample_rows(logits, mine.contiguous())
            continue
        temperature, top_p = mine[:, :TOP_K].to(torch.int32).view(torch.float32).unbind(1)
        key = mine[:, KEY]
        if how == "top_p" and dev.type == "cpu" and (path := _cpu_top_p_path(logits)) != "sorted":
            choice[g] = _sample_top_p_cpu(logits, [sampled_rows[j] for j in group], temperature, key, top_p, path)
            continue
        scaled = logits.index_select(0, mine[:, ROW]).float() / temperature[:, None]
        if how == "plain":  # the whole vocabulary
            choice[g] = gumbel_argmax(scaled, key, torch.arange(vocab, device=dev))
        elif how == "top_k":  # the set always lies among the largest top_k logits
            k_cap = min(vocab, max(params[sampled_rows[j]].top_k for j in group))
            lse = torch.logsumexp(scaled, dim=-1, keepdim=True)
            choice[g] = _draw_among(scaled, lse, key, mine[:, TOP_K], top_p, k_cap, ties_by_key=True)[0]
        else:
            choice[g] = _sample_nucleus(scaled, key, top_p)
    if len(sampled_rows) == logits.shape[0]:  # no greedy row: no argmax to compute
        return choice
    out = greedy_argmax(logits)
    out[rows] = choice
    return out


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1): the first index of the maximum (a NaN counts as the maximum). On the CPU,
    torch's max over a dimension returns the same index about three times faster than argmax (the tests
    check ties and NaNs)."""
    return logits.max(dim=-1).indices if logits.device.type == "cpu" else logits.argmax(dim=-1)


# A sampled row's settings, packed into one int64 row so that the whole batch goes to the device in one
# copy: the float32 bits of temperature and top_p, top_k, the 63-bit draw key, the row in the batch.
TEMPERATURE, TOP_P, TOP_K, KEY, ROW = range(5)


def pack_draws(params: list[SamplingParams], keys, rows: list[int]) -> torch.Tensor:
    """[len(rows), 5] int64 on the host: a row per draw, the layout the sampling kernel reads (see above)."""
    chosen = [params[i] for i in rows]
    out = np.empty((len(rows), 5), dtype=np.int64)  # a column at a time: numpy converts flat lists fastest
    out[:, TEMPERATURE] = np.array([p.temperature for p in chosen], dtype=np.float32).view(np.int32)
    out[:, TOP_P] = np.array([p.top_p for p in chosen], dtype=np.float32).view(np.int32)
    out[:, TOP_K] = [p.top_k for p in chosen]
    keys = np.asarray(keys, dtype=np.int64)
    out[:, KEY] = keys if len(rows) == len(keys) else keys[rows]  # rows are increasing: all of them, in order
    out[:, ROW] = rows
    return torch.from_numpy(out)


def _use_kernel(dev: torch.device) -> bool:
    """On a GPU, temperature and top-p rows go to the Triton kernel (not in Triton's CPU interpreter,
    where torch is faster)."""
    if dev.type != "cuda":
        return False
    from minikv.kernels import interpreted
    return not interpreted()


def _gpu_sample_rows(logits: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    from minikv.kernels.sample import sample_rows
    return sample_rows(logits, packed)


def _index(rows: list[int], dev: torch.device) -> torch.Tensor:
    """Row indexes on the device, without waiting for it."""
    return _to_device(torch.tensor(rows, dtype=torch.long), dev)


def _to_device(host: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A small host tensor on `dev` without waiting for the work queued there. From pageable memory
    even a "non-blocking" copy may wait for the stream (CUDA's API synchronization notes: the driver may
    synchronize with the stream to stage the copy into pinned memory), which would hold an overlapped
    step until the step before it has run. So the copy goes from pinned memory, taken from torch's
    caching host allocator (which keeps a block until the copies reading it are done)."""
    if dev.type != "cuda":
        return host
    return host.pin_memory().to(dev, non_blocking=True)


def _sample_nucleus(scaled: torch.Tensor, key: torch.Tensor, top_p: torch.Tensor,
                    lse: torch.Tensor | None = None) -> torch.Tensor:
    """Draws for top-p rows without a top-k, from their scaled logits: a row's nucleus is looked for among
    its CANDIDATES most likely tokens (a partial top-k instead of sorting the vocabulary), 64 first, then
    1,024 for the rows whose nucleus may reach past 64. A row whose nucleus may reach past those too (a
    flat distribution) is redone exactly over the whole sorted vocabulary. The noise is keyed by vocab
    id, not rank, so a row draws the same token from any candidate list that holds its whole set: the
    batch it sits in changes nothing. The reference of `_sample_nucleus_cpu`, which draws the same
    tokens, and the path of a GPU whose kernel is off."""
    if lse is None:
        lse = torch.logsumexp(scaled, dim=-1, keepdim=True)
    no_k = torch.zeros_like(key)
    choice = torch.empty(scaled.shape[0], dtype=torch.long, device=scaled.device)
    todo = torch.arange(scaled.shape[0], device=scaled.device)  # rows still to draw
    for n in CANDIDATES:
        got, exact = _draw_among(scaled[todo], lse[todo], key[todo], no_k[todo], top_p[todo],
                                 min(scaled.shape[-1], n))
        choice[todo] = got
        todo = todo[~exact]
        if todo.numel() == 0:
            return choice
    allowed, order = allowed_logits(scaled[todo], torch.ones_like(top_p[todo]), no_k[todo], top_p[todo])
    choice[todo] = order.gather(1, gumbel_argmax(allowed, key[todo], order)[:, None])[:, 0]
    return choice


# The CPU's top-p path reads the vocabulary as blocks of BLOCK ids, strided so that one vectorised max
# over [BLOCK, V // BLOCK] gives every block's maximum; the ids past BLOCK * (V // BLOCK) form one more:
#
#     block c < nb:  ids c, c + nb, c + 2 nb, ..., c + (BLOCK - 1) nb        nb = V // BLOCK
#     block nb:      ids BLOCK * nb .. V - 1  (V % BLOCK of them; none when BLOCK divides V)
#
# and the blocks, one level up, as groups of GROUP blocks split the same way (`_strided_max`,
# `_members`). Every token above a block's maximum lies in a block of larger maximum, in a group of
# larger maximum, and each block or group holds at least its maximum's probability.
BLOCK = 16
GROUP = 8
LOG2E = 1.4426950408889634
HISTOGRAM_BINS = 8  # bins per unit of scaled logit below a row's maximum, over 64 units; the rest share the last
MIN_BLOCKED_VOCAB = BLOCK * (CANDIDATES[-1] + 1)  # below this, the blocks would hold much of the vocabulary


# How the CPU draws top-p rows: "auto" takes the C path (cpu_topp.c) where it is built, else the block search
# in torch ops past MIN_BLOCKED_VOCAB; "c", "blocks" and "sorted" (the reference) force one.
CPU_TOP_P = "auto"


def _cpu_top_p_path(logits: torch.Tensor) -> str:
    want, vocab = CPU_TOP_P, logits.shape[-1]
    if want in ("auto", "c") and vocab >= BLOCK and logits.dtype == torch.float32 and logits.stride(-1) == 1 \
            and cpu_topp.library() is not None:
        return "c"
    if want == "c":
        raise RuntimeError(f"sampler.CPU_TOP_P is 'c' but the C path cannot run here: {cpu_topp.why_not() or ''} "
                           f"(it reads float32 logits with contiguous rows of at least {BLOCK} tokens; got "
                           f"{logits.dtype}, {vocab} tokens, strides {logits.stride()})")
    if want in ("auto", "blocks") and vocab >= MIN_BLOCKED_VOCAB:
        return "blocks"
    return "sorted"


def _sample_top_p_cpu(logits: torch.Tensor, rows: list[int], temperature: torch.Tensor, key: torch.Tensor,
                      top_p: torch.Tensor, path: str) -> torch.Tensor:
    """Top-p rows on the CPU, the sorted path's tokens, by `_cpu_top_p_path`'s choice: the C path (one read of
    each row from memory and a few tokens' work, minikv/engine/cpu_topp.c) or the block search in torch ops
    (`_sample_nucleus_cpu`). The rows the C path is not sure of (near the nucleus' edge, a near tie, a logit
    not finite, a log-sum-exp too large for float32's rounding) take the sorted path."""
    if path != "c":
        return _sample_nucleus_cpu(logits, rows, temperature, key, top_p)
    rows_t = torch.tensor(rows, dtype=torch.long)
    choice, sure = cpu_topp.top_p_rows(logits, rows_t, temperature, key, top_p, _mass_slack(logits.shape[-1]))
    redo = (~sure).nonzero()[:, 0]
    if redo.numel():
        scaled = logits.index_select(0, rows_t[redo]) / temperature[redo, None]
        choice[redo] = _sample_nucleus(scaled, key[redo], top_p[redo])
    return choice


def _sample_nucleus_cpu(logits: torch.Tensor, rows: list[int], temperature: torch.Tensor, key: torch.Tensor,
                        top_p: torch.Tensor) -> torch.Tensor:
    """`_sample_nucleus` of logits[rows] / temperature, the same tokens, with one pass of exp over the
    vocabulary and no sort of it. The log-sum-exp and each block's maximum come from
    `_lse_and_block_max`. A row whose most likely token alone holds top_p draws that token. Any other
    finds an edge, a scaled logit above which its tokens surely hold top_p of its mass (plus the slack,
    see `_draw_above`), from the maxima of its groups of blocks; a row whose groups' maxima never hold
    top_p, from its blocks'; one whose blocks' never do either, from its tokens (`_edge_of`).
    `_draw_above` draws among the tokens above the edge, gathered from the blocks whose maximum lies
    above it, or read from the whole row when those blocks cover much of it. The rows it cannot vouch
    for (a draw near the nucleus' edge or a near tie, a maximum that is not finite, top_p within the
    slack of 1) are drawn by `_sample_nucleus` itself."""
    n, vocab = len(rows), logits.shape[-1]
    lse, best, block_max, groups = _lse_and_block_max(logits, rows, temperature)
    rows_t = torch.tensor(rows, dtype=torch.long)
    slack = _mass_slack(vocab)
    choice = torch.empty(n, dtype=torch.long)
    # rows to search; the others go to the reference: a maximum that is not finite, or a top_p so close
    # to 1 that no tokens short of the whole vocabulary surely hold it
    searchable = lse[:, 0].isfinite() & (top_p.double() + 2 * slack < 1.0)
    redo = [torch.arange(n)[~searchable]]  # rows for the reference
    # a row whose most likely token alone holds top_p + 2 slack draws it whatever the noise: every other
    # token has that much mass before it (and no other token ties with it: it holds more than half)
    alone = searchable & (torch.exp(best[:, 0].double() - lse[:, 0].double()) >= top_p.double() + 2 * slack)
    if alone.any():
        choice[alone] = _top_token(logits, block_max, groups, rows_t, torch.arange(n)[alone])
    todo = torch.arange(n)[searchable & ~alone]
    edge = torch.empty(n, 1)
    whole = [todo[:0]]  # rows whose tokens above the edge are read from the whole row
    pairs = [(todo[:0], todo[:0])]  # (row, block): the blocks whose maximum lies above the row's edge
    for level in ("groups", "blocks", "tokens"):
        if todo.numel() == 0:
            break
        if level == "groups":
            maxima = groups[todo]
        elif level == "blocks":
            maxima = block_max[todo]
        else:  # flat rows: their blocks' maxima never hold top_p
            maxima = logits.index_select(0, rows_t[todo]).float()
        e, taken, found = _edge_of(maxima, temperature[todo], best[todo], lse[todo], top_p[todo], slack)
        edge[todo] = e
        if level == "groups":  # the blocks of the groups taken, whose maximum lies above the edge
            r, g = taken.nonzero(as_tuple=True)
            r, b = todo[r], _members(g, block_max.shape[1], GROUP)
            at, lane = (_pick(block_max, r, b) / temperature[r, None] > edge[r]).nonzero(as_tuple=True)
            pairs.append((r[at], b[at, lane]))
        elif level == "blocks":
            r, b = taken.nonzero(as_tuple=True)
            pairs.append((todo[r], b))
        else:
            whole.append(todo[found])
            redo.append(todo[~found])
        todo = todo[~found]
    r, b = (torch.cat(c) for c in zip(*pairs))
    count = torch.bincount(r, minlength=n)  # blocks above the edge
    many = count * BLOCK * 8 >= vocab  # they cover much of the row: read it whole
    whole = torch.cat(whole + [torch.arange(n)[many]])
    go = torch.arange(n)[(count > 0) & ~many]
    if go.numel():
        local = torch.empty(n, dtype=torch.long)
        local[go] = torch.arange(go.numel())
        keep = ~many[r]
        r, by_row = local[r[keep]].sort(stable=True)  # the levels' pairs, row by row
        got, sure = _draw_above(logits, rows_t[go], temperature[go], lse[go], key[go], top_p[go], edge[go],
                                slack, (r, b[keep][by_row]))
        choice[go] = got
        redo.append(go[~sure])
    if whole.numel():
        got, sure = _draw_above(logits, rows_t[whole], temperature[whole], lse[whole], key[whole], top_p[whole],
                                edge[whole], slack, None)
        choice[whole] = got
        redo.append(whole[~sure])
    redo = torch.cat(redo)
    if redo.numel():  # with torch's own log-sum-exp
        scaled = logits.index_select(0, rows_t[redo]).float() / temperature[redo, None]
        choice[redo] = _sample_nucleus(scaled, key[redo], top_p[redo])
    return choice


def _lse_and_block_max(logits: torch.Tensor, rows: list[int], temperature: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logsumexp(logits[rows] / T) [n, 1], the largest x / T [n, 1], the maximum of every block [n, nb (+1)]
    and of every group of blocks [n, nb // GROUP (+1)]: the block maxima of every row in one op
    (`_row_chunks`: rows that lie together), then, a row at a time with one thread, the sum of exp in a
    buffer that stays in the cache.

    torch.logsumexp takes the maximum m off before exp; here only where exp(x / T) itself would overflow
    or lose its largest terms (|m| > 60). There the bits are torch's: x / T divided as the sorted path
    divides, - m, exp (an ulp of a large log-sum-exp is a large error in the mass). Elsewhere the sum is
    of exp2(x / (T ln 2)), one pass of torch's exp2, about twice as fast as its exp here; the rounding of
    T ln 2 and of the quotient moves each exponent by a few parts in 1e7 of itself, so the log-sum-exp by
    at most ~1e-5 (tested), inside the slack the search allows (1e-4 of the mass); rows left to the
    sorted path take torch's own. A row's sum does not depend on the rows beside it, except that torch
    splits a lone row across threads: with several threads, the ops take chunks of 2 to 17 rows (and
    take m off for the whole chunk where one of its rows needs it)."""
    n, vocab = len(rows), logits.shape[-1]
    nb, tail = divmod(vocab, BLOCK)
    block_max = torch.empty(n, nb + (tail > 0))
    group_max = torch.empty(n, len(block_max[0]) // GROUP + (len(block_max[0]) % GROUP > 0))
    z = torch.empty(n, 1)
    m = torch.empty(n, 1)
    t = temperature[:, None]
    shift = torch.zeros(n, 1)  # what exp took off: m where exp(x / T) itself overflows or loses its largest terms
    one = torch.get_num_threads() == 1
    buf = torch.empty(1 if one else min(n, 17), vocab)
    for a, b, x in _row_chunks(logits, rows, n if one else 16):
        x = x.float()
        _strided_max(x, BLOCK, out=block_max[a:b])
        _strided_max(block_max[a:b], GROUP, out=group_max[a:b])
        torch.div(group_max[a:b].amax(1, keepdim=True), t[a:b], out=m[a:b])
        if one:  # a row at a time
            rows_ = zip(range(a, b), x.split(1), t[a:b].split(1), (t[a:b] / LOG2E).split(1), z[a:b].split(1),
                        m[a:b, 0].tolist())
            for i, xr, tr, tr2, zr, mr in rows_:  # tr2: T ln 2
                if abs(mr) > 60.0:
                    shift[i] = mr
                    s = torch.div(xr, tr, out=buf).sub_(mr).exp_()
                else:
                    s = torch.div(xr, tr2, out=buf).exp2_()
                torch.sum(s, dim=-1, keepdim=True, out=zr)
        elif bool((m[a:b].abs() <= 60.0).all()):  # the chunk whole
            s = torch.div(x, t[a:b] / LOG2E, out=buf[:b - a]).exp2_()
            torch.sum(s, dim=-1, keepdim=True, out=z[a:b])
        else:
            shift[a:b] = m[a:b]
            s = torch.div(x, t[a:b], out=buf[:b - a]).sub_(m[a:b])
            torch.sum(s.exp_(), dim=-1, keepdim=True, out=z[a:b])
    return z.log_().add_(shift), m, block_max, group_max


def _row_chunks(logits: torch.Tensor, rows: list[int], most: int = 16):
    """(a, b, logits[rows[a:b]]): up to `most` rows at a time. With one thread, rows that lie together, as
    a view; with several, 2 to `most` + 1 rows, copied unless they lie together: every op on a lone row
    would open a parallel region, where the idle threads spin."""
    n = len(rows)
    if torch.get_num_threads() == 1:
        bounds = [0]
        for i in range(1, n):
            if rows[i] != rows[i - 1] + 1 or i - bounds[-1] == most:
                bounds.append(i)
    else:
        bounds = list(range(0, n, max(2, most)))
        if len(bounds) > 1 and n - bounds[-1] == 1:
            del bounds[-1]  # no chunk of a lone row
    bounds.append(n)
    for a, b in zip(bounds, bounds[1:]):
        if rows[a:b] == list(range(rows[a], rows[a] + b - a)):
            yield a, b, logits[rows[a]:rows[a] + b - a]
        else:
            yield a, b, logits.index_select(0, torch.tensor(rows[a:b]))


def _strided_max(x: torch.Tensor, size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The maximum of each strided group of `size` columns of x [n, w] (the picture above): [n, w // size (+1)]."""
    n, w = x.shape
    g, rest = divmod(w, size)
    out = torch.empty(n, g + (rest > 0), dtype=x.dtype) if out is None else out
    torch.amax(x[:, :g * size].view(n, size, g), 1, out=out[:, :g])
    if rest:
        torch.amax(x[:, g * size:], 1, out=out[:, g])
    return out


def _members(groups: torch.Tensor, w: int, size: int) -> torch.Tensor:
    """The columns of the strided groups `groups` [...] of `size` over w columns, rising: [..., size]. The
    short last group's lanes past the last column hold w (see `_pick`)."""
    g = w // size
    lane = torch.arange(size)
    if w % size == 0:  # no short group: one op over the members (Qwen2.5's and SmolLM2's vocabularies are
        return groups[..., None] + g * lane  # multiples of 16)
    return torch.where(groups[..., None] < g, groups[..., None] + g * lane, g * size + lane).clamp_max_(w)


def _pick(x: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """x[rows[i], columns[i, j]] as float32, -inf where the column is past x's last (x: [B, w])."""
    w = x.shape[-1]
    got = x.take(rows[:, None] * w + columns.clamp_max(w - 1)).float()
    return got.masked_fill_(columns >= w, float("-inf"))


def _mass_slack(vocab: int) -> float:
    """How far the sorted path's rounded masses may lie from exact ones. Its worst sum is softmax's,
    float32 over `vocab` positive terms in 8 or more vector lanes: at most vocab / 8 roundings of
    2**-24 each (relative); 1e-4 covers the rest (float32 probabilities, a rounded log-sum-exp)."""
    return 1e-4 + vocab * 2.0 ** -27


def _top_token(logits: torch.Tensor, block_max: torch.Tensor, groups: torch.Tensor, rows: torch.Tensor,
               these: torch.Tensor) -> torch.Tensor:
    """The id of the largest logit of the rows `these`, down from each one's top group to its top block to
    its top token (the first of a tie within a block)."""
    blocks = _members(groups[these].argmax(-1), block_max.shape[1], GROUP)  # [k, GROUP]
    block = blocks.gather(1, _pick(block_max, these, blocks).argmax(-1, keepdim=True))[:, 0]
    ids = _members(block, logits.shape[-1], BLOCK)  # [k, BLOCK]
    return ids.gather(1, _pick(logits, rows[these], ids).argmax(-1, keepdim=True))[:, 0]


def _edge_of(maxima, temperature, best, lse, top_p, slack: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An edge from the maxima of groups of a row's tokens (groups of blocks, blocks, or tokens alone)
    [n, w]: a histogram of the maxima by scaled logit, in bins of 1 / HISTOGRAM_BINS counted down from the
    row's maximum `best`, each weighing its probability (each group holds at least that). The first bins
    that weigh top_p + 2 slack are taken; the edge is the largest maximum left (every token above it lies
    in a taken group; the taken maxima lie above it: a bin never falls as its maximum rises). Returns
    (edge [n, 1], taken [n, w] bool, found [n]: a row whose maxima never weigh enough takes none)."""
    n, nbins = maxima.shape[0], HISTOGRAM_BINS * 64
    scaled = maxima / temperature[:, None]
    bins = (best - scaled).mul_(HISTOGRAM_BINS).clamp_(max=nbins - 1).long()  # floor
    # float32 sums: the tokens above the edge are checked in float64 (`_draw_above`)
    mass = torch.zeros(n, nbins).scatter_add_(1, bins, torch.exp(scaled - lse))
    enough = mass.double().cumsum(-1) >= top_p[:, None].double() + 2 * slack
    enough[:, -1] = False  # the last bin holds the rest of the row
    found = enough.any(-1)
    taken = bins <= torch.where(found, enough.byte().argmax(-1), -1)[:, None]  # up to the first bin enough
    return scaled.masked_fill_(taken, float("-inf")).amax(-1, keepdim=True), taken, found


def _draw_above(logits, rows, temperature, lse, key, top_p, edge, slack: float,
                blocks: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw among each row's tokens above `edge` [n, 1], which lie in the (row, block) pairs `blocks` (None:
    read the rows whole). Returns (choice, sure): sure when the sorted path draws the same token.

    The sorted path orders the tokens (scaled logit descending, id ascending), keeps those whose mass
    before is below top_p and draws the best score (scaled logit + noise) among them. Its sums are
    rounded, off by at most `slack`. Here the best score among the tokens above the edge, a set that
    holds the nucleus, is looked at, with the mass before it summed exactly (float64):
      below top_p - slack    surely in the nucleus: the best of a set that holds the nucleus is the best
                             of the nucleus, the sorted path's token when clear of the next score
      top_p + slack or more  surely out, and so is every token after it: drop them, look again
      between               unsure: the row goes to the sorted path
    The noise is the sorted path's; its logs may be an ulp apart, so a near tie is not sure either."""
    n, vocab = len(rows), logits.shape[-1]
    if blocks is not None:  # gather the blocks' tokens
        r, b = blocks
        ids = _members(b, vocab, BLOCK)  # [pairs, BLOCK]
        s = _pick(logits, rows[r], ids) / temperature[r, None]
        at, lane = (s > edge[r]).nonzero(as_tuple=True)
        r, tokens, s = r[at], ids[at, lane], s[at, lane]
    else:  # read the rows whole, where they lie: the logits above edge * T, then those whose x / T is above edge
        low = _float_below(edge.double() * temperature[:, None].double())
        r, tokens = [], []
        for a, b, x in _row_chunks(logits, rows.tolist()):
            at, col = (x > low[a:b]).nonzero(as_tuple=True)
            r.append(at + a)
            tokens.append(col)
        r, tokens = torch.cat(r), torch.cat(tokens)  # row by row
        s = logits.take(rows[r] * vocab + tokens).float() / temperature[r]
        above = s > edge[r, 0]
        r, tokens, s = r[above], tokens[above], s[above]
    order = _order_key(s, tokens)
    probs = torch.exp(s.double() - lse[r, 0].double())
    scores = s - torch.log(-torch.log(uniform_noise(key[r], tokens[:, None])[:, 0]))
    # packed to the left:  [0, count)  a row's tokens above its edge     [count, c)  padding
    count = torch.bincount(r, minlength=n)
    at = (r, torch.arange(r.numel()) - (count.cumsum(0) - count)[r])
    shape = (n, max(1, int(count.max())))
    order = torch.full(shape, torch.iinfo(torch.long).min).index_put_(at, order)
    probs = torch.zeros(shape, dtype=torch.float64).index_put_(at, probs)
    scores = torch.full(shape, float("-inf")).index_put_(at, scores)
    # the tokens above the edge hold the nucleus when they hold top_p + slack: every token after them has
    # that much mass before it (the edge is chosen so; a tie of scaled maxima at the edge may spoil it)
    enough = probs.sum(-1) >= top_p.double() + slack
    while True:
        best, win = scores.max(dim=-1)
        after = order <= order.gather(1, win[:, None])  # the best token and those after it
        before = probs.masked_fill(after, 0.0).sum(-1)
        out = before >= top_p.double() + slack
        if not out.any():
            break
        scores.masked_fill_(out[:, None] & after, float("-inf"))  # the nucleus' first token never goes
    second = scores.scatter(1, win[:, None], float("-inf")).amax(-1)
    clear = best - second > 1e-5 * (1.0 + best.abs())
    choice = torch.zeros(shape, dtype=torch.long).index_put_(at, tokens).gather(1, win[:, None])[:, 0]
    return choice, enough & (before < top_p.double() - slack) & clear


def _order_key(s: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The sorted path's order (scaled logit descending, vocab id ascending) as one int64 per token, the larger
    first: the float32's bits made monotonic (+ 0.0: -0.0 orders as 0.0), then the id reversed."""
    bits = (s.float() + 0.0).view(torch.int32).long()
    return (torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits) << 32) | (0xFFFFFFFF - ids)


def _float_below(x: torch.Tensor) -> torch.Tensor:
    """The largest float32 at or below each float64 of x: a float32 is above it only when above x."""
    f = x.float()
    return torch.where(f.double() > x, torch.nextafter(f, torch.tensor(float("-inf"))), f)


def _draw_among(scaled, lse, key, top_k, top_p, k_cap: int, ties_by_key: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw among each row's k_cap most likely tokens, in the sorted path's order (ties by vocab id, the lower
    first); `exact` says whose whole set surely lay among them. topk leaves the order of tied logits unset,
    so its k_cap come back re-sorted by id within a tie; a row whose set reaches the k_cap-th logit may have
    left out a tie of lower id, and is not exact. ties_by_key: take the topk of `_order_key` instead, exact
    across the k_cap-th place too, at the price of an int64 key per token (top-k rows: their caller does
    not ask the device which rows are exact)."""
    vocab = scaled.shape[-1]
    if ties_by_key:
        ids = _order_key(scaled, torch.arange(vocab, device=scaled.device)).topk(k_cap, dim=-1)[1]
        vals = scaled.gather(1, ids)
    else:
        vals, ids = scaled.topk(k_cap, dim=-1)
        ids, by_id = ids.sort(dim=-1)
        vals, by_value = vals.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
        ids = ids.gather(1, by_value)  # most likely first, ties by id
    probs = torch.exp(vals - lse)  # true probabilities
    rank = torch.arange(k_cap, device=scaled.device)[None, :]
    outside = rank >= torch.where(top_k > 0, top_k, k_cap)[:, None]
    kept = probs.masked_fill(outside, 0.0)
    # top-p acts on the distribution left after top-k (renormalised); without top-k, on the whole one
    kept = kept / torch.where(top_k > 0, kept.sum(-1), torch.ones_like(top_p))[:, None]
    outside |= (kept.cumsum(-1) - kept) >= top_p[:, None]
    choice = ids.gather(1, gumbel_argmax(vals.masked_fill(outside, float("-inf")), key, ids)[:, None])[:, 0]
    exact = (top_k > 0) | (top_p >= 1.0) | (probs.sum(-1) >= top_p)
    if not ties_by_key and k_cap < vocab:  # the set reaches a logit tied with the k_cap-th: a lower id may be out
        exact &= ~(~outside & (vals == vals[:, -1:])).any(-1)
    return choice, exact


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution `sample` draws one row from: softmax(logits / T) over the allowed set, in vocab
    order (zero outside it). For tests and notebooks."""
    t = torch.tensor([p.temperature], dtype=torch.float32)
    scaled, order = allowed_logits(logits.float()[None], t, torch.tensor([p.top_k]), torch.tensor([p.top_p]))
    probs = torch.softmax(scaled, dim=-1)[0]
    return probs if order is None else torch.zeros_like(probs).scatter_(0, order[0], probs)
