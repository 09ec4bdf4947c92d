"""Rung 7 in the engine: the Triton backend generates the same greedy tokens as the torch paged
backend (rung 4) on tiny-random, through prefill, chunked prefill, mixed and decode-only steps.

Kernels run in Triton's interpreter on the CPU (tests/conftest.py sets TRITON_INTERPRET=1 there, before
anything imports triton) and compiled on a GPU.
"""
import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from minikv.attention.metadata import PagedMetadata  # noqa: E402
from minikv.attention.paged import PagedBackend  # noqa: E402
from minikv.attention.triton_backend import TritonPagedBackend  # noqa: E402
from minikv.cache.blocks.pool import KVPool  # noqa: E402
from minikv.model.loader import load_model  # noqa: E402

BLOCK_SIZE, NUM_BLOCKS = 8, 40


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random")


def greedy_run(model, backend, prompts, max_new_tokens, chunk, seed=0):
    """A minimal engine loop, as ModelRunner does it: one flattened model call per step.

    Each prompt is prefilled in chunks of at most `chunk` tokens, sequences start one step apart
    (so prefill and decode rows mix), blocks come from a shuffled free list.
    Returns the generated tokens and the logits of every sampled token.
    """
    free = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(free)
    seqs = [{"ids": list(p), "done": 0, "table": [], "new": [], "prompt": len(p)} for p in prompts]
    logits_seen = []
    step = 0
    while any(len(s["new"]) < max_new_tokens for s in seqs):
        ids, pos, qlens, slens, slots, tables, running, sample = [], [], [], [], [], [], [], []
        for s in seqs[: step + 1]:
            if len(s["new"]) >= max_new_tokens:
                continue
            n = min(chunk, len(s["ids"]) - s["done"])
            start, end = s["done"], s["done"] + n
            while len(s["table"]) * BLOCK_SIZE < end:
                s["table"].append(free.pop())
            ids += s["ids"][start:end]
            pos += range(start, end)
            slots += [s["table"][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]
            qlens.append(n)
            slens.append(end)
            tables.append(s["table"])
            running.append(s)
            if end == len(s["ids"]):  # the whole known sequence computed: sample its next token
                sample.append(len(qlens) - 1)
        width = max(len(t) for t in tables)
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
        meta = PagedMetadata.build(qlens, slens, "cpu", slot_mapping=as_long(slots),
                                   block_tables=as_long([t + [-1] * (width - len(t)) for t in tables]))
        last = (meta.query_start_loc[1:] - 1)[sample]
        with torch.inference_mode():
            logits = model(as_long(ids), as_long(pos), meta, backend, logits_indices=last)
        for s, n in zip(running, qlens):
            s["done"] += n
        for row, lg in zip(sample, logits):
            token = int(lg.argmax())
            running[row]["ids"].append(token)
            running[row]["new"].append(token)
            logits_seen.append(lg)
        step += 1
    return [s["new"] for s in seqs], torch.stack(logits_seen)


def make_backend(cls, cfg, dtype=torch.float32, sliding_window=None, kv_layout=None, **kw):
    """A backend on its own pool (layout: the engine's default for that attention unless given)."""
    kv_layout = kv_layout or ("hnd" if cls is TritonPagedBackend else "nhd")
    pool = KVPool(cfg.num_layers, NUM_BLOCKS, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, dtype, "cpu", kv_layout)
    return cls(pool, sliding_window, **kw)


def test_the_pool_layouts_index_alike_and_store_the_heads_in_their_own_order(tiny):
    """kv_layout changes only the storage order: "hnd" keeps each KV head's block contiguous; both
    backends write either layout to the same slots."""
    cfg = tiny.config
    nhd, hnd = make_backend(PagedBackend, cfg), make_backend(TritonPagedBackend, cfg, kv_layout="hnd")
    assert nhd.pool.k_cache.shape == hnd.pool.k_cache.shape == (cfg.num_layers, NUM_BLOCKS, BLOCK_SIZE,
                                                                cfg.num_kv_heads, cfg.head_dim)
    assert nhd.pool.k_cache.stride()[2:] == (cfg.num_kv_heads * cfg.head_dim, cfg.head_dim, 1)  # slot, head, dim
    assert hnd.pool.k_cache.stride()[2:] == (cfg.head_dim, BLOCK_SIZE * cfg.head_dim, 1)
    k = torch.randn(3, cfg.num_kv_heads, cfg.head_dim, device=hnd.pool.device)
    for b in (nhd, hnd):
        b.store(1, k, -k, torch.tensor([5, 17, 40], device=hnd.pool.device))
    assert torch.equal(nhd.pool.k_cache, hnd.pool.k_cache) and torch.equal(nhd.pool.v_cache, hnd.pool.v_cache)
    assert torch.equal(hnd.pool.k_cache[1, 2, 1], k[1])  # slot 17 = block 2, offset 1
    with pytest.raises(ValueError, match="kv_layout"):
        make_backend(PagedBackend, cfg, kv_layout="hdn")


@pytest.mark.slow  # over 6 s on a 2-core machine: make test runs it, make test-fast leaves it out
@pytest.mark.parametrize("kv_layout, query_rows_impl", [("hnd", "grouped"), ("nhd", "decode")])
def test_triton_backend_generates_the_same_greedy_tokens_as_the_torch_paged_backend(tiny, kv_layout, query_rows_impl):
    """Every step here has at most 12 new tokens per sequence: the query-row path, by either kernel."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, tiny.config.vocab_size, (n,), generator=g).tolist() for n in (19, 1, 8, 30)]
    want, want_logits = greedy_run(tiny.model, make_backend(PagedBackend, tiny.config), prompts, 6, chunk=12)
    backend = make_backend(TritonPagedBackend, tiny.config, kv_layout=kv_layout)
    backend.query_rows_impl = query_rows_impl
    have, have_logits = greedy_run(tiny.model, backend, prompts, 6, chunk=12)
    assert have == want
    assert (have_logits - want_logits).abs().max() < 1e-3


def test_triton_backend_with_a_sliding_window_matches_the_torch_paged_backend(tiny):
    prompts = [list(range(3, 40)), list(range(100, 111))]
    want, _ = greedy_run(tiny.model, make_backend(PagedBackend, tiny.config, sliding_window=6), prompts, 4, chunk=16)
    have, _ = greedy_run(tiny.model, make_backend(TritonPagedBackend, tiny.config, sliding_window=6), prompts, 4,
                         chunk=16)
    assert have == want


def test_triton_backend_float16_pool_stays_close_to_float32_reference(tiny):
    prompts = [list(range(5, 22)), list(range(200, 203))]
    _, want = greedy_run(tiny.model, make_backend(PagedBackend, tiny.config), prompts, 3, chunk=32)
    backend = make_backend(TritonPagedBackend, tiny.config, dtype=torch.float16)
    # the model stays fp32; only the cache is fp16 (K/V rounded on store, attention in fp16 dots)
    _, have = greedy_run(tiny.model, backend, prompts, 3, chunk=32)
    assert (have - want).abs().max() < 0.1


@pytest.mark.slow  # over 6 s on a 2-core machine: make test runs it, make test-fast leaves it out
def test_llm_with_triton_attention_generates_the_same_tokens_as_torch_attention():
    from minikv.engine.llm import LLM
    from minikv.engine.sampling_params import SamplingParams

    prompts = [list(range(10, 31)), [7], list(range(50, 59))]
    params = SamplingParams(max_tokens=5, ignore_eos=True) if "ignore_eos" in SamplingParams.__dataclass_fields__ \
        else SamplingParams(max_tokens=5)
    outs = {}
    for attention, kv_layout in (("torch", None), ("triton", None), ("torch", "hnd"), ("triton", "nhd")):
        llm = LLM("tiny-random", device="cpu", kv_backend="paged", attention=attention, block_size=8, num_blocks=32,
                  max_num_batched_tokens=16, kv_layout=kv_layout)
        assert llm.backend.pool.kv_layout == (kv_layout or {"torch": "nhd", "triton": "hnd"}[attention])
        outs[attention, kv_layout] = [o.token_ids for o in llm.generate(prompts, params)]
    assert all(o == outs["torch", None] for o in outs.values()), outs


def test_bfloat16_pool_is_refused_on_the_cpu(tiny):
    with pytest.raises(ValueError, match="float32 or float16"):
        make_backend(TritonPagedBackend, tiny.config, dtype=torch.bfloat16)


@pytest.mark.parametrize("prefix_caching", ["hash", "radix"])
def test_llm_with_triton_attention_and_prefix_caching_generates_the_same_tokens(prefix_caching):
    """Prompts sharing a cached prefix: the prefill kernel starts mid-sequence, over blocks it did not write."""
    from minikv.engine.llm import LLM
    from minikv.engine.sampling_params import SamplingParams

    shared = list(range(30, 54))  # three full blocks of 8
    prompts = [shared + [1, 2, 3], shared + [9], shared + list(range(60, 71))]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    outs = {}
    for attention in ("torch", "triton"):
        llm = LLM("tiny-random", device="cpu", kv_backend="paged", attention=attention, block_size=8, num_blocks=48,
                  max_num_batched_tokens=64, prefix_caching=prefix_caching)
        llm.generate(prompts[:1], params)  # warm the cache with the shared prefix
        outs[attention] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["triton"] == outs["torch"]


@triton.jit
def _inner_loop_without_rescale(q, k, v, valid, m_i, l_i, acc, scale_log2e, DOT_PRECISION: tl.constexpr):
    """online_softmax_block with a classic bug: what was summed is never rescaled when the max grows."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    return m_new, l_i + tl.sum(p, axis=1), acc + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)


def test_decode_inner_loop_reaches_the_decode_kernel(tiny):
    """The rung-7 seam: TritonPagedBackend(decode_inner_loop=fn) decodes with fn; None keeps the kernel's own."""
    from minikv.kernels.decode_attention import online_softmax_block

    cfg = tiny.config
    pool = KVPool(1, NUM_BLOCKS, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu", "hnd")
    g = torch.Generator().manual_seed(3)
    pool.k_cache.copy_(torch.randn(pool.k_cache.shape, generator=g))
    pool.v_cache.copy_(torch.randn(pool.v_cache.shape, generator=g))
    seq_lens = [100, 37]  # a split of 100 positions runs several tiles: the running max grows
    tables = torch.tensor([list(range(13)), list(range(20, 25)) + [-1] * 8])
    meta = PagedMetadata.build([1, 1], seq_lens, slot_mapping=torch.tensor([-1, -1]), block_tables=tables)
    q = torch.randn(2, cfg.num_heads, cfg.head_dim, generator=g) * 4
    k = v = torch.zeros(2, cfg.num_kv_heads, cfg.head_dim)  # slot -1: nothing stored

    def decode(loop):
        backend = TritonPagedBackend(pool, decode_inner_loop=loop)
        backend.decode_num_splits = 1
        return backend.forward(0, q, k, v, meta, cfg.head_dim**-0.5)

    want = decode(None)
    assert torch.equal(decode(online_softmax_block), want)
    assert (decode(_inner_loop_without_rescale) - want).abs().max() > 1e-2, "the backend ignored decode_inner_loop"
