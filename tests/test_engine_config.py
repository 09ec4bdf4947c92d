"""One configuration object checks every option of LLM(...) before anything is loaded, and the facade
builds each rung from it; the named seams are options like the others."""
import pytest
import torch

from minikv import LLM, SamplingParams
from minikv.engine.config import (
    DEFAULT_GPU_KV_FRACTION,
    SEAMS,
    DeviceInfo,
    EngineConfig,
    ScratchShape,
    gpu_defaults,
    step_scratch_bytes,
)
from minikv.engine.cuda_graph import step_graph_tokens


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_num_seqs=0), "max_num_seqs must be an integer >= 1"),
    (dict(max_num_seqs=True), "max_num_seqs must be an integer >= 1"),
    (dict(max_model_len=0), "max_model_len must be an integer >= 1"),
    (dict(max_model_len=-1), "max_model_len must be an integer >= 1"),
    (dict(max_model_len=64.0), "max_model_len must be an integer >= 1"),
    (dict(kv_backend="paged", swap_blocks=2.0), "swap_blocks must be an integer >= 0"),
    (dict(kv_backend="paged", kv_cache_memory="1GB"), "kv_cache_memory must be an integer .* number of bytes"),
    (dict(kv_backend="paged", num_blocks=10**9), r"num_blocks=1,000,000,000 blocks .* GiB .* lower num_blocks"),
    (dict(kv_backend="paged", num_blocks=8, kv_cache_memory=2**20),
     "give num_blocks .* or kv_cache_memory .* not both"),
    (dict(dtype="float8"), "dtype must be one of float32, float16, bfloat16"),
    (dict(dtype=3), "dtype must be one of"),
    (dict(device="tpu"), "device must be 'cpu', 'cuda'"),
    (dict(seed=-1), r"seed must be an integer in \[0, 2\*\*63\)"),
    (dict(seed="abc"), "seed must be an integer"),
    (dict(block_size=8), "block_size is an option of the paged pool .* kv_backend is 'contiguous'"),
    (dict(num_blocks=8), "num_blocks is an option of the paged pool"),
    (dict(kv_backend="paged", enable_chunked_prefill="yes"), "enable_chunked_prefill must be True or False"),
    (dict(kv_backend="paged", cuda_graphs="on"), "cuda_graphs must be True, False or None"),
    (dict(kv_backend="paged", attention="torch", cuda_graphs=True), "cuda_graphs replays decode steps"),
    (dict(kv_backend="paged", prefix_caching="lru"), "prefix_caching must be None or one of hash, radix"),
    (dict(kv_backend="paged", eviction="random"), "eviction must be one of lru, fifo"),
    (dict(kv_backend="paged", schedule_policy="lpm"), "schedule_policy='lpm' .* turn prefix_caching on"),
    (dict(kv_backend="paged", attention="triton", dtype="bfloat16"), "interpreter on a CPU, whose bfloat16"),
    (dict(kv_backend="paged", preemption="swap", swap_blocks=0), "preemption='swap' needs a swap space"),
    (dict(kv_backend="paged", block_allocator=42), "block_allocator must be a class"),
    (dict(blok_size=16), "unknown option 'blok_size'; did you mean 'block_size'"),
    (dict(model=42), "model must be a name"),
])
def test_every_option_is_checked_with_a_message_naming_it(kwargs, message):
    model = kwargs.pop("model", "tiny-random")
    with pytest.raises(ValueError, match=message):
        LLM(model, **kwargs)


@pytest.mark.parametrize("seam", sorted(SEAMS))
def test_a_seam_given_to_a_rung_that_does_not_use_it_is_refused(seam):
    wrong_rung = "contiguous" if seam != "decode_step" else "naive"
    with pytest.raises(ValueError, match=f"{seam} plugs into rung"):
        LLM("tiny-random", kv_backend=wrong_rung, **{seam: lambda *a: None})


@pytest.mark.parametrize("seam", sorted(SEAMS))
def test_a_seam_must_be_a_function(seam):
    with pytest.raises(ValueError, match=f"{seam} must be a (function|class)"):
        EngineConfig.from_options(model="tiny-random", kv_backend="paged", **{seam: "not a function"})


def test_defaults_are_filled_in_once_the_model_is_known():
    cfg = EngineConfig.from_options(kv_backend="paged", block_size=4, num_blocks=10)
    cfg = cfg.fit(max_positions=2048, bytes_per_block=1024)
    assert (cfg.max_model_len, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.swap_blocks) == (40, 32, 512, 10)
    assert cfg.kv_layout == "nhd" and cfg.attention == "torch" and cfg.cuda_graphs is False
    contiguous = EngineConfig.from_options(kv_backend="contiguous")
    contiguous = contiguous.fit(max_positions=8192)
    assert (contiguous.max_model_len, contiguous.max_num_seqs) == (2048, 4)


def test_derive_shares_the_weights_and_keeps_the_options():
    llm = LLM("tiny-random", kv_backend="paged", block_size=4, num_blocks=32, max_num_seqs=3)
    other = llm.derive(prefix_caching="hash")
    assert other.model is llm.model
    assert other.scheduler.max_num_seqs == 3 and other.block_manager.num_blocks == 32
    assert other.prefix_cache is not None and llm.prefix_cache is None
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    assert other.generate([[3, 4, 5, 6]], params)[0].token_ids == llm.generate([[3, 4, 5, 6]], params)[0].token_ids


def test_observers_see_every_step_and_can_be_removed():
    llm = LLM("tiny-random", kv_backend="paged", block_size=4, num_blocks=32)
    seen = []

    class Watch:
        def on_schedule(self, engine, batch):
            seen.append(("schedule", len(batch)))

        def on_step(self, engine, batch, events):
            seen.append(("step", len(events)))

    remove = llm.add_observer(Watch())
    llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert seen[:2] == [("schedule", 2), ("step", 2)] and len(seen) == 6
    remove()
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    assert len(seen) == 6
    with pytest.raises(ValueError, match="an observer needs an on_schedule"):
        llm.add_observer(object())


