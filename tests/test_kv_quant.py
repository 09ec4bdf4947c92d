"""Rung 8: the quantized pool (int8 or fp8 e4m3; one float32 scale per token and KV head, and for int8
a float32 zero point: x ~ q * scale + zero).

The Triton kernels (interpreter on the CPU) equal the torch reference on int8 and fp8 pools: the store
kernel quantizes to the bit like `quantize_block`, the decode and prefill kernels equal attention over
the dequantized K/V on ragged lengths, three block sizes and a head_dim that is not a power of two.
In the engine, a quantized pool keeps the block manager's invariants through prefix caching, swap,
forks and beams, holds about twice the blocks of a 16-bit pool in the same memory, and SmolLM2's
greedy tokens stay those of the full-precision pool for most of a short run.
"""

import pytest
import torch

from minikv import LLM, SamplingParams
from minikv.attention.common import attend
from minikv.attention.metadata import AttentionMetadata
from minikv.cache.blocks.pool import KVPool, new_pool
from minikv.cache.blocks.quant import QMAX, dequantize_block, has_zero_point, quantize_block
from minikv.cache.blocks.swap import SwapSpace
from minikv.checks.decode_kernel import scattered_block_tables
from minikv.kernels import paged_decode_attention, paged_prefill_attention, store_kvcache

from engine_checks import checked

FP8 = torch.float8_e4m3fn
QDTYPES = [torch.int8, FP8]
HEAD_DIM = 32
SCALE = HEAD_DIM**-0.5


def with_outliers(shape, generator) -> torch.Tensor:
    """Normal values, a row of zeros, one channel 50x larger in a few rows (as keys have), a tiny negative value."""
    x = torch.randn(shape, generator=generator)
    x.view(-1, shape[-1])[0] = 0
    x.view(-1, shape[-1])[1::7, 3] *= 50
    x.view(-1, shape[-1])[1, 0] = -1e-7  # rounds to -0.0
    return x


@pytest.mark.parametrize("dtype", QDTYPES, ids=["int8", "fp8"])
def test_quantize_block_round_trip_stays_within_half_a_step_of_the_grid(dtype):
    x = with_outliers((6, 4, 2, HEAD_DIM), torch.Generator().manual_seed(0))
    x[1, 2, 1] = 0.75  # a constant row: int8 keeps it exactly in its zero point
    q, scale, zero = quantize_block(x, dtype)
    assert q.dtype == dtype and q.shape == x.shape and scale.shape == x.shape[:-1] and scale.dtype == torch.float32
    err = (dequantize_block(q, scale, zero) - x).abs()
    if dtype == torch.int8:  # the row's [min, max] onto [-127, 127]: a uniform grid of step `scale`
        hi, lo = x.amax(-1), x.amin(-1)
        assert torch.equal(zero, (hi + lo) / 2) and torch.equal(scale, (hi - lo) / 2 / 127)
        assert (q.amax(-1) == 127)[hi > lo].all() and (q.amin(-1) == -127)[hi > lo].all()  # every level in reach
        bound = scale[..., None] / 2 * (1 + 1e-5) + 1e-7
        assert torch.equal(dequantize_block(q, scale, zero)[1, 2, 1], x[1, 2, 1])
    else:  # symmetric; 3 mantissa bits: half an ulp is 1/16 of the value; the subnormals' step is 2^-9 of the scale
        assert zero is None and torch.equal(scale, x.abs().amax(-1) / QMAX[dtype])  # absmax lands on +-qmax
        bound = torch.maximum(x.abs() / 16, scale[..., None] * 2.0**-10) * (1 + 1e-5)
    assert (err <= bound).all(), f"worst excess {(err - bound).max():.3g}"
    assert dequantize_block(q, scale, zero)[0, 0, 0].eq(0).all()  # the zero row: scale 0, no NaN


def test_int8s_zero_point_halves_the_error_of_a_row_of_one_sign():
    g = torch.Generator().manual_seed(5)
    x = torch.rand(64, HEAD_DIM, generator=g) + 2.0  # values in [2, 3]: a symmetric grid spans [-3, 3]
    q, scale, zero = quantize_block(x, torch.int8)
    centred = (dequantize_block(q, scale, zero) - x).abs().max()
    absmax = x.abs().amax(-1, keepdim=True) / 127
    symmetric = ((torch.floor(x / absmax + 0.5) * absmax) - x).abs().max()
    assert centred < symmetric / 4  # range 1 instead of 6 over the same 254 steps


