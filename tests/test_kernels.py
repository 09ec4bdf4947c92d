"""Rung 7: the Triton kernels equal the torch paged reference (rung 4) and a float64 reference.

Runs in Triton's interpreter on the CPU (TRITON_INTERPRET=1 is set before the kernels are defined).
Every case scatters the sequences' blocks over a shuffled pool, mixes ragged context lengths
(1, exact block multiples, odd lengths), and poisons the output with NaN first, so an element the
kernel forgets to write fails the comparison.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before minikv.kernels defines the kernels

import importlib  # noqa: E402, I001  (the block keeps triton after minikv.kernels)
import itertools  # noqa: E402
import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from minikv.attention.common import attend  # noqa: E402
from minikv.attention.metadata import AttentionMetadata  # noqa: E402
from minikv.cache.blocks.pool import new_pool  # noqa: E402
from minikv.kernels import paged_decode_attention, paged_prefill_attention, store_kvcache  # noqa: E402
from minikv.kernels import decode_attention as dec  # noqa: E402
from minikv.kernels.query_rows_attention import paged_query_rows_attention  # noqa: E402
from minikv.checks.decode_kernel import scattered_block_tables  # noqa: E402
import triton  # noqa: E402, I001  (after minikv.kernels: on a CPU it picks the interpreter)
import triton.language as tl  # noqa: E402

HEAD_DIM = 32
SCALE = HEAD_DIM**-0.5


def scattered_pool(seq_lens, block_size, num_kv_heads, dtype, seed=0, spare_blocks=5):
    """A pool with random K/V and one shuffled block table per sequence (-1 padded)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks, tables = scattered_block_tables(seq_lens, block_size, spare_blocks, g)
    shape = (num_blocks, block_size, num_kv_heads, HEAD_DIM)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    return k_cache, v_cache, tables


def reference(q, k_cache, v_cache, tables, meta, window=None, dtype=torch.float64):
    """Rung 4's math: gather each sequence's blocks into a padded view, one masked SDPA."""
    B, L = meta.num_seqs, meta.max_seq_len
    t = tables.clamp(min=0)
    keys = k_cache[t].reshape(B, -1, *k_cache.shape[2:])[:, :L]
    values = v_cache[t].reshape(B, -1, *v_cache.shape[2:])[:, :L]
    return attend(q.to(dtype), keys.to(dtype), values.to(dtype), meta, SCALE, window)


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype)


def assert_close(have, want, atol, what):
    assert not have.isnan().any(), f"{what}: {have.isnan().sum().item()} elements left unwritten (NaN)"
    err = (have.double() - want.double()).abs().max().item()
    assert err <= atol, f"{what}: max error {err:.2e} > {atol:.0e}"


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("block_size", [8, 16, 64])
def test_decode_matches_torch_paged_and_float64(block_size, group, num_splits):
    seq_lens = [1, block_size, 3 * block_size, 2 * block_size + 5, 70]
    num_kv_heads = 2
    k_cache, v_cache, tables = scattered_pool(seq_lens, block_size, num_kv_heads, torch.float32, seed=block_size)
    meta = AttentionMetadata.build([1] * len(seq_lens), seq_lens)
    q = torch.randn(len(seq_lens), num_kv_heads * group, HEAD_DIM)
    out = paged_decode_attention(q, k_cache, v_cache, tables, meta.seq_lens, SCALE, num_splits=num_splits,
                                 out=poisoned(q.shape, q.dtype))
    assert_close(out, reference(q, k_cache, v_cache, tables, meta), 2e-6, "vs float64")
    assert_close(out, reference(q, k_cache, v_cache, tables, meta, dtype=torch.float32), 2e-6, "vs torch paged fp32")


@pytest.mark.parametrize("group", [1, 8])
def test_decode_float16_matches_references(group):
    seq_lens = [1, 16, 45, 130]
    k_cache, v_cache, tables = scattered_pool(seq_lens, 16, 2, torch.float16, seed=3)
    meta = AttentionMetadata.build([1] * len(seq_lens), seq_lens)
    q = torch.randn(len(seq_lens), 2 * group, HEAD_DIM).half()
    out = paged_decode_attention(q, k_cache, v_cache, tables, meta.seq_lens, SCALE, num_splits=3,
                                 out=poisoned(q.shape, q.dtype))
    assert_close(out, reference(q, k_cache, v_cache, tables, meta), 2e-3, "fp16 vs float64")
    torch_fp16 = reference(q, k_cache, v_cache, tables, meta, dtype=torch.float32).half()
    assert_close(out, torch_fp16, 2e-3, "fp16 vs torch paged")


