"""Rung 11: speculative decoding. Guess k tokens cheaply, check them all in ONE step of the target.

    before the step   tokens [t0 ... t9]          K/V written for [0, 9), t9 still to run
    propose           drafts d0 d1 d2 d3          an n-gram lookup, or a small draft model
    verify            run [t9 d0 d1 d2 d3] as one query of 5 tokens in the normal paged step (like a
                      small chunked prefill over the sequence's context, mixed with the other
                      requests' decodes and prefills): 5 rows of logits, K/V written for [9, 14)
    accept            greedy: the longest prefix of drafts equal to the target's argmax, then one
                      token from the target (the correction, or a bonus after all k): 1 to k + 1 tokens
                      sampled: draft i is kept with probability min(1, p(d_i) / q(d_i)); on a rejection
                      the token comes from max(0, p - q) normalised, so every token is distributed
                      exactly as the target's own (q is a point mass here: both proposers are greedy)
    roll back         [0, 9 + 1 + accepted)  K/V kept       the rest held rejected drafts: the blocks
                                                             past the kept positions go back, last first

At a small batch a decode step reads every weight to compute one token per sequence: the step is
bound by bytes, not FLOPs, so k + 1 query tokens cost about what 1 does. Each accepted draft is a
step saved. At a large batch the step is compute-bound and rejected drafts are paid for in full:
`speculative_disable_by_batch_size` turns speculation off above a batch size (see benchmarks/RESULTS.md).
On a GPU it defaults to GPU_MAX_SPECULATIVE_BATCH, the largest batch where n-gram drafts paid on an H100.

The engine keeps the drafts inside the sequence's tokens during the step (so the scheduler budgets
k + 1 tokens and the runner feeds them like any other tokens) and takes them out before anything
else sees them: the scheduler's update counts only accepted tokens as computed, so the prefix cache
never caches a block holding a rejected draft's K/V. Under memory pressure drafts shrink (to none)
before any request is preempted. Requests with n > 1 samples and beams run without drafts.

A learner's rollback plugs in with `LLM(..., spec_rollback=fn)`, see `rollback_blocks`.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

import numpy as np
import torch

from minikv.cache.block_manager import BlockManager, blocks_needed
from minikv.cache.blocks.pool import KVPool
from minikv.engine.batch import ScheduledBatch
from minikv.engine.runner import ModelRunner
from minikv.engine.sampler import allowed_logits, draw_keys, gumbel_argmax, uniform_noise
from minikv.engine.sampling_params import SamplingParams
from minikv.engine.sequence import Sequence, SequenceStatus

METHODS = ("ngram", "draft")
# On one H100 (Qwen2.5-0.5B shapes, k = 4, drafts all accepted: `benchmarks/speculative.py --gpu`, recorded
# in benchmarks/RESULTS.md) n-gram speculation against the plain engine with its overlapped steps: batch 1
# 1.04-1.14x, 2 1.19x, 4 1.17x, 8 0.92x, 16 0.83-0.90x, 64 0.38x, 256 0.16x. Above 4 requests a GPU engine
# stops drafting unless `speculative_disable_by_batch_size` says otherwise. (A CPU engine has no default:
# its single stream is where speculation is taught and measured.)
GPU_MAX_SPECULATIVE_BATCH = 4
NGRAM_MAX, NGRAM_MIN = 4, 1  # prompt lookup tries suffixes of 4 tokens down to 1

# the rung-11 seam: fn(block_table, num_computed_tokens, block_size, free) shortens block_table in place,
# handing every block past ceil(num_computed_tokens / block_size) to free(block), last block first
RollbackFn = Callable[[list[int], int, int, Callable[[int], None]], None]


# ---- proposers ------------------------------------------------------------------------------------
def propose_ngram(token_ids: list[int], k: int, max_n: int = NGRAM_MAX, min_n: int = NGRAM_MIN) -> list[int]:
    """Prompt lookup: find the longest suffix of `token_ids` (max_n down to min_n tokens) that occurred
    before, at its most recent earlier place, and propose the (up to k) tokens that followed it there.

        tokens  a b c d e b c d [?]     suffix "b c d" occurred at 1: propose "e b c d"[:k]

    One pass over the tokens: every earlier place of the last token is a candidate end, and each
    candidate's match is extended backwards (at most max_n tokens), all candidates at once."""
    if k <= 0 or len(token_ids) < 2:
        return []
    return lookup(np.fromiter(token_ids, dtype=np.int64, count=len(token_ids)), k, max_n, min_n)


