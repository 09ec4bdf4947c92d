"""Rung 3: static batching. Requests run in fixed groups of `batch_size`; a group is padded into a
rectangle, starts together, and holds all its slots until its LONGEST request is done.

    4 requests, batch_size 2. Batch 0 = a (3 prompt tokens, 3 new) and b (5 prompt tokens, 5 new):

    column    0  1  2  3  4 | 5  6  7  8     one column = one position of the cache row
    slot 0    .  .  a  a  a | a  a  ~  ~     a is done after 3 tokens; its row still runs (idle)
    slot 1    b  b  b  b  b | b  b  b  b     b is the longest: the batch ends with it
              prefill, 1 step | decode, 4 steps
    .  prompt padding: computed, written to the cache, masked out of attention
    ~  idle decode row: a pad token is fed, its K/V written, its logits thrown away
    Batch 1 (c, d) starts only now, in the same two cache rows.

Left padding. Every prompt is padded on the LEFT to the batch's longest prompt P, so every row's
last prompt token sits in column P-1 and every decode step writes one shared column: the batch
stays a rectangle [rows, columns], which is what static batching means. Each row keeps its own
truth:

    cache row of a request with `pad` pads:
    [0, pad)          pad tokens: computed, but no real query ever attends to them
    [pad, column]     its own tokens; RoPE position = column - pad, exactly as when run alone

so each request's tokens equal rung 2's (the same positions, the same keys, only pads added and
masked). The waste is real, and counted: pad columns of the prefill and idle rows of every decode
step go through the whole model.

Batch resizing. Removing finished rows from the batch (`compact="move"` or `"renumber"`) saves the
idle rows' compute, but a request that changes slot must take its cache row with it. Renumbering
the survivors to slots 0..k-1 without moving their rows (`compact="renumber"`) makes a request
read another request's keys and values: its output changes. Paged KV (rung 4) makes this free:
only a block table moves.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from minikv.attention.contiguous import ContiguousBackend
from minikv.attention.metadata import ContiguousMetadata
from minikv.cache.blocks.pool import RowPool
from minikv.engine.llm import pair_requests
from minikv.engine.outputs import RequestOutput
from minikv.engine.sampler import draw_key, sample
from minikv.engine.sampling_params import SamplingParams
from minikv.engine.sequence import Sequence, SequenceStatus

COMPACT_MODES = ("none", "move", "renumber")

# what one cell of the slots x columns grid held (BatchTrace.cells)
EMPTY, PAD, PROMPT, DECODE, IDLE = 0, 1, 2, 3, 4
CELL_NAMES = {EMPTY: "empty slot", PAD: "prompt padding", PROMPT: "prompt", DECODE: "useful decode",
              IDLE: "idle decode"}


@dataclass(kw_only=True)
class PaddedMetadata(ContiguousMetadata):
    pad_lens: torch.Tensor  # [B] left pads of each row: columns [0, pad) are masked


# padded_mask(pad_lens [B], q_cols [B, n], L) -> [B, n, L] bool: which keys each query of the step may see
PaddedMask = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


class PaddedContiguousBackend(ContiguousBackend):
    """Contiguous cache rows (rung 2) read as ONE rectangle, with each row's left padding masked.
    mask_fn: a learner's `padded_mask(pad_lens, q_cols, L)` (exercise 03a) in place of the rule below."""

    name = "contiguous-padded"

    def __init__(self, pool: RowPool, sliding_window: int | None = None, mask_fn: PaddedMask | None = None):
        super().__init__(pool, sliding_window)
        self.mask_fn = mask_fn

    def padded_mask(self, meta: PaddedMetadata, L: int) -> torch.Tensor:
        """[B, n, L] bool: may the query in column i of row b see the key in column j? Once per step."""
        if self.mask_fn is not None:
            return self._mask_by_seam(meta, L)
        if "padded_mask" not in meta.step_memo:
            B, n = meta.num_seqs, meta.max_query_len
            q_col = meta.token_pos.view(B, n, 1)  # column of each query
            k_col = torch.arange(L, device=q_col.device).view(1, 1, L)
            pad = meta.pad_lens.view(B, 1, 1)
            # causal; a real query never sees a pad, a pad query sees earlier pads (never an empty row)
            mask = (k_col <= q_col) & ((k_col >= pad) | (q_col < pad))
            if self.sliding_window is not None:
                mask &= k_col > q_col - self.sliding_window
            meta.step_memo["padded_mask"] = mask
        return meta.step_memo["padded_mask"]

    def _mask_by_seam(self, meta: PaddedMetadata, L: int) -> torch.Tensor:
        """The learner's mask, checked for its type and shape, with the model's window on top."""
        if "padded_mask" not in meta.step_memo:
            B, n = meta.num_seqs, meta.max_query_len
            q_cols = meta.token_pos.view(B, n)
            mask = self.mask_fn(meta.pad_lens.clone(), q_cols.clone(), L)  # copies: the metadata stays intact
            if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (B, n, L) or mask.dtype != torch.bool:
                raise ValueError(f"padded_mask returned {getattr(mask, 'dtype', type(mask).__name__)} "
                                 f"{tuple(getattr(mask, 'shape', ()))}; expected a bool tensor of shape {(B, n, L)}")
            if self.sliding_window is not None:
                k, q = torch.arange(L, device=q_cols.device).view(1, 1, L), q_cols.view(B, n, 1)
                mask = mask & (k > q - self.sliding_window)
            meta.step_memo["padded_mask"] = mask.to(q_cols.device)
        return meta.step_memo["padded_mask"]

    def forward(self, layer, q, k, v, meta: PaddedMetadata, scale: float) -> torch.Tensor:
        if meta.max_seq_len > self.pool.max_len:
            raise ValueError(f"batch reached column {meta.max_seq_len} but cache rows hold {self.pool.max_len}")
        rows, k_cache, v_cache = meta.cache_rows, self.pool.k_cache[layer], self.pool.v_cache[layer]
        k_cache[rows[meta.token_seq], meta.token_pos] = k  # token_pos = column in the row
        v_cache[rows[meta.token_seq], meta.token_pos] = v
        B, n, L = meta.num_seqs, meta.max_query_len, meta.max_seq_len  # every row runs the same n columns
        T, num_heads, head_dim = q.shape
        keys = k_cache[rows, :L]  # [B, L, num_kv_heads, head_dim]
        values = v_cache[rows, :L]
        mask = self.padded_mask(meta, L)  # [B, n, L]
        group = num_heads // keys.shape[2]  # grouped-query attention
        kk = keys.transpose(1, 2).repeat_interleave(group, dim=1)  # [B, num_heads, L, head_dim]
        vv = values.transpose(1, 2).repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q.view(B, n, num_heads, head_dim).transpose(1, 2), kk, vv,
                                             attn_mask=mask[:, None], scale=scale)  # [B, heads, n, head_dim]
        return out.transpose(1, 2).reshape(T, num_heads, head_dim)