@pytest.mark.parametrize("block_size", [4, 1024])  # the engine's smallest and largest block sizes
def test_decode_and_prefill_at_the_engines_block_size_limits(block_size):
    seq_lens = [1, 4, 13, 1030]
    k_cache, v_cache, tables = scattered_pool(seq_lens, block_size, 2, torch.float32, seed=17, spare_blocks=2)
    meta = AttentionMetadata.build([1] * 4, seq_lens)
    q = torch.randn(4, 6, HEAD_DIM)
    out = paged_decode_attention(q, k_cache, v_cache, tables, meta.seq_lens, SCALE, num_splits=2,
                                 out=poisoned(q.shape, q.dtype))
    assert_close(out, reference(q, k_cache, v_cache, tables, meta), 2e-6, f"decode, block size {block_size}")
    meta = AttentionMetadata.build([1, 3, 13, 30], seq_lens)
    q = torch.randn(47, 6, HEAD_DIM)
    out = paged_prefill_attention(q, k_cache, v_cache, tables, meta.query_start_loc, meta.seq_lens, SCALE,
                                  out=poisoned(q.shape, q.dtype))
    assert_close(out, reference(q, k_cache, v_cache, tables, meta), 2e-6, f"prefill, block size {block_size}")


def test_decode_split_counts_agree_and_short_sequences_leave_splits_empty():
    seq_lens = [1, 9, 300]  # 8 splits of a 1-token sequence: 7 of them empty
    k_cache, v_cache, tables = scattered_pool(seq_lens, 16, 1, torch.float32, seed=5)
    q = torch.randn(3, 4, HEAD_DIM)
    lens = torch.tensor(seq_lens)
    outs = [paged_decode_attention(q, k_cache, v_cache, tables, lens, SCALE, num_splits=n,
                                   out=poisoned(q.shape, q.dtype)) for n in (1, 2, 5, 8)]
    for n, o in zip((2, 5, 8), outs[1:]):
        assert_close(o, outs[0], 1e-6, f"{n} splits vs 1")


@pytest.mark.parametrize("window", [1, 7, 40])
def test_decode_sliding_window_sees_the_last_window_keys(window):
    seq_lens = [1, 6, 33, 90]
    k_cache, v_cache, tables = scattered_pool(seq_lens, 8, 2, torch.float32, seed=window)
    meta = AttentionMetadata.build([1] * 4, seq_lens)
    q = torch.randn(4, 6, HEAD_DIM)
    out = paged_decode_attention(q, k_cache, v_cache, tables, meta.seq_lens, SCALE, num_splits=3,
                                 sliding_window=window, out=poisoned(q.shape, q.dtype))
    assert_close(out, reference(q, k_cache, v_cache, tables, meta, window), 2e-6, f"window {window}")


@pytest.mark.parametrize("window", [None, 21])
@pytest.mark.parametrize("block_size", [3, 8, 32])
def test_decode_reads_the_block_table_a_chunk_at_a_time(monkeypatch, block_size, window):
    """A program holds the table entries of ~TABLE_CHUNK_POSITIONS positions at once. Shrunk to 16,
    every split crosses several chunks, and with an odd block size or a window chunks start mid-block."""
    monkeypatch.setattr(dec, "TABLE_CHUNK_POSITIONS", 16)
    entries, positions = dec.table_chunk(block_size, 16)
    assert positions >= 16 and (entries - 1) * block_size + 1 >= positions, "a chunk's entries cover its tiles"
    seq_lens = [1, 40, 97, 150]
    k_cache, v_cache, tables = scattered_pool(seq_lens, block_size, 2, torch.float32, seed=block_size)
    meta = AttentionMetadata.build([1] * 4, seq_lens)
    q = torch.randn(4, 6, HEAD_DIM)
    want = reference(q, k_cache, v_cache, tables, meta, window)
    for n in (1, 3):
        out = paged_decode_attention(q, k_cache, v_cache, tables, meta.seq_lens, SCALE, num_splits=n, block_n=16,
                                     sliding_window=window, out=poisoned(q.shape, q.dtype))
        assert_close(out, want, 2e-6, f"block size {block_size}, window {window}, {n} splits")