def lookup(a: np.ndarray, k: int, max_n: int = NGRAM_MAX, min_n: int = NGRAM_MIN) -> list[int]:
    """`propose_ngram` on the tokens as an int64 array."""
    last = len(a) - 1
    if k <= 0 or last < 1:
        return []
    ends = np.flatnonzero(a[:-1] == a[-1])  # where an earlier n-gram ends on the same token
    if not len(ends):
        return []
    length = np.ones(len(ends), dtype=np.int64)  # how far back each candidate matches the suffix
    for j in range(1, max_n):
        ok = (length == j) & (ends >= j)
        ok[ok] = a[ends[ok] - j] == a[last - j]
        length[ok] += 1
    best = int(length.max())
    if best < min_n:
        return []
    start = int(ends[np.flatnonzero(length == best)[-1]]) + 1  # the most recent of the longest
    return a[start:start + k].tolist()


class NgramProposer:
    """Drafts from the request's own tokens (vLLM's "[ngram]", transformers' prompt lookup): free to
    compute, and good wherever the output repeats its input (summaries, edits, code)."""

    method = "ngram"

    def __init__(self):
        self.arrays: dict[int, tuple[Sequence, np.ndarray, int]] = {}  # seq_id -> its tokens so far, as int64

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        return [lookup(self._tokens(s), k) for s, k in zip(seqs, ks)]

    def _tokens(self, seq: Sequence) -> np.ndarray:
        """seq's tokens as an array, kept from step to step: only the tokens new since the last call are
        converted (a request's tokens only grow; a sequence that changed otherwise is converted anew)."""
        _, buf, n = self.arrays.get(seq.seq_id, (seq, np.empty(0, dtype=np.int64), 0))
        total, prompt = seq.num_tokens, seq.prompt_token_ids
        if n > total or (n and buf[n - 1] != (prompt[n - 1] if n <= len(prompt)
                                              else seq.output_token_ids[n - 1 - len(prompt)])):
            n = 0
        if total > len(buf):
            buf = np.concatenate([buf[:n], np.empty(max(total, 2 * len(buf)) - n, dtype=np.int64)])
        new = prompt[n:] + seq.output_token_ids[max(0, n - len(prompt)):]
        buf[n:total] = new
        self.arrays[seq.seq_id] = (seq, buf, total)
        return buf[:total]

    def rollback(self, seq: Sequence, num_accepted: int) -> None:
        pass

    def sweep(self) -> None:
        for sid in [sid for sid, (seq, _, _) in self.arrays.items() if seq.is_finished]:
            del self.arrays[sid]

    def reset(self) -> None:
        self.arrays = {}


class _DraftSeq:
    """What the draft model's runner sees of a sequence: its tokens (the target's, then this step's
    drafts) and its own block table in the draft pool. [0, num_computed_tokens) K/V written."""

    cache_row = None

    def __init__(self, seq: Sequence):
        self.seq, self.request_id = seq, seq.request_id
        self.prompt_token_ids: list[int] = []
        self.output_token_ids: list[int] = []
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_fed = 0  # tokens whose K/V the last proposal wrote (the target's, then drafts but the last)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