# ---- defaults fitted to the device, checked on made-up cards ----------------------------------------
H100 = DeviceInfo("NVIDIA H100 80GB HBM3", total_memory=80 * 2**30, free_memory=78 * 2**30, num_sms=132)
L4 = DeviceInfo("NVIDIA L4", total_memory=24 * 2**30, free_memory=22 * 2**30, num_sms=58)
QWEN_05B = ScratchShape(hidden_size=896, intermediate_size=4864, vocab_size=151936, dtype_bytes=2)
QWEN_BLOCK = 16 * 24 * 2 * 2 * 64 * 2  # bytes of K and V of one 16-token block, 24 layers, 2 KV heads, bf16


def _fit(info, **options):
    cfg = EngineConfig.from_options(kv_backend="paged", device="cpu", dtype="float32", **options)
    return cfg.fit(max_positions=32768, bytes_per_block=QWEN_BLOCK, shape=QWEN_05B, info=info)


def test_a_large_gpu_gets_hundreds_of_sequences_a_budget_in_the_thousands_and_most_of_its_free_memory():
    cfg = _fit(H100)
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (512, 16384)
    pool = cfg.num_blocks * QWEN_BLOCK
    assert 0.75 * H100.free_memory < pool < DEFAULT_GPU_KV_FRACTION * H100.free_memory
    assert set(cfg.chosen) == {"max_num_seqs", "max_num_batched_tokens", "num_blocks"}
    assert "H100" in cfg.chosen["num_blocks"]


def test_a_smaller_gpu_gets_vllms_smaller_defaults():
    cfg = _fit(L4)
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (256, 8192)


def test_given_sizes_are_kept_and_not_reported_as_chosen():
    cfg = _fit(H100, max_num_seqs=64, max_num_batched_tokens=4096, num_blocks=1000)
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.num_blocks) == (64, 4096, 1000)
    assert cfg.chosen == {}


def test_a_small_pool_caps_the_sequences_so_each_can_hold_a_thousand_tokens():
    cfg = _fit(H100, kv_cache_memory=100 * QWEN_BLOCK)  # 1,600 tokens
    assert cfg.num_blocks == 100 and cfg.max_num_seqs == 1
    cfg = _fit(H100, kv_cache_memory=6400 * QWEN_BLOCK)  # 102,400 tokens: 100 sequences of 1,024
    assert cfg.max_num_seqs == 100


def test_a_pool_given_in_blocks_keeps_the_cards_seat_default():
    """num_blocks is the owner's choice (often small on purpose, to watch preemption): the seats are not cut
    to fit it, the scheduler preempts instead."""
    cfg = _fit(H100, num_blocks=20, block_size=4, max_model_len=80)
    assert cfg.num_blocks == 20 and cfg.max_num_seqs == 512


def test_the_scratch_reserve_grows_with_the_budget_and_the_vocabulary():
    small = step_scratch_bytes(QWEN_05B, 512, 8)
    assert step_scratch_bytes(QWEN_05B, 16384, 8) - small == (16384 - 512) * (6 * 896 + 3 * 4864) * 2
    assert step_scratch_bytes(QWEN_05B, 512, 256) - small == 8 * 248 * 151936 * 4


def test_the_reserve_counts_the_step_graphs_pool_and_no_graph_is_larger_than_a_step_can_be():
    """Step graphs keep their largest step's activations in their own pool, beside an eager step's: the
    pool leaves room for both. The largest graph is the bucket that holds the token budget, capped by
    cuda_graph_max_tokens and max_model_len: a budget of 3,000 tokens needs the graph of 3,072, not 8,192."""
    per_token = (6 * 896 + 3 * 4864) * 2
    assert step_scratch_bytes(QWEN_05B, 512, 8, graph_tokens=2048) - step_scratch_bytes(QWEN_05B, 512, 8) \
        == 2048 * per_token
    assert step_graph_tokens(8192, 16384, 32768) == 8192
    assert step_graph_tokens(8192, 3000, 32768) == 3072 and step_graph_tokens(8192, 1000, 32768) == 1024
    assert step_graph_tokens(8192, 16384, 4096) == 4096 and step_graph_tokens(0, 16384, 4096) == 0

    def pool(info, graph_tokens, budget=None):
        return gpu_defaults(info, QWEN_05B, QWEN_BLOCK, 16, 32768, None, budget, None,
                            graph_tokens=graph_tokens)["num_blocks"] * QWEN_BLOCK
    for info in (H100, L4):
        assert 0 <= pool(info, 0) - pool(info, 8192) - 8192 * per_token < QWEN_BLOCK
        assert 0 <= pool(info, 0, 3000) - pool(info, 8192, 3000) - 3072 * per_token < QWEN_BLOCK


def test_a_card_too_full_for_one_block_says_what_to_free():
    full = DeviceInfo("busy", total_memory=80 * 2**30, free_memory=2**30)
    with pytest.raises(ValueError, match="holds no block.*kv_cache_memory"):
        _fit(full)


def test_kv_backend_defaults_to_paged_on_a_gpu_and_contiguous_on_a_cpu():
    assert EngineConfig.from_options(device="cpu").kv_backend == "contiguous"
    llm = LLM("tiny-random", device="cpu")
    assert llm.kv_backend == "contiguous" and llm.stats()["config"]["max_num_seqs"] == 4
    if torch.cuda.is_available():
        assert EngineConfig.from_options(device="cuda").kv_backend == "paged"
