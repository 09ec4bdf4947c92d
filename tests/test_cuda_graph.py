"""Decode steps through CUDA graphs' static buffers (minikv.engine.cuda_graph).

A CPU cannot capture a graph, so there these tests run DecodeGraphs eagerly (capture=False) through the
same padded static buffers and the same metadata a captured step replays: bucketing, padding rows,
stale block-table entries and split ranges cut from max_model_len are all exercised. On a machine with
a GPU the same tests capture and replay real graphs (float32 there too, so tokens must be equal)."""
from __future__ import annotations

import pytest
import torch

from minikv.attention.metadata import BatchInputs
from minikv.engine.cuda_graph import DecodeGraphs, StepGraphs, batch_buckets, token_buckets
from minikv.engine.llm import LLM
from minikv.engine.sampling_params import SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CAPTURE = DEVICE == "cuda"


def test_buckets_cover_every_batch_size_up_to_max_num_seqs():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    graphs_like = DecodeGraphs.__new__(DecodeGraphs)
    graphs_like.buckets = batch_buckets(40)
    assert [graphs_like.bucket(n) for n in (1, 3, 5, 9, 17, 33, 40, 41)] == [1, 4, 8, 16, 32, 40, 40, None]


def _tiny_llm(**kw) -> LLM:
    kw.setdefault("cuda_graphs", False)  # the tests attach their own DecodeGraphs
    kw.setdefault("async_scheduling", False)  # the batch sizes below are the plain step's (no wasted rows)
    return LLM("tiny-random", device=DEVICE, dtype=torch.float32, kv_backend="paged", attention="triton",
               block_size=8, num_blocks=64, max_model_len=96, max_num_batched_tokens=32, **kw)


def _graphs(llm: LLM) -> DecodeGraphs:
    graphs = DecodeGraphs(llm.model, llm.backend, llm.device, llm.block_size, llm.scheduler.max_num_seqs,
                          llm.max_model_len, llm.config.vocab_size, capture=CAPTURE)
    calls = []
    run = graphs.run
    graphs.run = lambda inputs: calls.append(inputs.num_seqs) or run(inputs)  # count the steps that took this path
    graphs.calls = calls
    return graphs


def _decode_inputs(device, input_ids, positions, slot_mapping, block_tables) -> BatchInputs:
    """A decode step's inputs as the runner builds them (block tables padded with -1)."""
    long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    n, width = len(input_ids), max(len(t) for t in block_tables)
    return BatchInputs(input_ids=long(input_ids), positions=long(positions), query_start_loc=long(range(n + 1)),
                       seq_lens=long([p + 1 for p in positions]), query_lens_list=[1] * n,
                       seq_lens_list=[p + 1 for p in positions], max_seq_len=max(positions) + 1,
                       block_tables=long([t + [-1] * (width - len(t)) for t in block_tables]),
                       slot_mapping=long(slot_mapping))


@pytest.mark.slow  # over 6 s on a 2-core machine: make test runs it, make test-fast leaves it out
def test_padded_static_buffer_decode_generates_the_same_tokens_as_eager_steps():
    """Batches that shrink as requests finish (5, 4, 3, ... sequences in buckets 6, 4, 4, ...), context
    lengths from 2 to 30 crossing block edges, split ranges cut from max_model_len."""
    prompts = [list(range(10, 31)), [7], list(range(50, 59)), list(range(3, 19)), list(range(70, 75))]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (9, 12, 3, 6, 1)]
    plain = _tiny_llm(max_num_seqs=6)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    llm = _tiny_llm(max_num_seqs=6)
    llm.runner.decode_graphs = graphs = _graphs(llm)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert sorted(set(graphs.calls)) == [1, 2, 3, 4], graphs.calls  # decode steps of every size took the path
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_more_sequences_than_the_largest_bucket_run_eagerly():
    llm = _tiny_llm(max_num_seqs=4)
    llm.runner.decode_graphs = graphs = _graphs(llm)
    graphs.buckets = [1, 2]  # as if only small graphs existed
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (3, 5, 7)]  # 3, then 2, then 1 running
    want = [o.token_ids for o in _tiny_llm(max_num_seqs=4).generate(prompts, params)]
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert sorted(set(graphs.calls)) == [1, 2]  # the steps of 3 sequences went the eager way
    graphs.calls.clear()
    graphs.max_blocks = 0  # as if every table outgrew the static buffer: every step runs eagerly
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert graphs.calls == []