def layer_skip_draft(model, num_layers: int):
    """The target's first `num_layers` layers, its final norm and LM head, as a model of their own (the
    weights are shared, nothing is copied): a self-speculative draft (LayerSkip)."""
    from minikv.model.llama import Decoder, LlamaForCausalLM

    total = len(model.model.layers)
    if not 1 <= num_layers < total:
        raise ValueError(f"draft_model='self:{num_layers}' takes the target's first {num_layers} layers, but it "
                         f"has {total}; use 'self:N' with 1 <= N < {total}")
    decoder = Decoder.__new__(Decoder)
    torch.nn.Module.__init__(decoder)
    decoder.embed_tokens, decoder.norm = model.model.embed_tokens, model.model.norm
    decoder.layers = torch.nn.ModuleList(list(model.model.layers)[:num_layers])
    draft = LlamaForCausalLM.__new__(LlamaForCausalLM)
    torch.nn.Module.__init__(draft)
    draft.config = replace(model.config, num_layers=num_layers)
    draft.model, draft.lm_head = decoder, model.lm_head
    draft._inv_freq, draft.fused_ops = model._inv_freq, model.fused_ops
    return draft


class DraftModelProposer:
    """A smaller model sharing the tokenizer proposes k tokens greedily, one decode step at a time over
    every speculating sequence at once, on its own paged KV: its blocks follow the target's and roll
    back the same way (K/V of tokens the target rejected are dropped)."""

    method = "draft"

    def __init__(self, model, num_blocks: int, block_size: int, device, dtype, attention: str = "torch"):
        c = model.config
        self.model = model
        try:
            self.pool = KVPool(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, dtype, device)
        except torch.OutOfMemoryError:
            size = KVPool.bytes_per_block(c.num_layers, block_size, c.num_kv_heads, c.head_dim, dtype) * num_blocks
            raise ValueError(f"the draft model's KV pool ({num_blocks:,} blocks, {size / 2**30:.1f} GiB: its blocks "
                             "follow the target's) does not fit beside the target's; give the target a smaller "
                             "pool (num_blocks or kv_cache_memory) to leave room") from None
        if attention == "triton":
            from minikv.attention.triton_backend import TritonPagedBackend as backend_cls
        else:
            from minikv.attention.paged import PagedBackend as backend_cls
        self.bm = BlockManager(num_blocks, block_size)
        self.runner = ModelRunner(model, backend_cls(self.pool), device, block_size, pool=self.pool)
        self.states: dict[int, _DraftSeq] = {}

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in seqs]
        active = []
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            if k <= 0:
                continue
            st = self.states.get(seq.seq_id)
            if st is None:
                st = self.states[seq.seq_id] = _DraftSeq(seq)
            st.prompt_token_ids, st.output_token_ids = seq.token_ids, []
            # the draft re-runs at least the last token (its logits give the first draft)
            st.num_computed_tokens = min(st.num_computed_tokens, len(st.prompt_token_ids) - 1)
            if not self.bm.can_grow(st, len(st.prompt_token_ids) + k - 1):
                continue  # the draft pool is full: this sequence goes without drafts this step
            self.bm.grow(st, len(st.prompt_token_ids) + k - 1)
            active.append((i, st, k))
        if not active:
            return out
        # the first draft: catch up on the tokens the draft has not seen yet (a prefill the first time)
        batch = ScheduledBatch()
        for _, st, _ in active:
            batch.add(st, st.num_computed_tokens, len(st.prompt_token_ids) - st.num_computed_tokens)
        for j in range(max(k for _, _, k in active)):
            logits, rows = self.runner.run(batch)
            tokens = logits.argmax(dim=-1).tolist()
            for (_, st, _), row, tok in zip([a for a in active if a[2] > j], rows, tokens):
                st.num_computed_tokens = batch.starts[row] + batch.num_new_tokens[row]
                st.output_token_ids.append(tok)
            batch = ScheduledBatch()  # then one token at a time, the last draft in
            for _, st, k in active:
                if k > j + 1:
                    batch.add(st, st.num_computed_tokens, 1)
        for i, st, _ in active:
            out[i] = list(st.output_token_ids)
            st.num_fed = st.num_computed_tokens
        return out

    def rollback(self, seq: Sequence, num_accepted: int) -> None:
        """The target kept `num_accepted` drafts: the draft's K/V of the rejected ones go, and the blocks
        past what is left."""
        st = self.states.get(seq.seq_id)
        if st is None or not st.output_token_ids:
            return
        kept = len(st.prompt_token_ids) + num_accepted  # tokens the draft fed that the target agrees with
        st.num_computed_tokens = min(st.num_fed, kept)
        st.output_token_ids = []
        self.bm.trim_table(st, blocks_needed(st.num_computed_tokens, self.bm.block_size))

    def sweep(self) -> None:
        """Finished sequences give their draft blocks back."""
        for sid in [sid for sid, st in self.states.items() if st.seq.is_finished]:
            self.bm.free(self.states.pop(sid))

    def reset(self) -> None:
        """After a fault: every draft block goes back (the draft catches up from the tokens next time)."""
        self.bm = BlockManager(self.bm.num_blocks, self.bm.block_size)
        self.states = {}