@pytest.mark.parametrize("kv_layout", ["nhd", "hnd"])
@pytest.mark.parametrize("dtype", QDTYPES, ids=["int8", "fp8"])
def test_store_kernel_quantizes_each_token_to_the_bit_like_quantize_block(dtype, kv_layout):
    g = torch.Generator().manual_seed(1)
    T, H, num_blocks, bs = 21, 2, 8, 4
    k, v = with_outliers((T, H, HEAD_DIM), g), 3 * with_outliers((T, H, HEAD_DIM), g)
    k_cache = new_pool(1, num_blocks, bs, H, HEAD_DIM, dtype, "cpu", kv_layout)[0]
    v_cache = new_pool(1, num_blocks, bs, H, HEAD_DIM, dtype, "cpu", kv_layout)[0]
    k_scale, v_scale, k_zero, v_zero = torch.full((4, num_blocks, bs, H), -1.0).unbind(0)
    if not has_zero_point(dtype):
        k_zero = v_zero = None
    slots = torch.randperm(num_blocks * bs, generator=g)[:T]
    slots[5] = -1  # a padding token: nothing stored
    store_kvcache(k, v, k_cache, v_cache, slots, k_scale, v_scale, k_zero, v_zero)
    keep = slots >= 0
    for x, cache, scale, zero in [(k, k_cache, k_scale, k_zero), (v, v_cache, v_scale, v_zero)]:
        want_q, want_s, want_z = quantize_block(x[keep], dtype)
        got_q = cache[slots[keep] // bs, slots[keep] % bs]
        assert torch.equal(got_q.view(torch.int8), want_q.view(torch.int8))  # bit for bit
        assert torch.equal(scale[slots[keep] // bs, slots[keep] % bs], want_s)
        untouched = ~torch.isin(torch.arange(num_blocks * bs), slots[keep])
        assert (scale.reshape(num_blocks * bs, H)[untouched] == -1).all()
        if zero is not None:
            assert torch.equal(zero[slots[keep] // bs, slots[keep] % bs], want_z)
            assert (zero.reshape(num_blocks * bs, H)[untouched] == -1).all()


def quantized_pool(seq_lens, block_size, num_kv_heads, dtype, seed, head_dim=HEAD_DIM):
    """Random K/V (keys with outliers, values off-centre) quantized into a pool whose blocks are shuffled
    among the sequences (-1 padded tables): (k, v, {k_scale, v_scale, k_zero, v_zero}, tables)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks, tables = scattered_block_tables(seq_lens, block_size, 3, g)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k, ks, kz = quantize_block(with_outliers(shape, g), dtype)
    v, vs, vz = quantize_block(torch.randn(shape, generator=g) + 0.5, dtype)
    return k, v, dict(k_scale=ks, v_scale=vs, k_zero=kz, v_zero=vz), tables


def reference(q, k, v, params, tables, meta):
    """Rung 4's math on the dequantized K/V, in float64."""
    B, L = meta.num_seqs, meta.max_seq_len
    t = tables.clamp(min=0)
    keys = dequantize_block(k, params["k_scale"], params["k_zero"])[t].reshape(B, -1, *k.shape[2:])[:, :L]
    values = dequantize_block(v, params["v_scale"], params["v_zero"])[t].reshape(B, -1, *v.shape[2:])[:, :L]
    return attend(q.double(), keys.double(), values.double(), meta, k.shape[-1] ** -0.5)


# (block_size, head_dim): three block sizes, and a head_dim that is not a power of two (padded channels)
POOL_SHAPES = [(4, HEAD_DIM), (16, HEAD_DIM), (8, 24)]


@pytest.mark.parametrize("block_size, head_dim", POOL_SHAPES)
@pytest.mark.parametrize("dtype", QDTYPES, ids=["int8", "fp8"])
def test_triton_decode_on_a_quantized_pool_equals_attention_over_the_dequantized_kv(dtype, block_size, head_dim):
    seq_lens = [1, block_size, 3 * block_size + 1, 37]
    k, v, params, tables = quantized_pool(seq_lens, block_size, 2, dtype, seed=block_size, head_dim=head_dim)
    meta = AttentionMetadata.build([1] * len(seq_lens), seq_lens)
    q = torch.randn(len(seq_lens), 4, head_dim, generator=torch.Generator().manual_seed(2))
    num_splits = 1 if block_size == 16 else 3  # the single-split path and split-K
    out = paged_decode_attention(q, k, v, tables, meta.seq_lens, head_dim**-0.5, num_splits=num_splits, **params)
    assert (out.double() - reference(q, k, v, params, tables, meta)).abs().max() < 2e-6


@pytest.mark.parametrize("block_size, head_dim", POOL_SHAPES)
@pytest.mark.parametrize("dtype", QDTYPES, ids=["int8", "fp8"])
def test_triton_prefill_on_a_quantized_pool_equals_attention_over_the_dequantized_kv(dtype, block_size, head_dim):
    query_lens, seq_lens = [9, 1, 12, 3], [9, 5, 2 * block_size + 7, 30]  # prompt, decode row, chunk, cached prefix
    k, v, params, tables = quantized_pool(seq_lens, block_size, 2, dtype, seed=block_size + 1, head_dim=head_dim)
    meta = AttentionMetadata.build(query_lens, seq_lens)
    q = torch.randn(sum(query_lens), 4, head_dim, generator=torch.Generator().manual_seed(3))
    out = paged_prefill_attention(q, k, v, tables, meta.query_start_loc, meta.seq_lens, head_dim**-0.5, **params)
    assert (out.double() - reference(q, k, v, params, tables, meta)).abs().max() < 2e-6


def test_kernels_refuse_an_int8_pool_without_its_zero_points():
    k, v, params, tables = quantized_pool([5], 4, 2, torch.int8, seed=0)
    with pytest.raises(ValueError, match="needs zero points"):
        store_kvcache(torch.randn(1, 2, HEAD_DIM), torch.randn(1, 2, HEAD_DIM), k, v, torch.tensor([0]),
                      params["k_scale"], params["v_scale"])
    with pytest.raises(ValueError, match="K and V both"):
        paged_decode_attention(torch.randn(1, 4, HEAD_DIM), k, v, tables, torch.tensor([5]), SCALE,
                               k_scale=params["k_scale"], v_scale=params["v_scale"], k_zero=params["k_zero"])


def test_kernels_refuse_an_8bit_pool_without_scales():
    k = torch.zeros(4, 4, 2, HEAD_DIM, dtype=torch.int8)
    with pytest.raises(ValueError, match="needs scales"):
        store_kvcache(torch.randn(1, 2, HEAD_DIM), torch.randn(1, 2, HEAD_DIM), k, k.clone(), torch.tensor([0]))


@pytest.mark.parametrize("dtype", QDTYPES, ids=["int8", "fp8"])
def test_copy_on_write_and_swap_move_the_scales_with_the_blocks(dtype):
    pool = KVPool(2, 6, 4, 2, HEAD_DIM, torch.float32, "cpu", cache_dtype=dtype)
    g = torch.Generator().manual_seed(4)
    for layer in range(2):
        pool.store(layer, torch.randn(24, 2, HEAD_DIM, generator=g), torch.randn(24, 2, HEAD_DIM, generator=g),
                   torch.arange(24))
    before = [p.clone() for p in pool.planes]
    pool.copy_blocks([(1, 4)])
    for p, b in zip(pool.planes, before):
        assert torch.equal(p[:, 4].view(torch.uint8) if p.dtype == dtype else p[:, 4],
                           b[:, 1].view(torch.uint8) if b.dtype == dtype else b[:, 1])
    swap = SwapSpace(pool, 3)
    cpu = swap.swap_out([0, 2])
    for p in pool.planes:
        p[:, [0, 2]] = torch.zeros((), dtype=p.dtype)
    swap.swap_in(cpu, [0, 2])
    for p, b in zip(pool.planes, before):
        assert torch.equal(p[:, [0, 2]].float(), b[:, [0, 2]].float())
    assert len(pool.planes) == (6 if dtype == torch.int8 else 4)  # int8 adds its zero points
    with pytest.raises(ValueError, match="K scales"):
        pool.write_blocks([0], *pool.read_blocks([0])[:2])


def test_a_quantizer_that_returns_the_wrong_parts_is_refused_with_the_expected_shapes():
    pool = KVPool(1, 4, 4, 2, HEAD_DIM, torch.float32, "cpu", cache_dtype=torch.int8,
                  quantizer=lambda x, dtype: quantize_block(x, dtype)[:2])  # (q, scale): no zero point
    with pytest.raises(ValueError, match=r"returns \(q, scale, zero\)"):
        pool.store(0, torch.randn(3, 2, HEAD_DIM), torch.randn(3, 2, HEAD_DIM), torch.arange(3))
    pool.quantizer = lambda x, dtype: (*quantize_block(x, dtype)[:2], None)
    with pytest.raises(ValueError, match=r"a zero point of the same shape on a torch.int8 pool"):
        pool.store(0, torch.randn(3, 2, HEAD_DIM), torch.randn(3, 2, HEAD_DIM), torch.arange(3))


def test_a_quantized_pool_holds_about_twice_the_blocks_of_a_16_bit_pool_in_the_same_memory():
    def stats(dtype, kv_cache_dtype):
        llm = LLM("tiny-random", kv_backend="paged", dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                  kv_cache_memory=2**20)
        return llm.stats()

    half, q8, f8, full = stats("float16", "auto"), stats("float16", "int8"), stats("float16", "fp8"), stats(
        "float32", "int8")
    head_dim = LLM("tiny-random").config.head_dim
    assert (half["kv_cache_dtype"], q8["kv_cache_dtype"], f8["kv_cache_dtype"]) == ("float16", "int8", "float8_e4m3fn")
    # per token and KV head: 2 * head_dim bytes at 16 bits; head_dim + 4 (the scale) in fp8, + 4 more (the
    # zero point) in int8
    assert f8["bytes_per_token"] / half["bytes_per_token"] == (head_dim + 4) / (2 * head_dim)
    assert q8["bytes_per_token"] / half["bytes_per_token"] == (head_dim + 8) / (2 * head_dim)
    assert q8["num_blocks"] == full["num_blocks"]  # the model's dtype no longer matters
    for quant, row in [(q8, head_dim + 8), (f8, head_dim + 4)]:
        assert quant["num_blocks"] == 2**20 // (quant["bytes_per_token"] * quant["block_size"])
        assert 2 * half["num_blocks"] * head_dim // row - 1 <= quant["num_blocks"] <= 2 * half["num_blocks"]


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_triton_and_torch_attention_generate_the_same_tokens_on_a_quantized_pool(kv_cache_dtype):
    prompts = [list(range(1, 12)), [5, 6, 7] * 5]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    runs = [[o.token_ids for o in LLM("tiny-random", kv_backend="paged", block_size=4, num_blocks=48, attention=att,
                                      kv_cache_dtype=kv_cache_dtype).generate(prompts, params)]
            for att in ("torch", "triton")]
    assert runs[0] == runs[1]


def test_prefix_caching_swap_forks_and_beams_run_on_a_quantized_pool_and_keep_the_invariants():
    prefix = list(range(3, 27))
    prompts = [prefix + [40 + i] for i in range(4)]
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=7, n=2, ignore_eos=True)
    roomy = checked(LLM("tiny-random", kv_backend="paged", block_size=4, num_blocks=96, kv_cache_dtype="int8",
                        prefix_caching="hash"))
    want = [[c.token_ids for c in o.outputs] for o in roomy.generate(prompts, params)]
    # the same on a pool so small that requests are swapped out and back in
    tight = checked(roomy.derive(num_blocks=22, preemption="swap", max_num_seqs=8))
    got = [[c.token_ids for c in o.outputs] for o in tight.generate(prompts, params)]
    stats = tight.stats()
    assert stats["num_swaps"] > 0 and stats["forks"] > 0 and stats["prefix_cache"]["hits"] > 0
    assert got == want  # swapped blocks come back with their scales, to the bit
    beams = [[[c.token_ids for c in o.outputs] for o in llm.beam_search([prefix], beam_width=3, max_tokens=6)]
             for llm in (roomy, tight)]
    assert tight.stats()["forks"] > 0 and beams[0] == beams[1]


@pytest.mark.slow
def test_smollm2_greedy_tokens_on_a_quantized_pool_follow_the_full_precision_pool():
    prompts = ["The capital of France is", "Water boils at a temperature of", "The three primary colors are"]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    full = LLM("smollm2-135m", kv_backend="paged", block_size=16, num_blocks=32)
    want = [o.token_ids for o in full.generate(prompts, params)]

    def agreement(kv_cache_dtype):  # tokens before the first difference, as a fraction of the run
        got = [o.token_ids for o in full.derive(kv_cache_dtype=kv_cache_dtype).generate(prompts, params)]
        first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(got, want)]
        return sum(first) / (len(prompts) * params.max_tokens)

    assert agreement("int8") >= 0.85
    assert agreement("fp8") >= 0.5  # e4m3 keeps 3 mantissa bits: it drifts sooner (benchmarks/RESULTS.md)


def test_fp8_is_refused_with_the_reason_where_torch_has_no_float8_types(monkeypatch):
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' needs float8.*use kv_cache_dtype='int8'"):
        LLM("tiny-random", kv_backend="paged", kv_cache_dtype="fp8")
