"""Turn a scheduled batch into ONE flattened model call and return the logits to sample from.

    seq A prefill (5 tokens) + seq B decode (1) + seq C chunk (3):
    input_ids       [a0 a1 a2 a3 a4 | b7 | c0 c1 c2]
    positions       [ 0  1  2  3  4 |  7 |  0  1  2]
    query_start_loc [0, 5, 6, 9]        seq_lens [5, 8, 3]
    block_tables    one row per sequence, -1 past its table                       (paged)
    slot_mapping    [physical slot of each token]                                 (paged)
    cache_rows      [the row each sequence owns]                                  (contiguous)
    logits for A and B only: C's chunk does not reach the end of its prompt, nothing to sample yet

`prepare` builds these tensors once (`BatchInputs`); the backend builds its own metadata from them.
The block tables come from `BlockTableRows` (minikv/cache/blocks/table_rows.py), which keeps them as
an array between steps and writes again only the tables that changed.
A step that only decodes (one token per sequence, every one sampled) goes instead through the CUDA
graphs when the engine has them (minikv/engine/cuda_graph.py), which copy the same tensors into
their static buffers and replay; so does a small prefill or mixed step (up to cuda_graph_max_tokens).

`run` = `prepare_step` + `forward`. The engine's overlapped step (minikv/engine/overlap.py) calls
them apart: it prepares step t+1 while the device still runs step t, whose sampled tokens are not
on the host yet. Those rows are "fed": their input id is a placeholder on the host, and `forward`
writes the real one from step t's sampled-ids tensor on the device before the model runs,

    fed = [(batch row i, row j of step t's samples), ...]   ->   input_ids[query_start_loc[i]] = sampled[j]

which is correct by stream order: step t's sampling kernels come before this copy on the same stream.
"""
from __future__ import annotations

from itertools import chain
from typing import Callable, NamedTuple

import numpy as np
import torch

from minikv.attention.metadata import BatchInputs
from minikv.cache.blocks.table_rows import BlockTableRows
from minikv.engine.batch import ScheduledBatch

# the rung-4 seam: fn(block_table, positions, block_size) -> the slot of each position
SlotMappingFn = Callable[[list[int], list[int], int], list[int]]


def _long(xs: list[int]) -> np.ndarray:
    """A Python list of ints as an int64 array (numpy: far faster than torch.tensor on a list)."""
    return np.fromiter(xs, dtype=np.int64, count=len(xs))


def _token_at(seq, position: int) -> int:
    """seq.token_ids[position] without building token_ids (a new list of the whole sequence)."""
    prompt = seq.prompt_token_ids
    return prompt[position] if position < len(prompt) else seq.output_token_ids[position - len(prompt)]


def _tokens(seq, start: int, end: int) -> list[int]:
    """seq.token_ids[start:end] without building token_ids (a decode row beside a prefill costs O(1))."""
    prompt, p = seq.prompt_token_ids, len(seq.prompt_token_ids)
    if start >= p:
        return seq.output_token_ids[start - p:end - p]
    return prompt[start:end] if end <= p else prompt[start:] + seq.output_token_ids[:end - p]


class PreparedStep(NamedTuple):
    """A step's inputs on the device, the batch rows that sample, and where fed ids go (see the top)."""

    inputs: BatchInputs
    sample_rows: list[int]
    fed_dst: torch.Tensor | None = None  # [F] token index in input_ids of each fed row
    fed_src: torch.Tensor | None = None  # [F] its row in the previous step's sampled ids


