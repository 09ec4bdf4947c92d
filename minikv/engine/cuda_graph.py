"""Decode steps replayed from CUDA graphs: the whole model's launches for one step, issued at once.

A decode step of a small model is launch-bound: Qwen2.5-0.5B runs dozens of kernels in each of
its 24 layers (norms, projections, rotary embedding, KV store, attention, MLP), each launched from
Python for a few microseconds of GPU work. A CUDA graph records those
launches once (for one batch size) and replays them with a single call. A graph replays the same
kernels on the same addresses, so everything a step changes lives in static buffers (a `BatchInputs`
of max_num_seqs rows) into which each step copies the runner's own `BatchInputs`:

    static buffers (max_num_seqs rows)      a step with n = 5 sequences runs the graph of bucket 8
    input_ids    [t0 t1 t2 t3 t4 | 0  0  0 ]      rows [n, 8) are padding:
    positions    [p0 p1 p2 p3 p4 | 0  0  0 ]        slot -1      (the KV store skips it)
    slot_mapping [s0 s1 s2 s3 s4 |-1 -1 -1 ]        seq_len 1    (attends to one key of block 0)
    seq_lens     [l0 l1 l2 l3 l4 | 1  1  1 ]        their logits are dropped
    block_tables [the step's n rows, -1 past each table | padding rows: 0, then stale]
                 x ceil(max_model_len / block_size) columns; past the step's widest table: stale

The graph knows nothing of the attention backend but its `prepare_metadata`, called on the static
buffers when a bucket is captured (and on every step when run eagerly, capture=False).

Batch sizes are bucketed (1, 2, 4, 8, then steps of 16 up to max_num_seqs, as nano-vllm does) and
every bucket is captured when the engine starts, largest first, so that all share one memory pool
sized by the largest. What a graph freezes, and so what must stay fixed:
- the host values the kernels are launched with. The static buffers know no per-sequence lengths
  on the host (seq_lens_list None), and their max_seq_len is max_model_len: the decode kernel's
  split count and split length are cut from it, not from this step's longest context. Any length
  is still correct (the last split reads whatever lies past the others); short contexts just
  leave splits empty.
- tensor addresses: the pool, the weights and these buffers are allocated once, before capture.

Prefill and mixed steps get graphs too (`StepGraphs`, bucketed by token count: 16, 32, ... 1,024, then every
1,024 up to `cuda_graph_max_tokens`, 8,192 by default, and no larger than the bucket that holds the token
budget: `step_graph_tokens`; as vLLM V1's piecewise graphs are). A prefix hit
runs only its new suffix (a 2,048-token hit with 32 new tokens is a 32-token step): eagerly that is ~150
kernel launches from Python for ~2 ms of GPU work. A step of T tokens over B sequences runs the graph of
the smallest bucket T_b >= T; its rows hold every sequence the bucket can take (min(T_b, max_num_seqs)) plus one:

    tokens         [ seq 0 .. seq B-1 (T tokens) | padding tokens [T, T_b) ]
    sequences      [ 0 .. B-1 | B: the padding tokens, slot -1, attends over block 0 | B+1..: 0 tokens ]
    logits_indices [ the step's sampled rows | 0 ... ]

The prefill kernel's grid is frozen at capture: cdiv(T_b, BLOCK_M) + rows query tiles per head, laid out
flat (minikv/kernels/prefill_attention.py), so any split of the T_b tokens among the rows is covered and a
tile past its sequence's queries returns at once.
Buckets of at most 32 tokens (the backend's query_rows_max) read their context through the split-K
decode kernel instead, one row per token with its own causal length (minikv/attention/triton_backend.py):
a short suffix over a long cached prefix then spreads over the GPU, where the prefill kernel would give
each (sequence, head) one program walking the whole context alone.
Larger steps stay eager. Measured on an H200 (benchmarks/eager_step_gpu.py, Qwen2.5-0.5B shapes): an eager
step's forward launches about a dozen kernels a layer from Python, and a lone prompt of 300 tokens waited
12-22 ms for its first token while the device was busy 2.4 ms (8.8 ms at 3,000 tokens); steps of up to
~8,000 tokens wait on the host unless replayed.
"""
from __future__ import annotations

import sys
from typing import Callable

import torch

from minikv.attention.metadata import BatchInputs


