"""The host's work per decode step: what is skipped when nothing changed, and proof it changes nothing.

- BlockTableRows (minikv/cache/blocks/table_rows.py) keeps the batch's block tables as an array and
  writes a row again only when its table changed: under a random trace of every kind of table edit
  it equals the table rebuilt from the lists, and unchanged tables are not written.
- The scheduler's decode fast path (a token written into a block its sequence holds alone) skips
  the grow / copy-on-write checks: two schedulers, one forced through the full checks, make the same
  batches, block tables, copies and preemptions on random traces with forks, swaps and windows.
- In an engine, the tables the model reads equal the sequences' own through preemption, forks,
  prefix hits and beams.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minikv import LLM, SamplingParams
from minikv.cache.block_manager import BlockManager, copy_on_write_rule
from minikv.cache.blocks.pool import KVPool
from minikv.cache.blocks.swap import SwapSpace
from minikv.cache.blocks.table_rows import BlockTableRows
from minikv.cache.blocks.window import NO_BLOCK
from minikv.engine.scheduler import Scheduler
from minikv.engine.sequence import Sequence, SequenceStatus

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (tests/conftest.py)


def rebuilt(tables: list[list[int]]) -> np.ndarray:
    """The padded array built from scratch: what BlockTableRows must equal."""
    width = max((len(t) for t in tables), default=0)
    out = np.full((len(tables), width), NO_BLOCK, dtype=np.int64)
    for i, t in enumerate(tables):
        out[i, :len(t)] = t
    return out


class Table:
    def __init__(self, block_table):
        self.block_table = block_table


EDITS = st.lists(st.tuples(st.sampled_from(["append", "replace", "hole", "truncate", "assign", "new", "skip"]),
                           st.integers(0, 7), st.integers(0, 999)), max_size=120)


@settings(max_examples=150, deadline=None)
@given(edits=EDITS, start=st.lists(st.lists(st.integers(0, 999), max_size=6), min_size=1, max_size=6))
def test_table_rows_equal_the_rebuilt_tables_under_any_edits(edits, start):
    seqs = [Table(list(t)) for t in start]
    rows = BlockTableRows(num_rows=2, width=2)  # small: rows and width grow during the trace
    skipped: set[int] = set()
    for kind, which, value in edits:
        seq = seqs[which % len(seqs)]
        table = seq.block_table
        if kind == "append":
            table.append(value)
        elif kind == "replace" and table:  # copy-on-write, a prefix hit adopted
            table[value % len(table)] = value
        elif kind == "hole" and table:  # a sliding window gave a block back
            table[value % len(table)] = NO_BLOCK
        elif kind == "truncate":  # a speculative rollback, a trim
            del table[value % (len(table) + 1):]
        elif kind == "assign":  # freed, forked, acquired a prefix: a new list
            seq.block_table = [value] * (value % 5)
        elif kind == "new":  # a sequence leaves, another arrives (it may get the old one's id)
            seqs[which % len(seqs)] = Table([value])
        elif kind == "skip":  # does not run this step
            skipped.symmetric_difference_update({which % len(seqs)})
        batch = [s for i, s in enumerate(seqs) if i not in skipped] or seqs
        got = rows.gather(batch)
        np.testing.assert_array_equal(got, rebuilt([s.block_table for s in batch]))


def test_table_rows_write_only_the_tables_that_changed():
    seqs = [Table(list(range(10 * i, 10 * i + 5))) for i in range(8)]
    rows = BlockTableRows()
    rows.gather(seqs)
    assert rows.num_writes == 8
    for _ in range(5):  # a decode step in which no sequence gains a block
        rows.gather(seqs)
    assert rows.num_writes == 8
    seqs[3].block_table.append(99)
    seqs[5].block_table[0] = 77  # copy-on-write of a shared block
    np.testing.assert_array_equal(rows.gather(seqs), rebuilt([s.block_table for s in seqs]))
    assert rows.num_writes == 10


# ---- the scheduler's decode fast path ------------------------------------------------------------
def full_checks_rule(*args):
    """copy_on_write_rule under another name: a rule of one's own turns the decode fast path off."""
    return copy_on_write_rule(*args)


def scheduler(fast: bool, mode: str, window, num_blocks: int, max_seqs: int, budget: int) -> Scheduler:
    bs = 4
    bm = BlockManager(num_blocks, bs, copy_on_write=None if fast else full_checks_rule,
                      **(dict(sliding_window=window[0], sink_tokens=window[1]) if window else {}))
    swap = SwapSpace(KVPool(1, num_blocks, bs, 1, 2, torch.float32, "cpu"), 16) if mode == "swap" else None
    return Scheduler(bm, max_seqs, budget, True, mode, swap)


