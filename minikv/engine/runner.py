"""Turn a scheduled batch into ONE flattened model call and return the logits to sample from.

    seq A prefill (5 tokens) + seq B decode (1) + seq C chunk (3):
    input_ids    [a0 a1 a2 a3 a4 | b7 | c0 c1 c2]
    positions    [ 0  1  2  3  4 |  7 |  0  1  2]
    slot_mapping [physical slot of each token]          (paged)
    logits for A and B only: C's chunk does not reach the end of its prompt, nothing to sample yet

On a GPU, a step that only decodes (one token per sequence) is instead copied into static buffers
and replayed from a CUDA graph (minikv/engine/cuda_graph.py).
"""
from __future__ import annotations

import torch

from minikv.attention.metadata import AttentionMetadata
from minikv.engine.simple_scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model, backend, device, block_size: int | None = None, decode_graphs=None):
        self.model = model
        self.backend = backend
        self.device = torch.device(device)
        self.block_size = block_size
        self.decode_graphs = decode_graphs  # a DecodeGraphs: decode-only steps replayed from CUDA graphs

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        ids, pos, query_lens, seq_lens, sample_rows = [], [], [], [], []
        for i, (seq, start, n) in enumerate(zip(batch.seqs, batch.starts, batch.num_new_tokens)):
            end = start + n
            ids += seq.token_ids[start:end]
            pos += range(start, end)
            query_lens.append(n)
            seq_lens.append(end)
            if end == seq.num_tokens:  # every known token computed: the next one can be sampled
                sample_rows.append(i)
        extra = {}
        if self.backend.name == "contiguous":
            extra["cache_rows"] = self._long([s.cache_row for s in batch.seqs])
        elif self.block_size is not None:  # paged layouts
            extra["slot_mapping"] = self._long(self.slot_mapping(batch))
            width = max(len(s.block_table) for s in batch.seqs)
            extra["block_tables"] = self._long([s.block_table + [-1] * (width - len(s.block_table)) for s in batch.seqs])
        meta = AttentionMetadata.build(query_lens, seq_lens, self.device, **extra)
        return self._long(ids), self._long(pos), meta, sample_rows

    def slot_mapping(self, batch: ScheduledBatch) -> list[int]:
        """Physical slot of every new token: block_table[pos // block_size] * block_size + pos % block_size."""
        bs, slots = self.block_size, []
        for seq, start, n in zip(batch.seqs, batch.starts, batch.num_new_tokens):
            slots += [seq.block_table[p // bs] * bs + p % bs for p in range(start, start + n)]
        return slots

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        """Returns (logits [len(sample_rows), vocab] float32, sample_rows)."""
        if batch.blocks_to_copy:  # copy-on-write: private copies of shared blocks this step writes into
            self.backend.copy_blocks(batch.blocks_to_copy)
        if self.decode_graphs is not None and self.is_plain_decode(batch):
            seqs = batch.seqs
            logits = self.decode_graphs.run([s.token_ids[start] for s, start in zip(seqs, batch.starts)],
                                            list(batch.starts), self.slot_mapping(batch), [s.block_table for s in seqs])
            return logits, list(range(len(seqs)))
        input_ids, positions, meta, sample_rows = self.prepare(batch)
        last = (meta.query_start_loc[1:] - 1)[sample_rows]  # last new token of each sampling sequence
        logits = self.model(input_ids, positions, meta, self.backend, logits_indices=last)
        return logits, sample_rows

    def is_plain_decode(self, batch: ScheduledBatch) -> bool:
        """One new token per sequence, each its last known token (so every row samples), few enough
        sequences for the largest graph, block tables that fit its static buffer, and the backend the
        graphs recorded (a backend swapped in, as the exercise checkers do, runs eagerly)."""
        graphs = self.decode_graphs
        return (self.backend is graphs.backend and len(batch.seqs) <= graphs.buckets[-1]
                and all(n == 1 and start + 1 == seq.num_tokens and len(seq.block_table) <= graphs.max_blocks
                        for seq, start, n in zip(batch.seqs, batch.starts, batch.num_new_tokens)))

    def _long(self, xs) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.long, device=self.device)