# ---- acceptance -----------------------------------------------------------------------------------
def accept_greedy(drafts: list[int], target_argmax: list[int]) -> list[int]:
    """The tokens a greedy request keeps: the drafts up to the first one that differs from the
    target's argmax, then the target's own token there (the bonus token when all k match).
    target_argmax has len(drafts) + 1 entries: the argmax after the last token and after each draft."""
    m = 0
    while m < len(drafts) and drafts[m] == target_argmax[m]:
        m += 1
    return drafts[:m] + [target_argmax[m]]


def residual(p_row: torch.Tensor, q_row: torch.Tensor | None, draft: int) -> torch.Tensor:
    """max(0, p - q) normalised: where to draw from after draft was rejected (q None: a point mass on
    draft, so the residual is p without draft). p itself if nothing is left (p <= q everywhere)."""
    if q_row is None:
        r = p_row.clone()
        r[draft] = 0
    else:
        r = torch.clamp(p_row - q_row, min=0)
    s = float(r.sum())
    return p_row if s <= 0 else r / s


def accept_sampled(drafts: list[int], p: torch.Tensor, u: list[float], draw: Callable[[torch.Tensor, int], int],
                   q: torch.Tensor | None = None) -> list[int]:
    """The tokens a sampled request keeps (the rejection rule of Leviathan et al. and Chen et al.).

    p: [k + 1, V] the target's probabilities after the last token and after each draft; q: [k, V] the
    draft's (None: point masses on the drafts); u: k uniforms in [0, 1); draw(dist, j): a token drawn
    from dist for the j-th position. Draft i is kept when u[i] < min(1, p_i(d_i) / q_i(d_i)); the first
    rejection draws from max(0, p_i - q_i) normalised and stops; if all k are kept, a bonus token comes
    from p_k. Each token is then distributed exactly as the target's."""
    for i, d in enumerate(drafts):
        qd = 1.0 if q is None else float(q[i, d])
        ratio = float(p[i, d]) / qd if qd > 0 else math.inf
        if not u[i] < min(1.0, ratio):
            return drafts[:i] + [draw(residual(p[i], None if q is None else q[i], d), i)]
    return drafts + [draw(p[len(drafts)], len(drafts))]


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[R, V] logits of one request -> its sampling distribution per row (temperature, top-k, top-p)."""
    R = logits.shape[0]
    at = logits.device  # the sampling parameters go where the logits are (a GPU's, in a GPU engine)
    scaled, order = allowed_logits(logits.float(), torch.full((R,), params.temperature, device=at),
                                   torch.full((R,), params.top_k, device=at), torch.full((R,), params.top_p, device=at))
    probs = torch.softmax(scaled, dim=-1)
    if order is not None:  # back to vocab order
        probs = torch.zeros_like(probs).scatter_(1, order, probs)
    return probs


def verify(seq: Sequence, drafts: list[int], logits: torch.Tensor, argmax: list[int] | None = None) -> list[int]:
    """The tokens seq keeps from its k drafts and the target's k + 1 rows of logits (argmax: theirs, if
    known already: the engine takes the whole batch's in one copy from the device)."""
    if seq.params.greedy:
        return accept_greedy(drafts, argmax if argmax is not None else logits.argmax(dim=-1).tolist())
    p = target_probs(logits, seq.params).cpu()
    start = len(seq.output_token_ids)
    vocab = p.shape[-1]
    keys = torch.from_numpy(draw_keys([seq.seed] * (len(drafts) + 1), [start + j for j in range(len(drafts) + 1)]))
    u = uniform_noise(keys, torch.tensor([vocab]))[:, 0].tolist()  # an id outside the vocab: its own stream

    def draw(dist: torch.Tensor, j: int) -> int:
        return int(gumbel_argmax(torch.log(dist.float())[None, :], keys[j:j + 1], torch.arange(vocab))[0])
    return accept_sampled(drafts, p, u[:len(drafts)], draw)


