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
Prefill and mixed steps (different shapes every step) stay eager.
"""
from __future__ import annotations

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
        self.logits[:bs] = self.model(inputs.input_ids, inputs.positions, meta, self.backend)

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
        """Record bucket bs. The warm-up run (it compiles the Triton kernels and sets up cuBLAS) computes
        the step the buffers hold, so any K/V it stores are the ones a replay stores again."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(bs)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory_pool):
            self._forward(bs)
        return graph
