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
from minikv.cache.window import NO_BLOCK, window_free_rule  # noqa: E402
from minikv.kernels import paged_decode_attention, paged_prefill_attention  # noqa: E402
from test_kernels import SCALE, HEAD_DIM, assert_close, poisoned, reference, scattered_pool  # noqa: E402


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
                                  meta.max_query_len, sliding_window=window, sink_tokens=sinks, block_m=16,
                                  block_n=32, out=poisoned(q.shape, q.dtype))
    assert_close(out, want.float(), 2e-6, f"prefill, window {window}, sinks {sinks}")