def test_padding_rows_store_nothing_and_real_rows_store_only_their_slot():
    llm = _tiny_llm(max_num_seqs=8)
    graphs = DecodeGraphs(llm.model, llm.backend, llm.device, llm.block_size, 8, llm.max_model_len,
                          llm.config.vocab_size, capture=CAPTURE)
    graphs.inputs.block_tables[:, :3] = 9  # stale entries from an earlier, larger batch
    pool = llm.backend.pool
    before = [(k.clone(), v.clone()) for k, v in zip(pool.k_cache, pool.v_cache)]
    bs = llm.block_size
    slots = [5 * bs + 2, 6 * bs, 7 * bs + 1]  # 3 sequences in bucket 4: one padding row
    logits = graphs.run(_decode_inputs(llm.device, [11, 12, 13], [bs + 2, 0, 1], slots, [[4, 5], [6], [7]]))
    assert logits.shape == (3, llm.config.vocab_size) and torch.isfinite(logits).all()
    static = graphs.inputs
    assert static.slot_mapping[3] == -1 and static.seq_lens[3] == 1 and static.block_tables[3, 0] == 0  # padding
    assert static.block_tables[:3, :2].tolist() == [[4, 5], [6, -1], [7, -1]]  # padded as the runner pads
    for (k0, v0), k1, v1 in zip(before, pool.k_cache, pool.v_cache):
        # [num_blocks, block_size, kv_heads, D] whatever the storage order: which (block, offset) changed
        changed = ((k1 != k0) | (v1 != v0)).flatten(2).any(-1)
        hit = sorted((b * bs + o) for b, o in changed.nonzero().tolist())
        assert hit == sorted(slots)