def state(sch: Scheduler, batch) -> tuple:
    name = lambda seqs: [s.request_id for s in seqs]  # noqa: E731
    return (name(batch.seqs), batch.starts, batch.num_new_tokens, name(batch.preempted), batch.blocks_to_copy,
            [(s.request_id, s.status, s.num_computed_tokens, list(s.block_table)) for s in sch.all_sequences()],
            list(sch.bm.ref_count), sch.bm.peak_used_blocks, sch.bm.peak_refs, sch.bm.num_cow_copies)


OPS = st.lists(st.tuples(st.sampled_from(["arrive", "step", "step", "step", "fork", "fork", "abort"]),
                         st.integers(1, 14), st.integers(1, 12), st.integers(0, 2)), min_size=1, max_size=60)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, mode=st.sampled_from(["recompute", "swap"]), window=st.sampled_from([None, None, (6, 1)]),
       num_blocks=st.integers(8, 32), max_seqs=st.integers(2, 8), budget=st.integers(1, 24))
def test_decode_fast_path_schedules_what_the_full_checks_schedule(ops, mode, window, num_blocks, max_seqs, budget):
    pair = [scheduler(True, mode, window, num_blocks, max_seqs, budget),
            scheduler(False, mode, window, num_blocks, max_seqs, budget)]
    seqs: list[list[Sequence]] = [[], []]
    forks = 0
    for op, a, b, c in ops:
        results = []
        for sch, mine in zip(pair, seqs):
            if op == "arrive":
                seq = Sequence(list(range(a)), SamplingParams(max_tokens=b, priority=c), request_id=f"r{len(mine)}")
                mine.append(seq)
                sch.add(seq)
            elif op == "fork":  # a running sequence's sample shares its blocks (copy-on-write on the next write)
                parents = [s for s in sch.running if s.block_table]
                if parents:
                    parent = parents[a % len(parents)]
                    child = Sequence(parent.prompt_token_ids, parent.params, request_id=f"f{forks}")
                    child.output_token_ids = list(parent.output_token_ids)
                    mine.append(child)
                    sch.fork(parent, child, parent.num_computed_tokens)
            elif op == "abort":
                live = [s for s in mine if not s.is_finished]
                if live:
                    seq = live[a % len(live)]
                    seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
                    sch.abort(seq)
            else:
                batch = sch.schedule()
                results.append(state(sch, batch))
                for seq, start, n in zip(batch.seqs, batch.starts, batch.num_new_tokens):
                    if start + n == seq.num_tokens:  # sampled: one more token
                        seq.output_token_ids.append(5)
                        if len(seq.output_token_ids) >= seq.params.max_tokens:
                            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "length"
                sch.update(batch)
        forks += op == "fork"
        if results:
            assert results[0] == results[1]
    for sch, mine in zip(pair, seqs):
        sch.bm.check([s for s in mine if not s.is_finished])


def test_a_steady_decode_step_checks_no_sequence_for_blocks():
    """Work counted, not timed: decode steps whose tokens land in blocks already held never ask the block
    manager whether a sequence can grow; only the steps that cross into a new block do."""
    llm = LLM("tiny-random", kv_backend="paged", block_size=16, num_blocks=256, max_num_seqs=16)
    bm = llm.block_manager
    calls = []
    can_grow = bm.can_grow
    bm.can_grow = lambda seq, n: calls.append(seq) or can_grow(seq, n)
    params = SamplingParams(max_tokens=33, ignore_eos=True)
    for i in range(16):
        llm.add_request([3 + i] * 16, params)  # 16 prompt tokens: one full block each
    llm.step()  # the prefills
    calls.clear()
    for _ in range(32):
        llm.step()
    # 32 decode steps of 16 sequences: 512 decodes, of which 2 per sequence need a new block
    assert len(calls) == 2 * 16