def test_decode_reads_head_major_storage_and_a_too_small_max_seq_len_loses_nothing():
    """The kernel reads the pool through its strides, so K/V stored head-major ([blocks, kv_heads,
    block_size, D] in memory, indexed the same way) give the same result. max_seq_len only sizes the
    splits: if it is too small, the last split reads the rest."""
    seq_lens = [3, 50, 129]
    k_cache, v_cache, tables = scattered_pool(seq_lens, 16, 2, torch.float32, seed=11)
    meta = AttentionMetadata.build([1] * 3, seq_lens)
    q = torch.randn(3, 4, HEAD_DIM)
    want = reference(q, k_cache, v_cache, tables, meta)
    k_hm, v_hm = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k_cache, v_cache))
    assert k_hm.stride(2) == 16 * HEAD_DIM and torch.equal(k_hm, k_cache)
    out = paged_decode_attention(q, k_hm, v_hm, tables, meta.seq_lens, SCALE, num_splits=3, block_n=16,
                                 out=poisoned(q.shape, q.dtype))
    assert_close(out, want, 2e-6, "head-major storage")
    out = paged_decode_attention(q, k_cache, v_cache, tables, meta.seq_lens, SCALE, num_splits=3, block_n=16,
                                 max_seq_len=40, out=poisoned(q.shape, q.dtype))
    assert_close(out, want, 2e-6, "max_seq_len 40 for a 129-token sequence")


def test_decode_trace_shows_every_block_read_by_exactly_the_split_that_owns_it():
    seq_lens = [5, 64, 100]
    k_cache, v_cache, tables = scattered_pool(seq_lens, 8, 2, torch.float32, seed=7)
    q = torch.randn(3, 4, HEAD_DIM)
    trace = torch.full((3, 2, tables.shape[1]), -1, dtype=torch.int32)
    paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(seq_lens), SCALE, num_splits=2,
                           block_n=16, trace=trace)
    for b, s in enumerate(seq_lens):
        n = math.ceil(s / 8)
        assert (trace[b, :, :n] >= 0).all(), f"sequence {b}: a block of its context was never read"
        assert (trace[b, :, n:] == -1).all(), f"sequence {b}: a block past its context was read"
        assert (trace[b, :, :n].diff(dim=-1) >= 0).all(), "splits read consecutive ranges in order"



@pytest.mark.parametrize("window", [None, 21])
def test_decode_split_per_sequence_cuts_each_context_evenly_whatever_max_seq_len_says(window):
    """Under a CUDA graph max_seq_len is only a bound (max_model_len): with split_per_seq each program
    cuts its own sequence's span, so every split of a long enough sequence reads a share and the
    result equals the reference for any bound."""
    seq_lens = [5, 64, 100, 200]
    k_cache, v_cache, tables = scattered_pool(seq_lens, 8, 2, torch.float32, seed=9)
    meta = AttentionMetadata.build([1] * 4, seq_lens)
    q = torch.randn(4, 4, HEAD_DIM)
    want = reference(q, k_cache, v_cache, tables, meta, window)
    for bound in (2048, 7):  # far above the longest context, and below all but the shortest
        trace = torch.full((4, 2, tables.shape[1]), -1, dtype=torch.int32)
        out = paged_decode_attention(q, k_cache, v_cache, tables, meta.seq_lens, SCALE, num_splits=3, block_n=16,
                                     sliding_window=window, max_seq_len=bound, trace=trace, split_per_seq=True,
                                     out=poisoned(q.shape, q.dtype))
        assert_close(out, want, 2e-6, f"max_seq_len {bound}, window {window}")
        if window is None:
            # blocks of 8: 200 positions are three splits of 80, 80 and 40; 64 are two tiles of 32, the third empty
            assert trace[3, 0, :25].tolist() == [0] * 10 + [1] * 10 + [2] * 5
            assert trace[1, 0, :8].tolist() == [0] * 4 + [1] * 4


