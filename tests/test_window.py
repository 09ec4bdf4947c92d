"""Rung 8: a sliding window with sink tokens (StreamingLLM) that gives blocks back while a request runs.

    the query at position p sees   [0, S)  the sinks   and   (p - W, p]  its window

Pinned here: the Triton kernels (interpreter) equal the torch reference with a window and sinks on
ragged lengths, and never read a block the engine gave back (its table entry is -1); an engine
with a window longer than every sequence gives the tokens of one without; a long generation holds
a bounded number of blocks; the engine's free rule frees exactly the blocks no later query sees.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before minikv.kernels defines the kernels

import pytest  # noqa: E402
import torch  # noqa: E402

from minikv import LLM, SamplingParams  # noqa: E402
from minikv.attention.metadata import AttentionMetadata  # noqa: E402
from minikv.cache.blocks.window import NO_BLOCK, window_free_rule  # noqa: E402
from minikv.kernels import paged_decode_attention, paged_prefill_attention  # noqa: E402

from test_kernels import HEAD_DIM, SCALE, assert_close, poisoned, scattered_pool  # noqa: E402


def reference_w(q, k_cache, v_cache, tables, meta, window, sinks):
    from minikv.attention.common import attend

    B, L = meta.num_seqs, meta.max_seq_len
    t = tables.clamp(min=0)
    keys = k_cache[t].reshape(B, -1, *k_cache.shape[2:])[:, :L].double()
    values = v_cache[t].reshape(B, -1, *v_cache.shape[2:])[:, :L].double()
    return attend(q.double(), keys, values, meta, SCALE, window, sinks)


def loop_reference(q, k_cache, v_cache, tables, meta, window, sinks):
    """The spec in plain loops: each query's visible key positions listed one by one."""
    out = torch.empty(q.shape, dtype=torch.float64)
    bs, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    for t in range(q.shape[0]):
        b, p = int(meta.token_seq[t]), int(meta.token_pos[t])
        seen = [j for j in range(p + 1) if j < sinks or j > p - window]
        rows = [(int(tables[b, j // bs]), j % bs) for j in seen]
        k = torch.stack([k_cache[blk, off] for blk, off in rows]).double()  # [n, kv_heads, D]
        v = torch.stack([v_cache[blk, off] for blk, off in rows]).double()
        for h in range(q.shape[1]):
            w = torch.softmax(k[:, h // group] @ q[t, h].double() * SCALE, 0)
            out[t, h] = w @ v[:, h // group]
    return out


def give_back_dead_blocks(tables, meta, window, sinks, block_size):
    """Set to -1 the table entries of blocks no query of this step sees (the engine frees them)."""
    tables = tables.clone()
    for b in range(meta.num_seqs):
        first_q = meta.seq_lens_list[b] - meta.query_lens_list[b]
        n = int((tables[b] >= 0).sum())
        for i in window_free_rule(tables[b, :n].tolist(), first_q, block_size, window, sinks):
            tables[b, i] = NO_BLOCK
    return tables


@pytest.mark.parametrize("block_size,window,sinks", [(8, 8, 3), (16, 33, 17)])
def test_decode_kernel_with_window_and_sinks_equals_reference_and_reads_no_freed_block(block_size, window, sinks):
    seq_lens = [1, 40, 97]
    k_cache, v_cache, tables = scattered_pool(seq_lens, block_size, 2, torch.float32, seed=window + sinks)
    meta = AttentionMetadata.build([1] * len(seq_lens), seq_lens)
    q = torch.randn(len(seq_lens), 4, HEAD_DIM)
    want = loop_reference(q, k_cache, v_cache, tables, meta, window, sinks)
    assert_close(reference_w(q, k_cache, v_cache, tables, meta, window, sinks).float(), want.float(), 2e-6,
                 "torch reference vs loops")
    freed = give_back_dead_blocks(tables, meta, window, sinks, block_size)
    assert (freed < 0).sum() > (tables < 0).sum(), "the case frees some blocks"
    for n in (1, 3):
        out = paged_decode_attention(q, k_cache, v_cache, freed, meta.seq_lens, SCALE, num_splits=n,
                                     sliding_window=window, sink_tokens=sinks, out=poisoned(q.shape, q.dtype))
        assert_close(out, want.float(), 2e-6, f"decode, {n} splits, window {window}, sinks {sinks}")


@pytest.mark.parametrize("block_size,window,sinks", [(8, 8, 3), (16, 24, 16)])
def test_prefill_kernel_with_window_and_sinks_equals_reference_and_reads_no_freed_block(block_size, window, sinks):
    # a chunk after 80 computed | a decode row | a whole prompt
    query_lens, seq_lens = [20, 1, 40], [100, 90, 40]
    k_cache, v_cache, tables = scattered_pool(seq_lens, block_size, 2, torch.float32, seed=window)
    meta = AttentionMetadata.build(query_lens, seq_lens)
    q = torch.randn(sum(query_lens), 4, HEAD_DIM)
    want = loop_reference(q, k_cache, v_cache, tables, meta, window, sinks)
    assert_close(reference_w(q, k_cache, v_cache, tables, meta, window, sinks).float(), want.float(), 2e-6,
                 "torch reference vs loops")
    freed = give_back_dead_blocks(tables, meta, window, sinks, block_size)
    assert (freed < 0).sum() > (tables < 0).sum(), "the case frees some blocks"
    out = paged_prefill_attention(q, k_cache, v_cache, freed, meta.query_start_loc, meta.seq_lens, SCALE,
                                  sliding_window=window, sink_tokens=sinks, block_m=16,
                                  block_n=32, out=poisoned(q.shape, q.dtype))
    assert_close(out, want.float(), 2e-6, f"prefill, window {window}, sinks {sinks}")


# ---- the engine ------------------------------------------------------------------------------------
PAGED = dict(kv_backend="paged", block_size=4)
PROMPTS = [list(range(1, 14)), list(range(20, 50))]


class LiveBlocks:
    """Observer: the most blocks any one sequence held after a step."""

    def __init__(self):
        self.most = 0

    def on_step(self, llm, batch, events):
        llm.block_manager.check(llm.scheduler.all_sequences())
        for s in llm.scheduler.running:
            self.most = max(self.most, sum(1 for b in s.block_table if b != NO_BLOCK))


def tokens(outs):
    return [o.token_ids for o in outs]


def test_a_window_longer_than_every_sequence_gives_the_tokens_of_the_engine_without_one():
    p = SamplingParams(max_tokens=20, ignore_eos=True)
    plain = LLM("tiny-random", num_blocks=40, **PAGED)
    wide = LLM("tiny-random", num_blocks=40, sliding_window=64, sink_tokens=4, **PAGED)
    assert tokens(wide.generate(PROMPTS, p)) == tokens(plain.generate(PROMPTS, p))
    assert wide.stats()["window_freed_blocks"] == 0


def test_giving_blocks_back_changes_no_token_and_a_long_generation_holds_a_bounded_number_of_blocks():
    p = SamplingParams(max_tokens=150, ignore_eos=True)
    window = dict(sliding_window=16, sink_tokens=4, max_num_batched_tokens=16)
    # the same mask, but a free rule that gives nothing back: every block stays until the end
    keep = LLM("tiny-random", num_blocks=128, window_free_rule=lambda *a: [], **window, **PAGED)
    held_all = LiveBlocks()
    keep.add_observer(held_all)
    want = tokens(keep.generate(PROMPTS, p))
    # 24 blocks of 4 = 96 tokens: far too few for 163- and 180-token sequences without the window
    small = LLM("tiny-random", num_blocks=24, max_model_len=400, **window, **PAGED)
    held = LiveBlocks()
    small.add_observer(held)
    assert tokens(small.generate(PROMPTS, p)) == want
    bound = small.engine_config.window_blocks(400)  # sink block + window and one step's tokens + 1
    assert held_all.most == 45 and held.most <= bound == 10, (held_all.most, held.most, bound)
    stats = small.stats()
    assert stats["window_freed_blocks"] > 60 and stats["num_preemptions"] == 0
    assert stats["used_blocks"] == 0, "every block goes back when the requests finish"


def test_a_model_whose_config_has_a_window_uses_it_by_default():
    import dataclasses

    from minikv.model.loader import LoadedModel

    base = LLM("tiny-random", num_blocks=64, **PAGED)
    loaded = base.loaded
    mistral_like = LoadedModel(loaded.model, dataclasses.replace(loaded.config, sliding_window=12), loaded.tokenizer,
                               loaded.source)
    llm = LLM(mistral_like, num_blocks=64, **PAGED)
    assert llm.engine_config.sliding_window == 12
    p = SamplingParams(max_tokens=30, ignore_eos=True)
    out = tokens(llm.generate(PROMPTS, p))
    assert llm.stats()["window_freed_blocks"] > 0
    assert out == tokens(base.derive(sliding_window=12).generate(PROMPTS, p))
    assert out != tokens(base.generate(PROMPTS, p)), "a 12-token window changes what a 43-token context gives"
    tiny_window = LoadedModel(loaded.model, dataclasses.replace(loaded.config, sliding_window=2), None, "x")
    with pytest.raises(ValueError, match="the model's sliding_window=2 is smaller than a block"):
        LLM(tiny_window, **PAGED)


def test_prefix_caching_forks_and_beams_keep_their_invariants_under_a_window():
    shared = list(range(100, 140))
    prompts = [shared + [1, 2, 3], shared + [4, 5], shared + [6]]
    p = SamplingParams(max_tokens=24, ignore_eos=True)
    window = dict(sliding_window=12, sink_tokens=2, num_blocks=48)
    want = tokens(LLM("tiny-random", **window, **PAGED).generate(prompts, p))
    cached = LLM("tiny-random", prefix_caching="hash", **window, **PAGED)
    cached.add_observer(LiveBlocks())
    assert tokens(cached.generate(prompts, p)) == want
    assert tokens(cached.generate(prompts, p)) == want, "a second pass hits blocks some windows gave back"
    assert cached.stats()["prefix_cache"]["hits"] > 0
    forks = LLM("tiny-random", **window, **PAGED)
    forks.add_observer(LiveBlocks())
    outs = forks.generate(prompts[:1], SamplingParams(n=3, temperature=1.0, max_tokens=30, ignore_eos=True, seed=1))
    assert len(outs[0].outputs) == 3 and forks.stats()["window_freed_blocks"] > 0
    beams = LLM("tiny-random", **window, **PAGED)
    beams.add_observer(LiveBlocks())
    beams.beam_search(prompts[:1], beam_width=3, max_tokens=20)
    assert beams.stats()["used_blocks"] == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(sliding_window=2), "sliding_window=2 is smaller than a block .*block_size 4"),
    (dict(sliding_window=8, sink_tokens=9), "sink_tokens=9 is larger than sliding_window=8"),
    (dict(sliding_window=-8), "sliding_window must be an integer >= 1"),
    (dict(sliding_window=8, sink_tokens=-1), "sink_tokens must be an integer >= 0"),
    (dict(sink_tokens=4), "sink_tokens=4 keeps the first tokens in sight beside a sliding window, but there is none"),
    (dict(sliding_window=8, prefix_caching="radix"), "radix tree .* use prefix_caching='hash'"),
    (dict(kv_backend="contiguous", sliding_window=8), "sliding_window is an option of the paged pool"),
    (dict(kv_backend="naive", sink_tokens=4), "sink_tokens is an option of the paged pool"),
    (dict(window_free_rule=lambda *a: []), "window_free_rule plugs into rung 8"),
    (dict(sliding_window=8, num_blocks=4, max_model_len=200), "holds up to .* blocks at once"),
])
def test_bad_window_options_are_refused_with_the_limit_and_the_fix(kwargs, message):
    options = {**PAGED, **kwargs}
    if options["kv_backend"] != "paged":
        options.pop("block_size")
    with pytest.raises(ValueError, match=message):
        LLM("tiny-random", **options)


def test_a_free_rule_that_frees_a_block_still_in_sight_is_refused():
    def frees_the_sinks(block_table, num_computed_tokens, block_size, sliding_window, sink_tokens):
        return [0] if num_computed_tokens > 20 else []

    llm = LLM("tiny-random", num_blocks=40, sliding_window=8, sink_tokens=2, window_free_rule=frees_the_sinks, **PAGED)
    with pytest.raises(ValueError, match=r"frees block 0 \(positions 0-3\), but the next query .* sinks 0-1"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=20, ignore_eos=True))


def test_kernels_on_a_quantized_pool_with_window_sinks_and_given_back_blocks_equal_the_dequantized_reference():
    from minikv.cache.blocks.quant import dequantize_block, quantize_block

    bs, window, sinks = 8, 16, 3
    seq_lens = [5, 40, 77]
    k_cache, v_cache, tables = scattered_pool(seq_lens, bs, 2, torch.float32, seed=3)
    (kq, ks, kz), (vq, vs, vz) = quantize_block(k_cache, torch.int8), quantize_block(v_cache, torch.int8)
    k_deq, v_deq = dequantize_block(kq, ks, kz), dequantize_block(vq, vs, vz)
    meta = AttentionMetadata.build([1] * len(seq_lens), seq_lens)
    q = torch.randn(len(seq_lens), 4, HEAD_DIM)
    freed = give_back_dead_blocks(tables, meta, window, sinks, bs)
    out = paged_decode_attention(q, kq, vq, freed, meta.seq_lens, SCALE, num_splits=2, sliding_window=window,
                                 sink_tokens=sinks, k_scale=ks, v_scale=vs, k_zero=kz, v_zero=vz,
                                 out=poisoned(q.shape, q.dtype))
    assert_close(out, loop_reference(q, k_deq, v_deq, tables, meta, window, sinks).float(), 2e-5, "decode, int8")
    query_lens, seq_lens = [12, 1], [60, 33]
    k_cache, v_cache, tables = scattered_pool(seq_lens, bs, 2, torch.float32, seed=4)
    (kq, ks, kz), (vq, vs, vz) = quantize_block(k_cache, torch.int8), quantize_block(v_cache, torch.int8)
    meta = AttentionMetadata.build(query_lens, seq_lens)
    q = torch.randn(sum(query_lens), 4, HEAD_DIM)
    freed = give_back_dead_blocks(tables, meta, window, sinks, bs)
    out = paged_prefill_attention(q, kq, vq, freed, meta.query_start_loc, meta.seq_lens, SCALE,
                                  sliding_window=window, sink_tokens=sinks, k_scale=ks, v_scale=vs, k_zero=kz,
                                  v_zero=vz, block_m=16,
                                  block_n=16, out=poisoned(q.shape, q.dtype))
    want = loop_reference(q, dequantize_block(kq, ks, kz), dequantize_block(vq, vs, vz), tables, meta, window, sinks)
    assert_close(out, want.float(), 2e-5, "prefill, int8")


def test_a_quantized_pool_with_a_window_gives_back_blocks_and_the_tokens_of_keeping_them():
    p = SamplingParams(max_tokens=60, ignore_eos=True)
    window = dict(sliding_window=16, sink_tokens=4, max_num_batched_tokens=16, kv_cache_dtype="int8")
    keep = LLM("tiny-random", num_blocks=64, window_free_rule=lambda *a: [], **window, **PAGED)
    small = LLM("tiny-random", num_blocks=24, max_model_len=200, preemption="swap", **window, **PAGED)
    small.add_observer(LiveBlocks())
    assert tokens(small.generate(PROMPTS, p)) == tokens(keep.generate(PROMPTS, p))
    assert small.stats()["window_freed_blocks"] > 0 and small.stats()["kv_cache_dtype"] == "int8"
