"""Decode steps replayed from CUDA graphs: the whole model's launches for one step, issued at once.

A decode step of a small model is launch-bound: Qwen2.5-0.5B runs dozens of kernels in each of
its 24 layers (norms, projections, rotary embedding, KV store, attention, MLP), each launched from
Python for a few microseconds of GPU work. A CUDA graph records those
launches once (for one batch size) and replays them with a single call. A graph replays the same
kernels on the same addresses, so everything a step changes lives in static buffers that each step
overwrites in place:

    static buffers (max_num_seqs rows)      a step with n = 5 sequences runs the graph of bucket 8
    input_ids    [t0 t1 t2 t3 t4 | 0  0  0 ]      rows [n, 8) are padding:
    positions    [p0 p1 p2 p3 p4 | 0  0  0 ]        slot -1      (the KV store skips it)
    slot_mapping [s0 s1 s2 s3 s4 |-1 -1 -1 ]        seq_len 1    (attends to one key of a valid block)
    seq_lens     [l0 l1 l2 l3 l4 | 1  1  1 ]        their logits are dropped
    block_tables [n rows | padding rows: valid block ids, 0 or stale]  x ceil(max_model_len / block_size)

Batch sizes are bucketed (1, 2, 4, 8, then steps of 16 up to max_num_seqs, as nano-vllm does) and
every bucket is captured when the engine starts, largest first, so that all share one memory pool
sized by the largest. What a graph freezes, and so what must stay fixed:
- the host values the kernels are launched with. The decode kernel's split count and split length
  are cut from max_model_len, not from this step's longest context: any length is still correct
  (the last split reads whatever lies past the others), short contexts just leave splits empty.
- tensor addresses: the pool, the weights and these buffers are allocated once, before capture.
Prefill and mixed steps (different shapes every step) stay eager.
"""
from __future__ import annotations

import torch

from minikv.attention.metadata import AttentionMetadata


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
        self.input_ids = torch.zeros(n, **long)
        self.positions = torch.zeros(n, **long)
        self.slot_mapping = torch.full((n,), -1, **long)
        self.seq_lens = torch.ones(n, **long)
        self.block_tables = torch.zeros(n, width, **long)  # block 0: a valid block for padding rows to read
        self.logits = torch.zeros(n, vocab_size, dtype=torch.float32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None  # one memory pool for every bucket

    def bucket(self, n: int) -> int | None:
        """The smallest captured batch size that holds n sequences (None: too many, run eagerly)."""
        return next((b for b in self.buckets if b >= n), None)

    def _metadata(self, bs: int) -> AttentionMetadata:
        """Metadata over the static buffers' first bs rows. Host-side lengths say max_model_len, so the
        decode kernel's split ranges are cut from the longest context a sequence may reach."""
        rows = torch.arange(bs + 1, dtype=torch.long, device=self.device)
        return AttentionMetadata(
            query_start_loc=rows, seq_lens=self.seq_lens[:bs], query_lens_list=[1] * bs,
            seq_lens_list=[self.max_model_len] * bs, slot_mapping=self.slot_mapping[:bs],
            block_tables=self.block_tables[:bs], token_seq=rows[:bs], token_qpos=torch.zeros_like(rows[:bs]),
            token_pos=self.positions[:bs])

    def _forward(self, bs: int) -> None:
        meta = self._metadata(bs)
        self.logits[:bs] = self.model(self.input_ids[:bs], self.positions[:bs], meta, self.backend)

    def run(self, input_ids: list[int], positions: list[int], slot_mapping: list[int],
            block_tables: list[list[int]]) -> torch.Tensor:
        """One decode step of n = len(input_ids) sequences: returns their logits [n, vocab] (a view of the
        static buffer, valid until the next step)."""
        n = len(input_ids)
        bs = self.bucket(n)
        if bs is None:
            raise ValueError(f"{n} sequences exceed the largest captured batch ({self.buckets[-1]})")
        width = max(len(t) for t in block_tables)
        if width > self.block_tables.shape[1]:
            raise ValueError(f"a block table of {width} blocks exceeds max_model_len {self.max_model_len} "
                             f"({self.block_tables.shape[1]} blocks of {self.block_size})")
        host = torch.tensor([input_ids, positions, slot_mapping], dtype=torch.long)
        self.input_ids[:n].copy_(host[0], non_blocking=True)
        self.positions[:n].copy_(host[1], non_blocking=True)
        self.slot_mapping[:n].copy_(host[2], non_blocking=True)
        self.seq_lens[:n].copy_(host[1] + 1, non_blocking=True)  # the new token's position + 1
        # entries past a sequence's length may be stale: they are never read (only positions < seq_len are)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.long)
        self.block_tables[:n, :width].copy_(tables, non_blocking=True)
        self.slot_mapping[n:bs] = -1  # padding rows: nothing stored, one key read from a valid block
        self.seq_lens[n:bs] = 1
        self.block_tables[n:bs, 0] = 0
        if not self.capture:
            self._forward(bs)
        else:
            if bs not in self.graphs:
                self.graphs[bs] = self._capture(bs)
            self.graphs[bs].replay()
        return self.logits[:n]

    def capture_all(self) -> None:
        """Record every bucket on padding rows only (nothing is stored, every row reads block 0)."""
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
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
        with torch.cuda.graph(graph, pool=self.pool):
            self._forward(bs)
        return graph