# ---- in an engine ------------------------------------------------------------------------------------
@pytest.mark.parametrize("options", [
    dict(num_blocks=24),  # preemption (recompute)
    dict(num_blocks=24, preemption="swap", swap_blocks=64),
    dict(num_blocks=64, prefix_caching="hash"),
    dict(num_blocks=48, async_scheduling=True),
])
def test_the_model_reads_each_sequences_own_block_table(options):
    llm = LLM("tiny-random", kv_backend="paged", block_size=4, max_num_seqs=6, max_num_batched_tokens=32, **options)
    runner, checked = llm.runner, []
    prepare_step = runner.prepare_step

    def checked_prepare(batch, fed=None):
        prepared = prepare_step(batch, fed)
        np.testing.assert_array_equal(prepared.inputs.block_tables.numpy(),
                                      rebuilt([s.block_table for s in batch.seqs]))
        checked.append(len(batch))
        return prepared

    runner.prepare_step = checked_prepare
    shared = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    prompts = [shared + [20 + i] * (3 + 2 * i) for i in range(6)]
    params = [SamplingParams(max_tokens=14, ignore_eos=True, n=2 if i % 3 == 0 else 1, temperature=0.8, seed=i)
              for i in range(6)]
    llm.generate(prompts, params)
    llm.generate(prompts[:2], SamplingParams(max_tokens=6, ignore_eos=True))  # prefix hits on the second round
    assert len(checked) > 10
    if options["num_blocks"] == 24:
        assert llm.stats()["num_preemptions"] > 0


def test_published_events_are_the_dataclass_built_the_usual_way():
    """The core builds its per-token events without the frozen dataclass's __init__: each must still be
    exactly EngineEvent(...) of its fields (equal, hashable, frozen, every field set, `replace` works)."""
    import dataclasses

    from minikv.engine.core import EngineEvent

    llm = LLM("tiny-random", kv_backend="paged", block_size=4, num_blocks=64)
    core = llm.core
    for p in ([5, 6, 7], [8, 9]):
        llm.add_request(p, SamplingParams(max_tokens=3, ignore_eos=True))
    events = []
    while llm.has_unfinished():
        core.run_step()
        events += core.take_events()
    names = [f.name for f in dataclasses.fields(EngineEvent)]
    assert len(events) == 6 and events[-1].usage is not None
    for e in events:
        usual = EngineEvent(**{n: getattr(e, n) for n in names})
        assert e == usual and hash(e) == hash(usual) and repr(e) == repr(usual)
        assert sorted(vars(e)) == sorted(names)
        assert dataclasses.replace(e, text_delta="x").text_delta == "x"
        with pytest.raises(dataclasses.FrozenInstanceError):
            e.token_id = 0


@settings(max_examples=100, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(1, 20), st.integers(0, 12), st.data()), min_size=1, max_size=8))
def test_prepare_step_builds_the_plain_batch(rows):
    """prepare_step's arrays (numpy, slices without token_ids) equal the batch built the plain way."""
    from minikv.engine.batch import ScheduledBatch
    from minikv.engine.runner import ModelRunner

    bs = 4
    runner = ModelRunner(None, None, "cpu", block_size=bs)
    batch, next_block = ScheduledBatch(), 0
    for prompt_len, out_len, data in rows:
        seq = Sequence([(7 * prompt_len + j) % 50 for j in range(prompt_len)], SamplingParams())
        seq.output_token_ids = [100 + j for j in range(out_len)]
        total = seq.num_tokens
        start = data.draw(st.integers(0, total - 1))
        n = data.draw(st.integers(1, total - start))
        seq.block_table = list(range(next_block, next_block + -(-total // bs)))
        next_block += len(seq.block_table)
        batch.add(seq, start, n)
    inputs = runner.prepare_step(batch).inputs
    ids = [t for s, st_, n in zip(batch.seqs, batch.starts, batch.num_new_tokens) for t in s.token_ids[st_:st_ + n]]
    pos = [p for st_, n in zip(batch.starts, batch.num_new_tokens) for p in range(st_, st_ + n)]
    seq_of = [i for i, n in enumerate(batch.num_new_tokens) for _ in range(n)]
    slots = [batch.seqs[b].block_table[p // bs] * bs + p % bs for b, p in zip(seq_of, pos)]
    ends = [st_ + n for st_, n in zip(batch.starts, batch.num_new_tokens)]
    last = np.cumsum(batch.num_new_tokens) - 1
    assert inputs.input_ids.tolist() == ids and inputs.positions.tolist() == pos
    assert inputs.slot_mapping.tolist() == slots and inputs.seq_lens.tolist() == ends == inputs.seq_lens_list
    assert inputs.logits_indices.tolist() == [int(last[i]) for i, s in enumerate(batch.seqs) if ends[i] == s.num_tokens]