def batch_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes that get a graph: 1, 2, 4, 8, then steps of 16, up to and including max_num_seqs."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class DecodeGraphs:
    """Runs decode-only steps through per-bucket CUDA graphs (capture=True, on a GPU) or, for tests on a
    CPU, eagerly through the very same padded static buffers (capture=False)."""

    def __init__(self, model, backend, device: torch.device, block_size: int, max_num_seqs: int,
                 max_model_len: int, vocab_size: int, capture: bool = True):
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}; run decode steps eagerly on it")
        self.model, self.backend, self.device, self.capture = model, backend, device, capture
        self.block_size, self.max_model_len = block_size, max_model_len
        self.buckets = batch_buckets(max_num_seqs)
        n, width = self.buckets[-1], -(-max_model_len // block_size)
        self.max_blocks = width  # block-table entries a graph can take (longer tables: run eagerly)
        long = dict(dtype=torch.long, device=device)
        block_tables = torch.full((n, width), -1, **long)
        block_tables[:, 0] = 0  # block 0: a valid block for padding rows to read
        self.inputs = BatchInputs(  # every row starts as padding: store nothing, read one key of block 0
            input_ids=torch.zeros(n, **long), positions=torch.zeros(n, **long),
            query_start_loc=torch.arange(n + 1, **long), seq_lens=torch.ones(n, **long),
            query_lens_list=[1] * n, seq_lens_list=None, max_seq_len=max_model_len,
            block_tables=block_tables, slot_mapping=torch.full((n,), -1, **long))
        self.logits = torch.zeros(n, vocab_size, dtype=torch.float32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.memory_pool = torch.cuda.graph_pool_handle() if capture else None  # shared by every bucket

    def bucket(self, n: int) -> int | None:
        """The smallest captured batch size that holds n sequences (None: too many, run eagerly)."""
        return next((b for b in self.buckets if b >= n), None)

    def fits(self, inputs: BatchInputs) -> bool:
        """A decode-only step (one token per sequence) of few enough sequences for the largest graph, with
        block tables that fit the static buffer."""
        return (inputs.num_seqs <= self.buckets[-1] and inputs.input_ids.numel() == inputs.num_seqs
                and inputs.block_tables.shape[1] <= self.max_blocks)

    def rows(self, bs: int) -> BatchInputs:
        """The static buffers' first bs rows, as the inputs of one decode step of bs sequences."""
        s = self.inputs
        return BatchInputs(input_ids=s.input_ids[:bs], positions=s.positions[:bs],
                           query_start_loc=s.query_start_loc[:bs + 1], seq_lens=s.seq_lens[:bs],
                           query_lens_list=[1] * bs, seq_lens_list=None, max_seq_len=self.max_model_len,
                           block_tables=s.block_tables[:bs], slot_mapping=s.slot_mapping[:bs])

    def _forward(self, bs: int) -> None:
        inputs = self.rows(bs)
        meta = self.backend.prepare_metadata(inputs)
        self.model(inputs.input_ids, inputs.positions, meta, self.backend, logits_out=self.logits[:bs])

    def run(self, inputs: BatchInputs) -> torch.Tensor:
        """One decode step of n = inputs.num_seqs sequences: returns their logits [n, vocab] (a view of the
        static buffer, valid until the next step)."""
        n = inputs.num_seqs
        bs = self.bucket(n)
        if bs is None:
            raise ValueError(f"{n} sequences exceed the largest captured batch ({self.buckets[-1]})")
        if inputs.input_ids.numel() != n:
            raise ValueError(f"a graph replays decode steps (one token per sequence), got {inputs.input_ids.numel()} "
                             f"tokens for {n} sequences; run this step eagerly")
        width = inputs.block_tables.shape[1]
        if width > self.max_blocks:
            raise ValueError(f"a block table of {width} blocks exceeds max_model_len {self.max_model_len} "
                             f"({self.max_blocks} blocks of {self.block_size})")
        s = self.inputs
        s.input_ids[:n].copy_(inputs.input_ids)
        s.positions[:n].copy_(inputs.positions)
        s.seq_lens[:n].copy_(inputs.seq_lens)
        s.slot_mapping[:n].copy_(inputs.slot_mapping)
        # entries past the step's widest table may be stale: they are never read (only positions < seq_len are)
        s.block_tables[:n, :width].copy_(inputs.block_tables)
        s.slot_mapping[n:bs] = -1  # padding rows: nothing stored, one key read from a valid block
        s.seq_lens[n:bs] = 1
        s.block_tables[n:bs, 0] = 0
        if not self.capture:
            self._forward(bs)
        else:
            if bs not in self.graphs:
                self.graphs[bs] = self._capture(bs)
            self.graphs[bs].replay()
        return self.logits[:n]

    def capture_all(self) -> None:
        """Record every bucket on padding rows only (nothing is stored, every row reads block 0)."""
        self.inputs.slot_mapping.fill_(-1)
        self.inputs.seq_lens.fill_(1)
        self.inputs.block_tables[:, 0] = 0
        for bs in reversed(self.buckets):
            if bs not in self.graphs:
                self.graphs[bs] = self._capture(bs)

    def _capture(self, bs: int) -> torch.cuda.CUDAGraph:
        return capture_graph(lambda: self._forward(bs), self.device, self.memory_pool)


_WARMUP_STREAMS: dict[int, torch.cuda.Stream] = {}  # device index -> the side stream of every warm-up


def warmup_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream every capture's warm-up runs on, in every engine of the process. cuBLAS keeps a
    workspace (32 MiB on a Hopper card) for each stream it has run on (pytorch/pytorch#99196). With a new
    stream per capture, 1,056 MiB (33 x 32 MiB) stayed allocated at a matmul after the engine closed
    (benchmarks/NOTES_step_profile.md). A stream holds no engine alive."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _WARMUP_STREAMS:
        _WARMUP_STREAMS[index] = torch.cuda.Stream(index)
    return _WARMUP_STREAMS[index]


def capture_graph(forward: Callable[[], None], device: torch.device, memory_pool) -> torch.cuda.CUDAGraph:
    """Record `forward` (one step on static buffers) as a CUDA graph in `memory_pool`. The warm-up run on a
    side stream (it compiles the Triton kernels and sets up cuBLAS) computes the step the buffers hold, so
    any K/V it stores are the ones a replay stores again."""
    stream = warmup_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=memory_pool):
        forward()
    return graph


def token_buckets(max_tokens: int, max_model_len: int) -> list[int]:
    """The step sizes (new tokens) that get a graph: 16, 32, 64, ... 1,024, then every 1,024 (2,048, 3,072,
    ...), up to max_tokens, none past max_model_len. Past 1,024 a step pays for its padding tokens in every
    matmul, so a step of 4,200 tokens runs the graph of 5,120, not of 8,192."""
    sizes, t = [], 16
    while t <= min(max_tokens, max_model_len):
        sizes.append(t)
        t = _next_bucket(t)
    return sizes


def _next_bucket(t: int) -> int:
    return t * 2 if t < 1024 else t + 1024


def step_graph_tokens(cuda_graph_max_tokens: int, max_num_batched_tokens: int, max_model_len: int) -> int:
    """The largest step size worth a graph: cuda_graph_max_tokens, but no larger than the bucket that holds
    the token budget (no step is larger than the budget: a budget of 3,000 needs the graph of 3,072, not those
    up to 8,192) and than max_model_len. Below 16, no step graph. The pool reserve counts this many tokens."""
    cover = 16
    while cover < max_num_batched_tokens:
        cover = _next_bucket(cover)
    return min(cuda_graph_max_tokens, cover, max_model_len)


class StepGraphs:
    """Runs small prefill and mixed steps (a prefix hit's suffix, a chunk's tail, a few prompts beside
    decodes) through per-token-count CUDA graphs (capture=True) or, on a CPU, eagerly through the very
    same static buffers (capture=False). See the top of the file for the layout.

    The logits land in `logits` (shared with the decode graphs: steps run one after another on one
    stream, and each step's logits are sampled before the next step overwrites them)."""

    def __init__(self, model, backend, device: torch.device, block_size: int, max_num_seqs: int,
                 max_model_len: int, logits: torch.Tensor, max_tokens: int, memory_pool=None, capture: bool = True):
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}; run small steps eagerly on it")
        self.model, self.backend, self.device, self.capture = model, backend, device, capture
        self.block_size, self.max_model_len, self.max_num_seqs = block_size, max_model_len, max_num_seqs
        self.buckets = token_buckets(max_tokens, max_model_len)
        if not self.buckets:
            raise ValueError(f"cuda_graph_max_tokens {max_tokens} leaves no step size to capture (the smallest is "
                             f"16 tokens, and at most max_model_len {max_model_len}); use at least 16, or 0 for none")
        t_max = self.buckets[-1]
        rows = max(self.rows_of(t) for t in self.buckets)
        if logits.shape[0] < self.samples_of(t_max):
            raise ValueError(f"the logits buffer has {logits.shape[0]} rows; a step of {t_max} tokens samples up to "
                             f"{self.samples_of(t_max)}")
        self.max_blocks = -(-max_model_len // block_size)
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(t_max, **long)
        self.positions = torch.zeros(t_max, **long)
        self.slot_mapping = torch.full((t_max,), -1, **long)
        self.query_start_loc = torch.zeros(rows + 1, **long)
        self.seq_lens = torch.zeros(rows, **long)
        self.block_tables = torch.zeros(rows, self.max_blocks, **long)  # padding rows read block 0
        self.logits_indices = torch.zeros(self.samples_of(t_max), **long)
        self.logits = logits
        # t_b -> its graph; (t_b, "grouped") -> the same bucket with the grouped query-row kernel (`kernel_for`)
        self.graphs: dict[int | tuple[int, str], torch.cuda.CUDAGraph] = {}
        self.memory_pool = memory_pool if memory_pool is not None or not capture else torch.cuda.graph_pool_handle()

    def samples_of(self, t_b: int) -> int:
        """Sequences (and so sampled rows) a step of bucket t_b can hold."""
        return min(t_b, self.max_num_seqs)

    def rows_of(self, t_b: int) -> int:
        """Sequence rows of bucket t_b: every sequence it can hold and the padding row (one more when that
        would make as many rows as tokens, which the metadata would take for a decode step)."""
        rows = self.samples_of(t_b) + 1
        return rows + 1 if rows == t_b else rows

    def bucket(self, num_tokens: int) -> int | None:
        """The smallest captured step size that holds num_tokens new tokens (None: too many, run eagerly)."""
        return next((b for b in self.buckets if b >= num_tokens), None)

    def fits(self, inputs: BatchInputs) -> bool:
        """A step of few enough tokens for the largest graph, of at most max_num_seqs sequences, with block
        tables that fit the static buffer."""
        return (inputs.input_ids.numel() <= self.buckets[-1] and inputs.num_seqs <= self.max_num_seqs
                and inputs.block_tables.shape[1] <= self.max_blocks)

    def static_inputs(self, t_b: int) -> BatchInputs:
        """The static buffers as one step of bucket t_b. Host values are bounds: the grid covers every row
        and t_b queries per row (a row with fewer returns early), and max_seq_len is max_model_len."""
        rows = self.rows_of(t_b)
        return BatchInputs(input_ids=self.input_ids[:t_b], positions=self.positions[:t_b],
                           query_start_loc=self.query_start_loc[:rows + 1], seq_lens=self.seq_lens[:rows],
                           query_lens_list=[t_b] + [0] * (rows - 1), seq_lens_list=None,
                           max_seq_len=self.max_model_len, block_tables=self.block_tables[:rows],
                           slot_mapping=self.slot_mapping[:t_b],
                           logits_indices=self.logits_indices[:self.samples_of(t_b)])

    def kernel_for(self, t_b: int, inputs: BatchInputs | None = None) -> str | None:
        """The query-row kernel a step of bucket t_b runs with ("grouped" or "decode"; None: the bucket's
        steps are not query-row steps, or the backend has no choice). The backend decides from the step's
        host lengths, which a graph's static buffers do not hold: so each choice is a graph of its own."""
        choose = getattr(self.backend, "query_rows_kernel", None)
        if choose is None or t_b > getattr(self.backend, "query_rows_max", 0):
            return None
        if inputs is None or inputs.seq_lens_list is None:
            return "decode"
        return choose(num_seqs=inputs.num_seqs, min_context=min(inputs.seq_lens_list))

    def kernels_of(self, t_b: int) -> set[str | None]:
        """Every kernel a step of bucket t_b may run with (`kernel_for`): the graphs `capture_all` records. The
        backend is asked about its extremes, one sequence over the longest context and many over none, so a
        grouped graph is recorded only where a step can choose it (not under a sliding window, say)."""
        kernels = {self.kernel_for(t_b)}
        if kernels != {None}:
            kernels |= {self.backend.query_rows_kernel(num_seqs=n, min_context=c)
                        for n, c in ((1, sys.maxsize), (sys.maxsize, 0))}
        return kernels

    @staticmethod
    def _key(t_b: int, kernel: str | None) -> int | tuple[int, str]:
        return (t_b, kernel) if kernel == "grouped" else t_b

    def _forward(self, t_b: int, kernel: str | None = None) -> None:
        inputs = self.static_inputs(t_b)
        meta = self.backend.prepare_metadata(inputs)
        if kernel is not None:  # recorded with this kernel: the static buffers' lengths are only bounds
            self.backend.query_rows_capture = kernel
        try:
            self.model(inputs.input_ids, inputs.positions, meta, self.backend, logits_indices=inputs.logits_indices,
                       logits_out=self.logits[:inputs.logits_indices.numel()])
        finally:
            if kernel is not None:
                self.backend.query_rows_capture = None

    def run(self, inputs: BatchInputs) -> torch.Tensor:
        """One step of T = inputs.input_ids.numel() tokens over B sequences: the logits [S, vocab] of its
        S = len(logits_indices) sampled rows (a view of the static buffer, valid until the next step)."""
        T, B = inputs.input_ids.numel(), inputs.num_seqs
        t_b = self.bucket(T)
        if t_b is None:
            raise ValueError(f"a step of {T} tokens exceeds the largest captured step ({self.buckets[-1]} tokens); "
                             "run it eagerly")
        if B > self.max_num_seqs:
            raise ValueError(f"{B} sequences exceed max_num_seqs {self.max_num_seqs}")
        width = inputs.block_tables.shape[1]
        if width > self.max_blocks:
            raise ValueError(f"a block table of {width} blocks exceeds max_model_len {self.max_model_len} "
                             f"({self.max_blocks} blocks of {self.block_size})")
        rows, S = self.rows_of(t_b), inputs.logits_indices.numel()
        self.input_ids[:T].copy_(inputs.input_ids)
        self.positions[:T].copy_(inputs.positions)
        self.slot_mapping[:T].copy_(inputs.slot_mapping)
        self.input_ids[T:t_b] = 0  # padding tokens: row B, stored nowhere, attending over block 0
        self.positions[T:t_b] = 0
        self.slot_mapping[T:t_b] = -1
        self.query_start_loc[:B + 1].copy_(inputs.query_start_loc)
        self.query_start_loc[B + 1:rows + 1] = t_b  # row B ends at t_b; rows past it hold no token
        self.seq_lens[:B].copy_(inputs.seq_lens)
        self.seq_lens[B:B + 1] = t_b - T  # the padding row's keys: its own positions, all in block 0's rows
        # (a slice is filled on the device; seq_lens[B] = x would copy a host scalar and wait for the stream)
        self.seq_lens[B + 1:rows] = 0
        # entries past a table's end may be stale: never read (only positions < seq_len are)
        self.block_tables[:B, :width].copy_(inputs.block_tables)
        self.block_tables[B:rows] = 0
        self.logits_indices[:S].copy_(inputs.logits_indices)
        self.logits_indices[S:self.samples_of(t_b)] = 0
        kernel = self.kernel_for(t_b, inputs)
        if not self.capture:
            self._forward(t_b, kernel)
        else:
            key = self._key(t_b, kernel)
            if key not in self.graphs:
                self.graphs[key] = self._capture(t_b, kernel)
            self.graphs[key].replay()
        return self.logits[:S]

    def capture_all(self) -> None:
        """Record every bucket on padding only (no token stored, every row reads block 0)."""
        for t_b in reversed(self.buckets):
            rows = self.rows_of(t_b)
            self.slot_mapping.fill_(-1)
            self.query_start_loc[:rows + 1] = t_b
            self.query_start_loc[0] = 0
            self.seq_lens[:rows] = 0
            self.seq_lens[0] = t_b
            self.block_tables.zero_()
            for kernel in self.kernels_of(t_b):
                if self._key(t_b, kernel) not in self.graphs:
                    self.graphs[self._key(t_b, kernel)] = self._capture(t_b, kernel)

    def _capture(self, t_b: int, kernel: str | None = None) -> torch.cuda.CUDAGraph:
        return capture_graph(lambda: self._forward(t_b, kernel), self.device, self.memory_pool)