def test_bad_input_names_the_limit():
    llm = _tiny_llm(max_num_seqs=2)
    graphs = DecodeGraphs(llm.model, llm.backend, llm.device, llm.block_size, 2, llm.max_model_len,
                          llm.config.vocab_size, capture=CAPTURE)
    with pytest.raises(ValueError, match="largest captured batch"):
        graphs.run(_decode_inputs(llm.device, [1, 2, 3], [0, 0, 0], [0, 1, 2], [[0], [1], [2]]))
    with pytest.raises(ValueError, match="max_model_len 96"):
        graphs.run(_decode_inputs(llm.device, [1], [0], [0], [list(range(13))]))
    cpu = LLM("tiny-random", device="cpu", kv_backend="paged", block_size=8, num_blocks=16)
    with pytest.raises(ValueError, match="CUDA device"):
        DecodeGraphs(cpu.model, cpu.backend, cpu.device, cpu.block_size, 2, 96, cpu.config.vocab_size)
    with pytest.raises(ValueError, match="cuda_graphs"):
        LLM("tiny-random", device="cpu", kv_backend="paged", attention="triton", cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs"):
        LLM("tiny-random", device=DEVICE, kv_backend="paged", attention="torch", cuda_graphs=True)
    with pytest.raises(ValueError, match="True, False or None"):
        LLM("tiny-random", device="cpu", kv_backend="paged", cuda_graphs="yes")
    assert cpu.runner.decode_graphs is None  # off by default on a CPU


def _step_graphs(llm: LLM, max_tokens: int = 32) -> StepGraphs:
    logits = torch.zeros(llm.scheduler.max_num_seqs, llm.config.vocab_size, device=llm.device)
    graphs = StepGraphs(llm.model, llm.backend, llm.device, llm.block_size, llm.scheduler.max_num_seqs,
                        llm.max_model_len, logits, max_tokens, capture=CAPTURE)
    calls = []
    run = graphs.run
    graphs.run = lambda inputs: calls.append((inputs.input_ids.numel(), inputs.num_seqs)) or run(inputs)
    graphs.calls = calls
    return graphs


def test_token_buckets_double_from_16_to_1024_then_add_1024_up_to_the_limit_and_max_model_len():
    assert token_buckets(256, 4096) == [16, 32, 64, 128, 256]
    assert token_buckets(8192, 32768) == [16, 32, 64, 128, 256, 512, 1024, 2048, 3072, 4096, 5120, 6144, 7168, 8192]
    assert token_buckets(8192, 4000) == [16, 32, 64, 128, 256, 512, 1024, 2048, 3072]
    assert token_buckets(100, 4096) == [16, 32, 64]
    assert token_buckets(256, 40) == [16, 32]
    assert token_buckets(8, 4096) == []


@pytest.mark.slow  # over 6 s on a 2-core machine: make test runs it, make test-fast leaves it out
def test_small_prefill_and_mixed_steps_through_static_buffers_generate_the_same_tokens(monkeypatch):
    """Prefix hits (a short suffix over a cached prefix), chunked prompts and prompts beside decodes run
    through the padded step buffers: same tokens as eager steps, and every block comes back.

    The query-row kernel is chosen per step (query_rows_impl "auto"): with grouped_min_context lowered to
    this test's contexts, a hit of one sequence takes paged_query_rows_attention (the bucket's "grouped"
    graph) and a step of more sequences the decode kernel, the same tokens as the decode kernel alone
    (`want`: the default threshold, 4,096 keys, keeps every step here on the decode kernel)."""
    import minikv.attention.triton_backend as tb
    shared = list(range(20, 44))  # three blocks of 8: cached after the first request
    prompts = [shared + [5, 6, 7], shared + [9], list(range(50, 70)), [3, 4], shared + list(range(60, 71))]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (2, 2, 2, 3, 2)]
    want = [o.token_ids for o in _tiny_llm(max_num_seqs=4, prefix_caching="hash").generate(prompts, params)]
    llm = _tiny_llm(max_num_seqs=4, prefix_caching="hash")
    llm.backend.grouped_min_context = 24
    llm.runner.step_graphs = graphs = _step_graphs(llm)
    grouped, steps = [], []  # grouped kernel calls; (sequences, kernel chosen, grouped calls) of each step
    kernel, run, kernel_for = tb.paged_query_rows_attention, graphs.run, graphs.kernel_for
    monkeypatch.setattr(tb, "paged_query_rows_attention", lambda *a, **k: grouped.append(1) or kernel(*a, **k))

    def counted(inputs):
        before = len(grouped)
        out = run(inputs)
        steps.append((inputs.num_seqs, kernel_for(graphs.bucket(inputs.input_ids.numel()), inputs),
                      len(grouped) - before))
        return out
    graphs.run = counted
    assert [o.token_ids for o in llm.generate([prompts[0]], [params[0]])] == want[:1]  # fills the cache
    steps.clear()
    assert [o.token_ids for o in llm.generate([prompts[1]], [params[1]])] == want[1:2]
    assert steps[0][:2] == (1, "grouped"), steps  # the hit: 1 new token of one sequence over 25 keys
    if CAPTURE:  # a replayed graph calls no Python: the grouped kernel is in the bucket's "grouped" graph
        assert (16, "grouped") in graphs.graphs
    else:  # the kernel ran in every layer
        assert steps[0][2] == llm.config.num_layers, steps
    steps.clear()
    assert [o.token_ids for o in llm.generate(prompts[2:], params[2:])] == want[2:]
    assert any(b > 2 for b, _, _ in steps) and all(k == "decode" and g == 0 for b, k, g in steps if b > 2), steps
    sizes = {t for t, _ in graphs.calls}
    assert any(t <= 16 for t in sizes) and any(16 < t <= 32 for t in sizes), graphs.calls  # both buckets ran
    assert any(b > 1 for _, b in graphs.calls), graphs.calls  # a mixed step of several sequences
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    assert llm.stats()["prefix_cache"]["hits"] >= 2 * 24  # both later requests hit the shared prefix
    backend = llm.backend
    assert [backend.query_rows_kernel(num_seqs=n, min_context=c) for n, c in ((2, 2), (3, 500), (2, 24))] == [
        "decode", "decode", "grouped"]
    backend.query_rows_impl = "groupd"
    with pytest.raises(ValueError, match="use 'auto'"):
        backend.query_rows_kernel(num_seqs=1, min_context=40)