class ModelRunner:
    def __init__(self, model, backend, device, block_size: int | None = None, decode_graphs=None,
                 slot_mapping: SlotMappingFn | None = None, pool=None, step_graphs=None):
        """block_size: the paged pool's (None: not paged). slot_mapping: a per-sequence function
        (minikv/cache/blocks/block_table.py `slot_mapping` is the formula); None = the vectorized one here.
        pool: the paged KV pool (copy-on-write copies run in it), lent by the engine that owns it."""
        self.model = model
        self.backend = backend
        self.pool = pool
        self.device = torch.device(device)
        self.block_size = block_size
        self.decode_graphs = decode_graphs  # a DecodeGraphs: decode-only steps replayed from CUDA graphs
        self.step_graphs = step_graphs  # a StepGraphs: small prefill and mixed steps replayed from CUDA graphs
        self.slot_mapping_fn = slot_mapping
        self._staging = [torch.empty(0, dtype=torch.long)] * 2  # pinned host buffers, used in turn (GPU)
        self._turn = 0
        self.table_rows = BlockTableRows()  # paged: the block tables kept as an array between steps

    def close(self) -> None:
        """The engine is closed: the CUDA graphs (their buffers and memory pool), staging buffers and block-table
        rows go."""
        self.decode_graphs = self.step_graphs = None
        self._staging = [torch.empty(0, dtype=torch.long)] * 2
        self.table_rows = BlockTableRows()

    def prepare(self, batch: ScheduledBatch) -> tuple[BatchInputs, list[int]]:
        """The step's tensors, and which sequences of the batch sample a token (rows of the logits)."""
        prepared = self.prepare_step(batch)
        return prepared.inputs, prepared.sample_rows

    def prepare_step(self, batch: ScheduledBatch, fed: list[tuple[int, int]] | None = None) -> PreparedStep:
        """`prepare`, with the rows fed from the previous step's sampled ids (see the top of the file).

        Host work on every step, so lists become tensors through numpy (torch.tensor on a Python list
        costs ~10x more), a decode-only step skips the per-sequence slicing, and everything reaches the
        device in one asynchronous copy: nothing here waits for the device."""
        seqs, starts, query_lens = batch.seqs, batch.starts, batch.num_new_tokens
        num_seqs = len(seqs)
        start, query_len = _long(starts), _long(query_lens)
        end = start + query_len  # seq_lens: each context after this step
        num_tokens = _long([len(s.prompt_token_ids) + len(s.output_token_ids) for s in seqs])
        samples = end == num_tokens  # a row samples when its step reaches the end of its tokens
        cu = np.zeros(num_seqs + 1, dtype=np.int64)  # query_start_loc
        np.cumsum(query_len, out=cu[1:])
        sample_rows, seq_lens = np.flatnonzero(samples).tolist(), end.tolist()
        if cu[-1] == num_seqs:  # decode only: one token per sequence, at position start (mostly the last)
            if len(sample_rows) == num_seqs:
                ids = [(s.output_token_ids or s.prompt_token_ids)[-1] for s in seqs]
            else:
                ids = [_token_at(s, st) for s, st in zip(seqs, starts)]
            pos = start
        else:
            ids = list(chain.from_iterable(_tokens(s, st, e) for s, st, e in zip(seqs, starts, seq_lens)))
            # token k of row b sits at position starts[b] + (k - cu[b])
            pos = np.arange(cu[-1], dtype=np.int64) + np.repeat(start - cu[:-1], query_len)
        host = {"input_ids": _long(ids), "positions": pos, "query_start_loc": cu, "seq_lens": end,
                "logits_indices": cu[1:][samples] - 1}
        if self.block_size is not None:  # paged: block tables padded with -1, only changed ones written again
            host["block_tables"] = self.table_rows.gather(seqs)
            host["slot_mapping"] = self._slot_mapping(batch, host)
        elif seqs[0].cache_row is not None:  # contiguous rows
            host["cache_rows"] = _long([s.cache_row for s in seqs])
        if fed:
            rows = _long([i for i, _ in fed])
            if (query_len[rows] != 1).any():
                i = int(rows[query_len[rows] != 1][0])
                raise ValueError(f"row {i} (request {seqs[i].request_id}) is fed from the previous step's "
                                 f"sampled ids but runs {query_lens[i]} tokens; only a decode row (1 token) "
                                 "can be fed")
            host["fed_dst"] = cu[rows]
            host["fed_src"] = _long([j for _, j in fed])
        on_device = self._to_device(host)
        fed_dst, fed_src = on_device.pop("fed_dst", None), on_device.pop("fed_src", None)
        inputs = BatchInputs(**on_device, query_lens_list=list(query_lens), seq_lens_list=seq_lens,
                             max_seq_len=int(end.max()))
        return PreparedStep(inputs, sample_rows, fed_dst, fed_src)

    def _slot_mapping(self, batch: ScheduledBatch, host: dict[str, np.ndarray]) -> np.ndarray:
        """Physical slot of every new token: block_table[pos // block_size] * block_size + pos % block_size."""
        bs = self.block_size
        if self.slot_mapping_fn is None:  # vectorized over the whole batch
            pos, lens = host["positions"], np.diff(host["query_start_loc"])
            if len(pos) == len(batch.seqs):  # one token per sequence
                seq = np.arange(len(batch.seqs))
            else:
                seq = np.repeat(np.arange(len(batch.seqs)), lens)
            slots = host["block_tables"][seq, pos // bs] * bs + pos % bs
            if (slots < 0).any():  # a -1 past the end of a table: the block manager gave too few blocks
                b = int(seq[slots < 0][0])
                last = batch.starts[b] + batch.num_new_tokens[b] - 1
                raise RuntimeError(f"request {batch.seqs[b].request_id} runs positions up to {last} but its block "
                                   f"table holds {len(batch.seqs[b].block_table)} blocks of {bs}; the block manager "
                                   "must allocate a block before a position in it runs")
            return slots
        slots = []
        for seq, start, n in zip(batch.seqs, batch.starts, batch.num_new_tokens):
            got = list(self.slot_mapping_fn(list(seq.block_table), list(range(start, start + n)), bs))
            if len(got) != n:
                raise ValueError(f"slot_mapping returned {len(got)} slots for {n} positions of request "
                                 f"{seq.request_id}; return one slot per position")
            slots += got
        return np.asarray(slots, dtype=np.int64)

    def _to_device(self, host: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Every int64 array of the step in ONE host-to-device copy (pinned on a GPU, so it does not
        wait), then seen as views. Each part starts on a 16-byte boundary, as kernels like it."""
        sizes = [a.size + a.size % 2 for a in host.values()]
        flat = self._staging_buffer(sum(sizes))
        staged, at = flat.numpy(), 0
        for a, size in zip(host.values(), sizes):
            staged[at:at + a.size] = a.ravel()
            at += size
        flat = flat.to(self.device, non_blocking=True)
        out, at = {}, 0
        for (name, a), size in zip(host.items(), sizes):
            out[name] = flat[at:at + a.size].view(a.shape)
            at += size
        return out

    def _staging_buffer(self, n: int) -> torch.Tensor:
        """n int64 of host memory to stage a step's inputs. On a GPU: pinned (an asynchronous copy), and
        allocated once, not every step (pinning memory costs far more than the copy). Two buffers are
        used in turn: a step's copy has long finished when its buffer comes round again. The engine
        waits for the sampled tokens of step t before it prepares step t + 2, even when it overlaps
        (it prepares step t + 1 while step t runs), and those tokens come after step t's copy."""
        if self.device.type != "cuda":
            return torch.empty(n, dtype=torch.long)
        self._turn = 1 - self._turn
        if self._staging[self._turn].numel() < n:
            size = max(n, 2 * self._staging[self._turn].numel(), 4096)
            self._staging[self._turn] = torch.empty(size, dtype=torch.long, pin_memory=True)
        return self._staging[self._turn][:n]

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        """Returns (logits [len(sample_rows), vocab] float32, sample_rows)."""
        prepared = self.prepare_step(batch)
        return self.forward(batch, prepared), prepared.sample_rows

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch, prepared: PreparedStep, fed_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Queue the prepared step on the device: the logits [len(sample_rows), vocab] float32 of its
        sampling rows. fed_ids: the previous step's sampled ids (a device tensor) for the fed rows."""
        if batch.blocks_to_copy:  # copy-on-write: private copies of shared blocks this step writes into
            self.pool.copy_blocks(batch.blocks_to_copy)
        inputs, sample_rows = prepared.inputs, prepared.sample_rows
        if prepared.fed_dst is not None:
            if fed_ids is None:
                raise ValueError("this step has rows fed from the previous step's sampled ids; pass them as fed_ids")
            inputs.input_ids.index_copy_(0, prepared.fed_dst, fed_ids.index_select(0, prepared.fed_src))
        graphs = self.decode_graphs
        if graphs is not None and len(sample_rows) == len(batch.seqs) and graphs.fits(inputs):
            return graphs.run(inputs)
        small = self.step_graphs
        if small is not None and small.fits(inputs) and getattr(self.backend, "prefill_impl", None) == "triton":
            return small.run(inputs)
        meta = self.backend.prepare_metadata(inputs)
        return self.model(inputs.input_ids, inputs.positions, meta, self.backend,
                          logits_indices=inputs.logits_indices)