@dataclass
class BatchTrace:
    """One batch as a grid: cells[slot, column] is EMPTY, PAD, PROMPT, DECODE or IDLE."""

    request_indices: list[int]  # which prompts (positions in the generate call) ran in this batch
    prompt_len: int  # P: the padded prompt length, i.e. the prefill's columns
    cells: np.ndarray  # [batch_size, P + decode steps] int8
    generated: list[int]  # tokens each request of the batch generated

    @property
    def num_steps(self) -> int:
        """Model calls of this batch: one prefill, then one per decode column."""
        return 1 + self.cells.shape[1] - self.prompt_len


@dataclass
class StaticBatchStats:
    """What one run computed, and how much of it served a request."""

    batch_size: int
    num_requests: int
    num_batches: int
    num_steps: int  # model calls: per batch, one prefill plus its decode steps
    prompt_tokens: int  # real prompt tokens computed
    prompt_pad_tokens: int  # pad columns computed by the prefills
    decode_tokens: int  # decode rows that fed a live request its last token
    idle_decode_tokens: int  # decode rows of finished requests: a pad fed, the result thrown away
    generated_tokens: int  # tokens sampled for requests (= slot-steps spent on a live request)
    slot_steps: int  # batch_size x steps: the slot time the run held
    wall_time: float  # seconds
    traces: list[BatchTrace] = field(default_factory=list, repr=False)

    @classmethod
    def from_traces(cls, batch_size: int, traces: list[BatchTrace], wall_time: float) -> "StaticBatchStats":
        count = lambda kind: int(sum((t.cells == kind).sum() for t in traces))  # noqa: E731
        steps = sum(t.num_steps for t in traces)
        return cls(batch_size, sum(len(t.request_indices) for t in traces), len(traces), steps,
                   count(PROMPT), count(PAD), count(DECODE), count(IDLE),
                   sum(sum(t.generated) for t in traces), batch_size * steps, wall_time, traces)

    @property
    def tokens_computed(self) -> int:
        return self.prompt_tokens + self.prompt_pad_tokens + self.decode_tokens + self.idle_decode_tokens

    @property
    def useful_tokens(self) -> int:
        return self.prompt_tokens + self.decode_tokens

    @property
    def wasted_tokens(self) -> int:
        return self.prompt_pad_tokens + self.idle_decode_tokens

    @property
    def waste_fraction(self) -> float:
        return self.wasted_tokens / self.tokens_computed

    @property
    def slot_utilisation(self) -> float:
        """Share of the slot-steps the batches held in which the slot served a live request."""
        return self.generated_tokens / self.slot_steps

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.wall_time

    def summary(self) -> str:
        return (f"batch_size {self.batch_size}: {self.num_requests} requests in {self.num_batches} batches, "
                f"{self.num_steps} steps; computed {self.tokens_computed} tokens, useful {self.useful_tokens} "
                f"(padding {self.prompt_pad_tokens}, idle rows {self.idle_decode_tokens}, "
                f"waste {self.waste_fraction:.1%}); slot utilisation {self.slot_utilisation:.1%}; "
                f"{self.wall_time:.2f} s, {self.tokens_per_second:.1f} tok/s")