# ---- rollback ---------------------------------------------------------------------------------------
def rollback_blocks(block_table: list[int], num_computed_tokens: int, block_size: int,
                    free: Callable[[int], None]) -> None:
    """Keep the blocks that hold positions [0, num_computed_tokens); give every later one to free(),
    last block first, shortening block_table in place.

        block_table  [7, 3, 9, 12]   block_size 4, num_computed_tokens 6 -> keep ceil(6 / 4) = 2
                     [7, 3]          free(12), free(9)
    """
    keep = -(-num_computed_tokens // block_size)
    while len(block_table) > keep:
        free(block_table.pop())


def checked_rollback(fn: RollbackFn, bm: BlockManager, seq: Sequence) -> int:
    """Run a rollback function on a copy of seq's table, check what it did, then apply it to the pool.
    Returns the number of blocks given back; a wrong answer is a ValueError that names what is wrong."""
    before = list(seq.block_table)
    table, freed = list(before), []
    fn(table, seq.num_computed_tokens, bm.block_size, freed.append)
    keep = blocks_needed(seq.num_computed_tokens, bm.block_size)
    want = before[keep:][::-1]
    name = getattr(fn, "__name__", "spec_rollback")
    if table != before[:keep] or freed != want:
        raise ValueError(
            f"{name}: request {seq.request_id} holds blocks {before} and K/V for {seq.num_computed_tokens} positions "
            f"(block_size {bm.block_size}); it must keep {before[:keep]} and free {want} (last first), but it left "
            f"{table} and freed {freed}")
    bm.trim_table(seq, keep)
    return len(want)


# ---- the step ---------------------------------------------------------------------------------------
class Speculator:
    """Proposes drafts before the scheduler runs, verifies them after the forward, rolls the KV back.
    One per engine (EngineCore.speculator); `step(core)` is the engine's step when speculation is on."""

    def __init__(self, method: str, k: int, proposer, disable_by_batch_size: int | None = None,
                 rollback: RollbackFn | None = None):
        self.method, self.k, self.proposer = method, k, proposer
        self.disable_by_batch_size = disable_by_batch_size
        self.rollback_fn = rollback or rollback_blocks
        self.drafts: dict[int, tuple[Sequence, list[int]]] = {}  # seq_id -> drafts now in its tokens
        self.num_drafted = self.num_accepted = self.num_verify_rows = 0
        self.num_rolled_back_blocks = 0

    # the scheduler asks how many of a sequence's tokens are drafts (they shrink before a preemption)
    def num_drafts(self, seq: Sequence) -> int:
        entry = self.drafts.get(seq.seq_id)
        return len(entry[1]) if entry is not None else 0

    def stats(self) -> dict:
        rate = self.num_accepted / self.num_drafted if self.num_drafted else None
        per = {"drafted": self.num_drafted, "accepted": self.num_accepted, "acceptance_rate": rate}
        return {"method": self.method, "num_speculative_tokens": self.k, **per, self.method: dict(per),
                "verified_requests": self.num_verify_rows, "rolled_back_blocks": self.num_rolled_back_blocks}

    def _strip(self, seq: Sequence, keep: int = 0) -> list[int]:
        """Take seq's drafts out of its tokens, all but the first `keep`; returns those kept."""
        s, drafts = self.drafts.pop(seq.seq_id)
        del seq.output_token_ids[len(seq.output_token_ids) - len(drafts):]
        if keep:
            seq.output_token_ids.extend(drafts[:keep])
            self.drafts[seq.seq_id] = (seq, drafts[:keep])
        return drafts[:keep]

    def drop(self, seq: Sequence) -> None:
        """seq is aborted in the middle of a step: its drafts leave its tokens now."""
        if seq.seq_id in self.drafts:
            self._strip(seq)

    def strip_all(self) -> None:
        """Every draft leaves the tokens (a fault inside a step: the tokens must be the truth again)."""
        for seq, _ in list(self.drafts.values()):
            self._strip(seq)
        self.proposer.reset()

    def _propose(self, sch, bm: BlockManager, max_model_len: int) -> None:
        """Append drafts to the running decodes, within the token budget and the free blocks left once
        every running sequence has the blocks its own next tokens need."""
        running = sch.running
        if self.disable_by_batch_size is not None and len(running) > self.disable_by_batch_size:
            return
        budget = sch.max_num_batched_tokens - sum(s.num_tokens - s.num_computed_tokens for s in running)
        free = bm.num_free_blocks - sum(bm.num_new_blocks(s, s.num_tokens) for s in running)
        seqs, ks = [], []
        for s in running:
            if (s.num_computed_tokens != s.num_tokens - 1 or s.params.n > 1 or s.beam_search is not None
                    or s.num_pending_forks or s.is_finished):
                continue
            k = min(self.k, budget, s.params.max_tokens - len(s.output_token_ids) - 1, max_model_len - s.num_tokens)
            while k > 0 and bm.num_new_blocks(s, s.num_tokens + k) - bm.num_new_blocks(s, s.num_tokens) > free:
                k -= 1
            if k <= 0:
                continue
            seqs.append(s)
            ks.append(k)
            budget -= k
            free -= bm.num_new_blocks(s, s.num_tokens + k) - bm.num_new_blocks(s, s.num_tokens)
        for s, drafts in zip(seqs, self.proposer.propose(seqs, ks)):
            if drafts:
                s.output_token_ids.extend(drafts)
                self.drafts[s.seq_id] = (s, list(drafts))

    def _trim(self, batch: ScheduledBatch) -> dict[int, int]:
        """After scheduling: drafts of a sequence that did not run (or ran fewer) leave its tokens.
        Returns {batch row: drafts it verifies}."""
        row_of = {s.seq_id: i for i, s in enumerate(batch.seqs)}
        rows = {}
        for sid, (seq, drafts) in list(self.drafts.items()):
            i = row_of.get(sid)
            granted = 0
            if i is not None and seq.status == SequenceStatus.RUNNING:
                granted = max(0, min(len(drafts), batch.num_new_tokens[i] - 1))
            self._strip(seq, granted)
            if granted:
                rows[i] = granted
            else:  # not verified this step: the draft's K/V of its proposals go
                self.proposer.rollback(seq, 0)
        return rows

    def step(self, core) -> list:
        """The engine's step with speculation (EngineCore._step calls it); the plain step's parts do the rest."""
        sch, bm = core.scheduler, core.block_manager
        self.proposer.sweep()
        self._propose(sch, bm, core.max_model_len)
        batch = core._schedule()
        spec_rows = self._trim(batch)
        if not batch:
            return []
        prepared = core.runner.prepare_step(batch)
        # widen the logits: every position of a verifying row, not only its last
        ends = np.cumsum(batch.num_new_tokens) - 1  # each row's last token in the flattened batch
        wide, spans = [], []
        for r in prepared.sample_rows:
            g = spec_rows.get(r, 0)
            spans.append((len(wide), g + 1))
            wide.extend(range(int(ends[r]) - g, int(ends[r]) + 1))
        if spec_rows:
            ids = torch.tensor(wide, dtype=torch.long).to(prepared.inputs.logits_indices.device)
            prepared = prepared._replace(inputs=replace(prepared.inputs, logits_indices=ids))
        logits = core.runner.forward(batch, prepared)
        greedy = any(batch.seqs[r].params.greedy for r in spec_rows)
        argmax = logits.argmax(dim=-1).tolist() if greedy else None  # one copy from the device for all
        plain_seqs, plain_rows, events, verified = [], [], [], []
        for j, r in enumerate(prepared.sample_rows):
            seq, (at, width) = batch.seqs[r], spans[j]
            if r not in spec_rows:
                plain_seqs.append(seq)
                plain_rows.append(at)
                continue
            if seq.seq_id not in self.drafts:  # aborted meanwhile (by an observer): drafts dropped then
                continue
            drafts = self.drafts[seq.seq_id][1]
            self._strip(seq)
            kept = verify(seq, drafts, logits[at:at + width], argmax[at:at + width] if argmax is not None else None)
            accepted = len(kept) - 1
            self.num_drafted += len(drafts)
            self.num_accepted += accepted
            self.num_verify_rows += 1
            seq.num_drafted_tokens += len(drafts)
            seq.num_accepted_tokens += accepted
            batch.num_new_tokens[r] = 1 + accepted  # what counts as computed: the rejected drafts do not
            self.proposer.rollback(seq, accepted)
            for tok in kept:
                delta = core.append_token(seq, tok)
                core._publish(seq, tok, delta)
                events.append((seq, tok, delta))
                if seq.is_finished:
                    break
            verified.append(seq)
        plain_logits = logits[plain_rows] if len(plain_rows) < logits.shape[0] else logits
        events += core._finish_step(batch, plain_logits, plain_seqs)
        for seq in verified:  # before the next step: the blocks past the accepted tokens go back
            if not seq.is_finished and seq.block_table:
                self.num_rolled_back_blocks += checked_rollback(self.rollback_fn, bm, seq)
        return core._end_step(batch, events)


def build_speculator(cfg, loaded, core_pool_blocks: int) -> Speculator | None:
    """The engine's Speculator for its config (None when speculation is off), or a ValueError."""
    if cfg.speculative is None:
        return None
    if cfg.sliding_window is not None:
        raise ValueError(f"speculative decoding rolls back the K/V of rejected drafts, which a sliding window "
                         f"(here {cfg.sliding_window}) may already have dropped blocks around; use a model without "
                         "a window, or speculative=None")
    if cfg.speculative == "draft":
        draft = cfg.draft_model
        if isinstance(draft, str) and draft.startswith("self:"):
            try:
                n = int(draft.removeprefix("self:"))
            except ValueError:
                raise ValueError(f"draft_model={draft!r}: write 'self:N' with N the number of the target's first "
                                 "layers the draft runs, e.g. 'self:4'") from None
            model = layer_skip_draft(loaded.model, n)
        else:
            from minikv.model.loader import LoadedModel, load_model

            other = draft if isinstance(draft, LoadedModel) else load_model(draft, cfg.device, cfg.dtype)
            if other.config.vocab_size != loaded.config.vocab_size:
                raise ValueError(f"draft_model {draft!r} has a vocabulary of {other.config.vocab_size:,} tokens "
                                 f"but the target has {loaded.config.vocab_size:,}; a draft must share the target's "
                                 "tokenizer (or use draft_model='self:N', the target's first N layers)")
            model = other.model
            model.fused_ops = loaded.model.fused_ops
        proposer = DraftModelProposer(model, core_pool_blocks, cfg.block_size, cfg.device, cfg.dtype, cfg.attention)
    else:
        proposer = NgramProposer()
    return Speculator(cfg.speculative, cfg.num_speculative_tokens, proposer, cfg.speculative_disable_by_batch_size,
                      cfg.spec_rollback)