@triton.jit
def _inner_loop_without_rescale(q, k, v, valid, m_i, l_i, acc, scale_log2e, DOT_PRECISION: tl.constexpr):
    """online_softmax_block with a classic bug: what was summed is never rescaled when the max grows."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    return m_new, l_i + tl.sum(p, axis=1), acc + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)


def test_decode_inner_loop_is_an_argument_of_the_kernel_and_the_default_stays():
    """The seam of exercise 08a: `inner_loop` reaches the split kernel as a compile-time argument. A
    buggy loop changes the output, the default is untouched by it, and a plain function is refused."""
    seq_lens = [7, 50, 100]
    k_cache, v_cache, tables = scattered_pool(seq_lens, 16, 2, torch.float32, seed=13)
    meta = AttentionMetadata.build([1] * 3, seq_lens)
    q = torch.randn(3, 4, HEAD_DIM) * 4  # sharp scores: later tiles raise the running max
    want = reference(q, k_cache, v_cache, tables, meta)

    def decode(**kw):
        return paged_decode_attention(q, k_cache, v_cache, tables, meta.seq_lens, SCALE, num_splits=2, block_n=16,
                                      out=poisoned(q.shape, q.dtype), **kw)

    assert_close(decode(inner_loop=dec.online_softmax_block), want, 2e-6, "the default loop passed explicitly")
    buggy = decode(inner_loop=_inner_loop_without_rescale)
    assert (buggy[1:] - want[1:]).abs().max() > 1e-2, "the kernel ignored inner_loop"
    assert_close(buggy[0], want[0], 2e-6, "one tile (nothing to rescale) is right even without rescaling")
    assert_close(decode(), want, 2e-6, "the default after a custom loop")
    with pytest.raises(TypeError, match="decorate it with @triton.jit"):
        decode(inner_loop=lambda *args: args)

def mixed_batch(query_lens, seq_lens, block_size, num_kv_heads, group, dtype, seed):
    k_cache, v_cache, tables = scattered_pool(seq_lens, block_size, num_kv_heads, dtype, seed=seed)
    meta = AttentionMetadata.build(query_lens, seq_lens)
    q = torch.randn(sum(query_lens), num_kv_heads * group, HEAD_DIM).to(dtype)
    return q, k_cache, v_cache, tables, meta


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("block_size", [8, 32])
def test_prefill_matches_references_for_prompts_chunks_cached_prefixes_and_decode_rows(block_size, group):
    # whole prompt | one-token prompt | chunk after 40 cached | prefix-cached prompt | decode row | long prompt
    query_lens = [13, 1, 24, 5, 1, 70]
    seq_lens = [13, 1, 64, 2 * block_size + 5, 50, 70]
    q, k_cache, v_cache, tables, meta = mixed_batch(query_lens, seq_lens, block_size, 2, group, torch.float32,
                                                    seed=block_size + group)
    out = paged_prefill_attention(q, k_cache, v_cache, tables, meta.query_start_loc, meta.seq_lens, SCALE,
                                  out=poisoned(q.shape, q.dtype))
    assert_close(out, reference(q, k_cache, v_cache, tables, meta), 2e-6, "vs float64")
    assert_close(out, reference(q, k_cache, v_cache, tables, meta, dtype=torch.float32), 2e-6, "vs torch paged")


def test_prefill_flat_tiles_cover_every_row_with_rows_of_no_tokens():
    """The flat grid (cdiv(T, BLOCK_M) + B programs per head, each finding its sequence by a binary search):
    tiles of 16 rows, sequences starting mid-tile, and rows of no tokens around them, as a CUDA graph's
    padding rows are (they must neither write nor shift a neighbour's tiles). Every real row is checked
    against float64; a row no program wrote would keep the poison."""
    layouts = [([0, 17, 0, 1, 33, 0, 16, 5, 0], [0, 40, 0, 9, 33, 0, 80, 5, 0]),
               ([21, 3, 0, 0, 0, 0, 0], [21, 50, 0, 0, 0, 0, 0]),  # a graph's padding rows: empty, last
               ([0, 0, 64, 0, 0], [0, 0, 70, 0, 0])]  # the tokens end on a tile's edge
    for query_lens, seq_lens in layouts:
        q, k_cache, v_cache, tables, meta = mixed_batch([n for n in query_lens if n], [s for s, n in zip(
            seq_lens, query_lens) if n], 8, 2, 3, torch.float32, seed=5)
        starts = torch.tensor([0] + list(itertools.accumulate(query_lens)))
        full_tables = torch.zeros(len(query_lens), tables.shape[1], dtype=tables.dtype)
        full_tables[torch.tensor([i for i, n in enumerate(query_lens) if n])] = tables
        for block_m in (16, 64):
            out = paged_prefill_attention(q, k_cache, v_cache, full_tables, starts, torch.tensor(seq_lens), SCALE,
                                          block_m=block_m, out=poisoned(q.shape, q.dtype))
            assert_close(out, reference(q, k_cache, v_cache, tables, meta), 2e-6,
                         f"flat tiles of {block_m}, rows {query_lens}")


@pytest.mark.parametrize("module, kernel, count", [
    ("prefill_attention", "_prefill_kernel", "num_seqs"), ("fused_norm", "_add_rms_norm_kernel", "num_rows"),
    ("fused_activation", "_silu_and_mul_kernel", "num_rows"), ("fused_rope", "_rotary_qkv_kernel", "num_rows")])
def test_kernels_compile_once_for_every_count_of_rows_or_sequences(module, kernel, count):
    """Triton compiles an integer argument's kernel anew when the integer is 1 or a multiple of 16, unless the
    argument is left unspecialized. A count of rows or sequences changes every step: until the prefill
    kernel's num_seqs was unspecialized, a server's engine process stalled 0.5 s on a step of 80 or 16
    sequences mid-burst (H200, benchmarks/NOTES_step_profile.md). On a GPU the jitted function holds the
    list, on the interpreter its arguments do."""
    fn = getattr(importlib.import_module(f"minikv.kernels.{module}"), kernel)
    unspecialized = (fn.do_not_specialize if hasattr(fn, "do_not_specialize")
                     else fn.kwargs.get("do_not_specialize")) or []
    names = [fn.arg_names[i] if isinstance(i, int) else i for i in unspecialized]
    assert count in names, f"{kernel} specializes on {count}: add do_not_specialize=[{count!r}] to its @triton.jit"


@pytest.mark.parametrize("window", [3, 40])
def test_prefill_sliding_window(window):
    q, k_cache, v_cache, tables, meta = mixed_batch([30, 1, 70], [60, 9, 70], 16, 2, 3, torch.float32, seed=11)
    out = paged_prefill_attention(q, k_cache, v_cache, tables, meta.query_start_loc, meta.seq_lens, SCALE,
                                  sliding_window=window, out=poisoned(q.shape, q.dtype))
    assert_close(out, reference(q, k_cache, v_cache, tables, meta, window), 2e-6, f"window {window}")


def test_prefill_float16_matches_references():
    q, k_cache, v_cache, tables, meta = mixed_batch([20, 1, 66], [50, 17, 66], 16, 2, 3, torch.float16, seed=13)
    out = paged_prefill_attention(q, k_cache, v_cache, tables, meta.query_start_loc, meta.seq_lens, SCALE,
                                  out=poisoned(q.shape, q.dtype))
    assert_close(out, reference(q, k_cache, v_cache, tables, meta), 2e-3, "fp16 vs float64")


@pytest.mark.parametrize("group, num_splits", [(1, 3), (3, 1), (7, 4), (8, 16)])
def test_query_rows_match_references_for_hits_chunk_tails_and_decode_rows(group, num_splits):
    """Few new tokens per sequence, the rows of one sequence sharing a program (4 rows per program, so
    a 10-row run takes three, the last short): a hit's suffix after a long cached prefix, a chunk's
    tail, decode rows, a one-token prompt. 16 splits leave some splits empty for short contexts; with
    3, 4 or 16, the rows at positions 62..65 straddle a split's start at 64, so rows 62 and 63 have no key
    in that split (lse -inf, weight 0)."""
    query_lens = [10, 1, 4, 1, 7]
    seq_lens = [150, 33, 66, 1, 7]
    q, k_cache, v_cache, tables, meta = mixed_batch(query_lens, seq_lens, 16, 2, group, torch.float32,
                                                    seed=group + num_splits)
    out = paged_query_rows_attention(q, k_cache, v_cache, tables, meta.query_start_loc, meta.seq_lens, SCALE,
                                     meta.max_seq_len, num_splits=num_splits, rows=4,
                                     out=poisoned(q.shape, q.dtype))
    assert_close(out, reference(q, k_cache, v_cache, tables, meta), 2e-6, "vs float64")


def test_query_rows_under_graph_bounds_padding_rows_and_float16():
    """As a CUDA graph's static buffers pass them: a host bound above the real lengths (max_seq_len of the
    model), a padding sequence and rows with no token at all."""
    query_lens, seq_lens = [5, 2, 9], [70, 18, 9]  # the last: the padding row's tokens at positions 0..8
    q, k_cache, v_cache, tables, meta = mixed_batch(query_lens, seq_lens, 8, 2, 3, torch.float16, seed=5)
    qsl = torch.cat([meta.query_start_loc, meta.query_start_loc[-1:].repeat(2)])  # two rows with no token
    lens = torch.cat([meta.seq_lens, torch.zeros(2, dtype=torch.long)])
    tabs = torch.cat([tables, torch.zeros(2, tables.shape[1], dtype=tables.dtype)])
    out = paged_query_rows_attention(q, k_cache, v_cache, tabs, qsl, lens, SCALE, max_seq_len=512, rows=4,
                                     out=poisoned(q.shape, q.dtype))
    assert_close(out, reference(q, k_cache, v_cache, tables, meta), 2e-3, "fp16 vs float64")


def test_query_rows_read_a_quantized_pool_as_the_decode_kernel_does():
    from minikv.cache.blocks.quant import dequantize_block, quantize_block
    query_lens, seq_lens = [6, 1], [45, 20]
    q, k_cache, v_cache, tables, meta = mixed_batch(query_lens, seq_lens, 16, 2, 2, torch.float32, seed=9)
    (kq, ks, kz), (vq, vs, vz) = (quantize_block(x, torch.int8) for x in (k_cache, v_cache))
    out = paged_query_rows_attention(q, kq, vq, tables, meta.query_start_loc, meta.seq_lens, SCALE,
                                     meta.max_seq_len, num_splits=2, rows=4,
                                     k_scale=ks, v_scale=vs, k_zero=kz, v_zero=vz, out=poisoned(q.shape, q.dtype))
    want = reference(q, dequantize_block(kq, ks, kz), dequantize_block(vq, vs, vz), tables, meta)
    assert_close(out, want, 1e-5, "int8 pool vs its dequantized values")


@pytest.mark.parametrize("kv_layout", ["nhd", "hnd"])
def test_store_kvcache_writes_each_token_to_its_slot_and_nothing_else(kv_layout):
    num_blocks, block_size, H = 6, 8, 2
    k_cache = new_pool(1, num_blocks, block_size, H, HEAD_DIM, torch.float32, "cpu", kv_layout)[0].fill_(float("nan"))
    v_cache = new_pool(1, num_blocks, block_size, H, HEAD_DIM, torch.float32, "cpu", kv_layout)[0].fill_(float("nan"))
    k, v = torch.randn(5, H, HEAD_DIM), torch.randn(5, H, HEAD_DIM)
    slots = torch.tensor([17, 3, -1, 47, 0])  # -1: a padding token, no slot
    store_kvcache(k, v, k_cache, v_cache, slots)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            at = (s // block_size, s % block_size)
            assert torch.equal(k_cache[at], k[t]) and torch.equal(v_cache[at], v[t]), f"token {t} not in slot {s}"
    written = (~k_cache.isnan()).all(dim=(2, 3)).flatten()  # [blocks * block_size] slots
    assert written.nonzero().flatten().tolist() == [0, 3, 17, 47], "a slot outside the mapping was written"


def test_store_kvcache_writes_into_one_layer_of_the_pool():
    pool = torch.zeros(3, 4, 8, 2, HEAD_DIM, dtype=torch.float16)  # [layers, blocks, block_size, heads, dim]
    k = torch.randn(2, 2, HEAD_DIM).half()
    store_kvcache(k, k, pool[1], pool[1], torch.tensor([9, 30]))
    assert torch.equal(pool[1].view(-1, 2, HEAD_DIM)[[9, 30]], k)
    assert pool[0].abs().sum() == 0 and pool[2].abs().sum() == 0, "another layer was written"


def test_shape_errors_name_the_problem():
    k_cache, v_cache, tables = scattered_pool([10], 8, 2, torch.float32)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_decode_attention(torch.randn(1, 3, HEAD_DIM), k_cache, v_cache, tables, torch.tensor([10]), SCALE)
    with pytest.raises(ValueError, match="one row per sequence"):
        paged_decode_attention(torch.randn(2, 2, HEAD_DIM), k_cache, v_cache, tables, torch.tensor([10]), SCALE)
    with pytest.raises(ValueError, match="one slot per token"):
        store_kvcache(torch.randn(2, 2, HEAD_DIM), torch.randn(2, 2, HEAD_DIM), k_cache, v_cache, torch.tensor([1]))