@dataclass
class _Slot:
    seq: Sequence
    pad: int  # left pads before its prompt
    row: int  # the cache row it reads and writes


class StaticBatcher:
    """Serve prompts in static batches with the model, tokenizer and stop rules of an `LLM`.

        batcher = StaticBatcher(llm, batch_size=4)
        outputs = batcher.generate(prompts, SamplingParams(max_tokens=32))   # in prompt order
        print(batcher.stats.summary())

    compact: "none" keeps every slot until the batch ends (finished rows run idle);
             "move" drops finished rows and copies each survivor's cache row to its new slot;
             "renumber" drops finished rows WITHOUT moving cache rows: the bug this rung shows.

    Named seam, where your own code runs inside the batcher (exercise 03a plugs into it):
        padded_mask=fn   rung 3  which keys each query of a left-padded step may see:
                                 fn(pad_lens [B], q_cols [B, n], L) -> [B, n, L] bool
    """

    def __init__(self, llm, batch_size: int, compact: str = "none", pad_token_id: int = 0,
                 padded_mask: PaddedMask | None = None):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}; "
                             "it is how many requests run together in one batch")
        if compact not in COMPACT_MODES:
            raise ValueError(f"unknown compact mode {compact!r}; choose one of {', '.join(COMPACT_MODES)}")
        if not 0 <= pad_token_id < llm.config.vocab_size:
            raise ValueError(f"pad_token_id {pad_token_id} is outside the vocabulary [0, {llm.config.vocab_size})")
        if padded_mask is not None and not callable(padded_mask):
            raise ValueError(f"padded_mask must be a function (the rung 3 seam): (pad_lens [B], q_cols [B, n], L) "
                             f"-> [B, n, L] bool, got {type(padded_mask).__name__} {padded_mask!r}")
        self.llm, self.batch_size, self.compact, self.pad_token_id = llm, batch_size, compact, pad_token_id
        self.padded_mask = padded_mask
        self.rows: RowPool | None = None
        self.backend: PaddedContiguousBackend | None = None
        self.stats: StaticBatchStats | None = None

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion, `batch_size` at a time; outputs come back in prompt order."""
        prompts, params = pair_requests(prompts, params)
        start = time.perf_counter()
        seqs = [self.llm.make_sequence(p, sp) for p, sp in zip(prompts, params)]  # all arrive now
        groups = [list(range(i, min(i + self.batch_size, len(seqs)))) for i in range(0, len(seqs), self.batch_size)]
        # one cache for the run: batch_size rows, as many columns as the widest batch can need
        width = max(max(seqs[i].num_prompt_tokens for i in g) + max(seqs[i].params.max_tokens for i in g) - 1
                    for g in groups)
        c = self.llm.config
        self.rows = RowPool(c.num_layers, self.batch_size, width, c.num_kv_heads, c.head_dim, self.llm.dtype,
                            self.llm.device)
        self.backend = PaddedContiguousBackend(self.rows, c.sliding_window, self.padded_mask)
        traces = [self._run_batch(g, [seqs[i] for i in g]) for g in groups]
        self.stats = StaticBatchStats.from_traces(self.batch_size, traces, time.perf_counter() - start)
        return [self.llm.output(s) for s in seqs]

    def _run_batch(self, indices: list[int], seqs: list[Sequence]) -> BatchTrace:
        P = max(s.num_prompt_tokens for s in seqs)
        held = [self.rows.allocate_row() for _ in seqs]  # slot i of the batch owns cache row held[i]
        slots = [_Slot(s, P - s.num_prompt_tokens, row) for s, row in zip(seqs, held)]
        for s in seqs:
            s.status = SequenceStatus.RUNNING
        grid: list[list[int]] = []  # one list per column: what each slot held
        # prefill: columns [0, P) of every row, pads first
        self._step(slots, [[self.pad_token_id] * sl.pad + sl.seq.prompt_token_ids for sl in slots], 0, P)
        for col in range(P):
            grid.append(self._column(held, slots, lambda sl, col=col: PAD if col < sl.pad else PROMPT))
        running = slots
        while any(not sl.seq.is_finished for sl in slots):  # the batch ends with its longest request
            if self.compact != "none":
                running = self._compact(running, held)
            grid.append(self._column(held, running, lambda sl: IDLE if sl.seq.is_finished else DECODE))
            ids = [[self.pad_token_id] if sl.seq.is_finished else [sl.seq.last_token_id] for sl in running]
            self._step(running, ids, len(grid) - 1, 1)
        for s in seqs:
            s.num_computed_tokens = s.num_tokens - 1  # the last sampled token is never fed
        for row in held:
            self.rows.free_row(row)
        cells = np.array(grid, dtype=np.int8).T  # [batch_size, columns]
        return BatchTrace(indices, P, cells, [len(s.output_token_ids) for s in seqs])

    @torch.inference_mode()
    def _step(self, running: list[_Slot], ids: list[list[int]], start: int, n: int) -> None:
        """Run columns [start, start + n) of every running row as one model call; sample the live rows."""
        dev = self.llm.device
        long = lambda xs: torch.tensor(xs, dtype=torch.long, device=dev)  # noqa: E731
        B = len(running)
        positions = [max(col - sl.pad, 0) for sl in running for col in range(start, start + n)]  # pads: 0
        meta = PaddedMetadata.build([n] * B, [start + n] * B, dev, cache_rows=long([sl.row for sl in running]),
                                    pad_lens=long([sl.pad for sl in running]))
        last = meta.query_start_loc[1:] - 1  # every row's last column: idle rows' logits are computed too
        logits = self.llm.model(long([t for row in ids for t in row]), long(positions), meta, self.backend,
                                logits_indices=last)
        keep = [i for i, sl in enumerate(running) if not sl.seq.is_finished]
        tokens = sample(logits[keep], [running[i].seq.params for i in keep],
                        [draw_key(running[i].seq.seed, len(running[i].seq.output_token_ids)) for i in keep])
        for i, tok in zip(keep, tokens):
            self.llm.core.append_token(running[i].seq, tok)  # the stop rules and detokenizer of rung 2

    def _compact(self, running: list[_Slot], held: list[int]) -> list[_Slot]:
        """Drop finished rows; the k survivors take slots 0..k-1 of the batch."""
        survivors = [sl for sl in running if not sl.seq.is_finished]
        for i, sl in enumerate(survivors):
            if sl.row != held[i]:
                if self.compact == "move":
                    self.rows.move_row(sl.row, held[i])  # its K/V go with it
                sl.row = held[i]  # "renumber" stops here: the request now reads slot i's old row
        return survivors

    def _column(self, held: list[int], running: list[_Slot], kind) -> list[int]:
        col = [EMPTY] * self.batch_size
        for sl in running:
            col[held.index(sl.row)] = kind(sl)
        return col