@pytest.mark.parametrize("impl, window, grouped", [("auto", None, True), ("grouped", None, True),
                                                    ("decode", None, False), ("auto", 32, False)])
def test_capture_all_records_a_grouped_graph_only_where_a_step_can_choose_the_grouped_kernel(
        impl, window, grouped, monkeypatch):
    """A bucket of query-row steps gets its decode-kernel graph, and a "grouped" one only where the backend
    may choose that kernel: not with query_rows_impl "decode", nor under a sliding window (where the backend
    always runs the decode kernel, so a grouped graph would record the same kernels again, never replayed)."""
    llm = _tiny_llm(max_num_seqs=4, sliding_window=window)
    llm.backend.query_rows_impl = impl
    graphs = _step_graphs(llm)
    recorded = []
    monkeypatch.setattr(graphs, "_capture", lambda t_b, kernel=None: recorded.append((t_b, kernel)) or object())
    graphs.capture_all()
    rows = [t for t in graphs.buckets if t <= llm.backend.query_rows_max]
    assert rows, (graphs.buckets, llm.backend.query_rows_max)  # some buckets are query-row steps
    want = {(t, "decode") for t in rows} | {(t, None) for t in graphs.buckets if t not in rows}
    want |= {(t, "grouped") for t in rows} if grouped else set()
    assert sorted(recorded, key=str) == sorted(want, key=str)
    assert set(graphs.graphs) == {graphs._key(t, k) for t, k in want}


def test_step_padding_stores_nothing_and_larger_steps_run_eagerly():
    llm = _tiny_llm(max_num_seqs=4)
    graphs = _step_graphs(llm, max_tokens=16)
    pool = llm.backend.pool
    before = [(k.clone(), v.clone()) for k, v in zip(pool.k_cache, pool.v_cache)]
    bs = llm.block_size
    long = lambda xs: torch.tensor(xs, dtype=torch.long, device=llm.device)  # noqa: E731
    # two sequences: 3 new tokens at positions 8..10 (block 5 then block 6) and one decode at position 2 (block 7)
    slots = [5 * bs + 0, 5 * bs + 1, 5 * bs + 2, 7 * bs + 2]
    inputs = BatchInputs(input_ids=long([1, 2, 3, 4]), positions=long([8, 9, 10, 2]),
                         query_start_loc=long([0, 3, 4]), seq_lens=long([11, 3]), query_lens_list=[3, 1],
                         seq_lens_list=[11, 3], max_seq_len=11, block_tables=long([[6, 5], [7, -1]]),
                         slot_mapping=long(slots), logits_indices=long([2, 3]))
    logits = graphs.run(inputs)
    assert logits.shape == (2, llm.config.vocab_size) and torch.isfinite(logits).all()
    for (k0, v0), k1, v1 in zip(before, pool.k_cache, pool.v_cache):
        changed = ((k1 != k0) | (v1 != v0)).flatten(2).any(-1)
        assert sorted(b * bs + o for b, o in changed.nonzero().tolist()) == sorted(slots)  # padding stored nothing
    meta = llm.backend.prepare_metadata(inputs)  # the same step eagerly: the same logits
    eager = llm.model(inputs.input_ids, inputs.positions, meta, llm.backend, logits_indices=inputs.logits_indices)
    torch.testing.assert_close(logits, eager, rtol=1e-4, atol=1e-4)
    many = BatchInputs(input_ids=long(range(17)), positions=long(range(17)), query_start_loc=long([0, 17]),
                       seq_lens=long([17]), query_lens_list=[17], seq_lens_list=[17], max_seq_len=17,
                       block_tables=long([[1, 2, 3]]), slot_mapping=long(range(8, 25)), logits_indices=long([16]))
    assert not graphs.fits(many)
    with pytest.raises(ValueError, match="largest captured step"):
        graphs.run(many)
    with pytest.raises(ValueError, match="cuda_graph_max_tokens"):
        LLM("tiny-random", device="cpu", kv_backend="paged", cuda_graph_max_tokens=8)
