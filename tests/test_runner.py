"""ModelRunner.prepare: one set of batch tensors for every backend, and the rung-4 slot-mapping seam."""
from __future__ import annotations

import pytest
import torch

from minikv.attention.metadata import ContiguousMetadata, PagedMetadata
from minikv.cache.blocks.block_table import slot_mapping
from minikv.engine.batch import ScheduledBatch
from minikv.engine.runner import ModelRunner
from minikv.engine.sampling_params import SamplingParams
from minikv.engine.sequence import Sequence

BLOCK_SIZE = 4


def paged_batch() -> ScheduledBatch:
    """A prefill of 5 (two blocks), a decode at position 9 (three blocks), a chunk [4, 7) of a longer prompt."""
    batch = ScheduledBatch()
    for ids, table, start, n in ((list(range(10, 15)), [7, 2], 0, 5), (list(range(20, 30)), [3, 0, 5], 9, 1),
                                 (list(range(40, 52)), [6, 1, 4], 4, 3)):
        seq = Sequence(ids, SamplingParams())
        seq.block_table = table
        batch.add(seq, start, n)
    return batch


def test_prepare_builds_one_flattened_batch_with_tables_padded_by_minus_one():
    runner = ModelRunner(None, None, "cpu", BLOCK_SIZE)
    inputs, sample_rows = runner.prepare(paged_batch())
    assert inputs.input_ids.tolist() == [10, 11, 12, 13, 14, 29, 44, 45, 46]
    assert inputs.positions.tolist() == [0, 1, 2, 3, 4, 9, 4, 5, 6]
    assert inputs.query_start_loc.tolist() == [0, 5, 6, 9] and inputs.query_lens_list == [5, 1, 3]
    assert inputs.seq_lens.tolist() == inputs.seq_lens_list == [5, 10, 7] and inputs.max_seq_len == 10
    assert inputs.block_tables.tolist() == [[7, 2, -1], [3, 0, 5], [6, 1, 4]]
    assert sample_rows == [0, 1] and inputs.logits_indices.tolist() == [4, 5]  # the chunk samples nothing yet
    assert inputs.cache_rows is None


def test_the_vectorized_slot_mapping_is_the_formula_of_cache_block_table():
    batch = paged_batch()
    inputs, _ = ModelRunner(None, None, "cpu", BLOCK_SIZE).prepare(batch)
    want = [s for seq, start, n in zip(batch.seqs, batch.starts, batch.num_new_tokens)
            for s in slot_mapping(seq.block_table, list(range(start, start + n)), BLOCK_SIZE)]
    assert inputs.slot_mapping.tolist() == want


def test_a_slot_mapping_function_is_called_per_sequence_and_its_slots_are_used():
    calls = []

    def reversed_mapping(block_table, positions, block_size):
        calls.append((block_table, positions, block_size))
        return slot_mapping(block_table, positions, block_size)[::-1]

    batch = paged_batch()
    inputs, _ = ModelRunner(None, None, "cpu", BLOCK_SIZE, slot_mapping=reversed_mapping).prepare(batch)
    assert calls == [([7, 2], [0, 1, 2, 3, 4], 4), ([3, 0, 5], [9], 4), ([6, 1, 4], [4, 5, 6], 4)]
    assert inputs.slot_mapping.tolist() == [8, 31, 30, 29, 28] + [21] + [6, 5, 4]

    runner = ModelRunner(None, None, "cpu", BLOCK_SIZE, slot_mapping=lambda t, ps, bs: [0])
    with pytest.raises(ValueError, match="returned 1 slots for 5 positions"):
        runner.prepare(batch)


def test_a_block_table_shorter_than_its_positions_is_named():
    batch = paged_batch()
    batch.seqs[1].block_table = [3, 0]  # position 9 needs a third block
    with pytest.raises(RuntimeError, match="runs positions up to 9 but its block table holds 2 blocks"):
        ModelRunner(None, None, "cpu", BLOCK_SIZE).prepare(batch)


def test_each_backend_builds_its_own_metadata_from_the_same_inputs():
    from minikv.attention.contiguous import ContiguousBackend
    from minikv.attention.paged import PagedBackend
    from minikv.cache.blocks.pool import KVPool, RowPool

    inputs, _ = ModelRunner(None, None, "cpu", BLOCK_SIZE).prepare(paged_batch())
    meta = PagedBackend(KVPool(1, 8, BLOCK_SIZE, 1, 2, torch.float32, "cpu")).prepare_metadata(inputs)
    assert type(meta) is PagedMetadata and meta.slot_mapping is inputs.slot_mapping
    assert meta.token_seq.tolist() == [0] * 5 + [1] + [2] * 3
    assert meta.token_qpos.tolist() == [0, 1, 2, 3, 4, 0, 0, 1, 2]
    assert meta.token_pos is inputs.positions and not hasattr(meta, "cache_rows")

    batch = ScheduledBatch()
    for row, (ids, start) in enumerate(((list(range(6)), 0), (list(range(8)), 7))):
        seq = Sequence(ids, SamplingParams())
        seq.cache_row = 1 - row
        batch.add(seq, start, len(ids) - start)
    inputs, _ = ModelRunner(None, None, "cpu").prepare(batch)
    assert inputs.cache_rows.tolist() == [1, 0] and inputs.block_tables is None and inputs.slot_mapping is None
    meta = ContiguousBackend(RowPool(1, 2, 8, 1, 2, torch.float32, "cpu")).prepare_metadata(inputs)
    assert type(meta) is ContiguousMetadata and meta.cache_rows.tolist() == [1, 0]
    assert not hasattr(meta, "block_tables")
