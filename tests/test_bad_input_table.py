"""One table of bad values across LLM(...), SamplingParams(...), prompts, calls and model files: every
one is a ValueError (or FileNotFoundError) whose message names the argument, and the engine serves
normally afterwards (same tokens as before, nothing queued, no block held)."""
import json

import pytest
import torch

from minikv import LLM, SamplingParams

# (what, value, the name the message must contain)
LLM_OPTIONS = [
    (dict(kv_backend="flash"), "kv_backend"),
    (dict(kv_backend=""), "kv_backend"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_seqs=2.5), "max_num_seqs"),
    (dict(max_num_seqs=True), "max_num_seqs"),
    (dict(max_model_len=0), "max_model_len"),
    (dict(max_model_len=-1), "max_model_len"),
    (dict(max_model_len="64"), "max_model_len"),
    (dict(max_model_len=10**6), "max_model_len"),
    (dict(seed=-1), "seed"),
    (dict(seed="abc"), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(dtype="float8"), "dtype"),
    (dict(dtype=torch.int8), "dtype"),
    (dict(device="tpu"), "device"),
    (dict(device="cuda:7"), "device"),
    (dict(kv_backend="paged", block_size=12), "block_size"),
    (dict(kv_backend="paged", block_size=2), "block_size"),
    (dict(kv_backend="paged", block_size="16"), "block_size"),
    (dict(kv_backend="paged", num_blocks=0), "num_blocks"),
    (dict(kv_backend="paged", num_blocks=10**9), "num_blocks"),
    (dict(kv_backend="paged", num_blocks=3.0), "num_blocks"),
    (dict(kv_backend="paged", kv_cache_memory="1GB"), "kv_cache_memory"),
    (dict(kv_backend="paged", kv_cache_memory=10), "kv_cache_memory"),
    (dict(kv_backend="paged", swap_blocks=2.0), "swap_blocks"),
    (dict(kv_backend="paged", swap_blocks=-1), "swap_blocks"),
    (dict(kv_backend="paged", max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(kv_backend="paged", enable_chunked_prefill="no"), "enable_chunked_prefill"),
    (dict(kv_backend="paged", preemption="drop"), "preemption"),
    (dict(kv_backend="paged", attention="flash"), "attention"),
    (dict(kv_backend="paged", kv_layout="headmajor"), "kv_layout"),
    (dict(kv_backend="paged", cuda_graphs="on"), "cuda_graphs"),
    (dict(kv_backend="paged", prefix_caching="lru"), "prefix_caching"),
    (dict(kv_backend="paged", prefix_caching="hash", eviction="random"), "eviction"),
    (dict(kv_backend="paged", schedule_policy="sjf"), "schedule_policy"),
    (dict(kv_backend="paged", block_allocator=42), "block_allocator"),
    (dict(kv_backend="paged", slot_mapping="mine"), "slot_mapping"),
    (dict(kv_backend="naive", slot_mapping=lambda *a: a), "slot_mapping"),
    (dict(kv_backend="contiguous", block_size=8), "block_size"),
    (dict(kv_backend="contiguous", prefix_caching="hash"), "prefix_caching"),
    (dict(blok_size=16), "blok_size"),
    (dict(kv_backend="paged", kv_cache_dtype="int4"), "kv_cache_dtype"),
    (dict(kv_backend="paged", kv_cache_dtype=torch.int8), "kv_cache_dtype"),
    (dict(kv_backend="contiguous", kv_cache_dtype="int8"), "kv_cache_dtype"),
    (dict(kv_backend="paged", kv_cache_dtype="int8", kv_quantizer="absmax"), "kv_quantizer"),
    (dict(kv_backend="paged", kv_quantizer=lambda x, dtype: (x, x)), "kv_quantizer"),
    (dict(kv_backend="paged", sliding_window=-4), "sliding_window"),
    (dict(kv_backend="paged", sliding_window=8, block_size=16), "sliding_window"),
    (dict(kv_backend="paged", sliding_window=16, sink_tokens=17), "sink_tokens"),
    (dict(kv_backend="paged", sliding_window=16, sink_tokens=-1), "sink_tokens"),
    (dict(kv_backend="paged", sink_tokens=4), "sink_tokens"),
    (dict(sliding_window=16), "sliding_window"),
    (dict(kv_backend="paged", window_free_rule=lambda *a: []), "window_free_rule"),
]
SAMPLING = [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(max_tokens=2.0), "max_tokens"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=1e-45), "temperature"),
    (dict(temperature="hot"), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(n=0), "n"),
    (dict(ignore_eos="no"), "ignore_eos"),
    (dict(stop=5), "stop"),
    (dict(stop=[""]), "stop"),
    (dict(priority="high"), "priority"),
    (dict(seed="abc"), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(seed=2**64 - 1, n=2), "seed"),
]
PROMPTS = [
    ([1.7, 2.0], "token"),
    ({"prompt_token_ids": "123"}, "prompt_token_ids"),
    (None, "prompt"),
    (5, "prompt"),
    ([[]], "prompt"),
    ([[1, 512]], "vocabulary"),
    ([[1] * 65], "max_model_len"),
    ({"prompt_token_ids": [1, 2], "cache_salt": 5}, "cache_salt"),
    ({"prompt_token_ids": [1, 2], "cache_salt": ["a"]}, "cache_salt"),
    ({"text": "hi"}, "prompt"),
    ("hello", "tokenizer"),
]


@pytest.fixture(scope="module")
def tiny():
    return LLM("tiny-random", kv_backend="contiguous", max_model_len=64)


@pytest.fixture(scope="module")
def baseline(tiny):
    return tiny.generate([[3, 4, 5]], SamplingParams(max_tokens=4))[0].token_ids


def serves_normally(llm: LLM, baseline: list[int]) -> None:
    assert not llm.has_unfinished()
    assert llm.generate([[3, 4, 5]], SamplingParams(max_tokens=4))[0].token_ids == baseline


def test_the_table_has_at_least_60_bad_values():
    assert len(LLM_OPTIONS) + len(SAMPLING) + len(PROMPTS) + len(CALLS) + len(MODEL_FILES) >= 60


@pytest.mark.parametrize("kwargs, name", LLM_OPTIONS, ids=[f"{i}-{name}" for i, (_, name) in enumerate(LLM_OPTIONS)])
def test_bad_engine_option(kwargs, name, tiny, baseline):
    with pytest.raises(ValueError, match=name):
        LLM("tiny-random", **kwargs)
    serves_normally(tiny, baseline)


@pytest.mark.parametrize("kwargs, name", SAMPLING, ids=[f"{i}-{name}" for i, (_, name) in enumerate(SAMPLING)])
def test_bad_sampling_value(kwargs, name, tiny, baseline):
    with pytest.raises(ValueError, match=name):
        tiny.generate([[3, 4, 5]], SamplingParams(**kwargs))
    serves_normally(tiny, baseline)


@pytest.mark.parametrize("prompt, name", PROMPTS, ids=[f"{i}-{name}" for i, (_, name) in enumerate(PROMPTS)])
def test_bad_prompt(prompt, name, tiny, baseline):
    with pytest.raises(ValueError, match=name):
        tiny.generate(prompt, SamplingParams(max_tokens=2))
    serves_normally(tiny, baseline)


CALLS = [
    (lambda llm: llm.abort(None), "abort"),
    (lambda llm: llm.generate([[1, 2]], [{"max_tokens": 3}]), "params"),
    (lambda llm: llm.generate([[1, 2]], {"max_tokens": 3}), "params"),
    (lambda llm: llm.generate([[1], [2]], [SamplingParams()] * 3), "SamplingParams"),
    (lambda llm: llm.generate([[1, 2]], SamplingParams(stop=["x"])), "stop"),
    (lambda llm: llm.beam_search([[1, 2]]), "beam search"),
    (lambda llm: llm.pin_prefix([1, 2]), "prefix_caching"),
]


@pytest.mark.parametrize("call, name", CALLS, ids=[str(i) for i in range(len(CALLS))])
def test_bad_call(call, name, tiny, baseline):
    with pytest.raises(ValueError, match=name):
        call(tiny)
    serves_normally(tiny, baseline)


def _write_checkpoint(folder, config: str | dict | None, weights: bytes | None = b"") -> str:
    folder.mkdir()
    if config is not None:
        (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if weights is not None:
        (folder / "model.safetensors").write_bytes(weights)
    return str(folder)


LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
         "num_attention_heads": 2}
MODEL_FILES = [
    ("corrupt_config", lambda d: _write_checkpoint(d, "{not json"), "config.json"),
    ("config_missing_field", lambda d: _write_checkpoint(d, {k: v for k, v in LLAMA.items() if k != "vocab_size"}),
     "vocab_size"),
    ("truncated_weights", lambda d: _write_checkpoint(d, LLAMA, b"\x10\x00\x00\x00"), "model.safetensors"),
    ("empty_gguf", lambda d: (d.mkdir(), (d / "m.gguf").write_bytes(b""), str(d / "m.gguf"))[-1], "m.gguf"),
    ("not_gguf", lambda d: (d.mkdir(), (d / "m.gguf").write_bytes(b"\x00" * 64), str(d / "m.gguf"))[-1], "m.gguf"),
    ("missing_path", lambda d: str(d / "nowhere"), "nowhere"),
]


@pytest.mark.parametrize("case, make, name", MODEL_FILES, ids=[c for c, _, _ in MODEL_FILES])
def test_bad_model_file(case, make, name, tmp_path, tiny, baseline):
    path = make(tmp_path / case)
    with pytest.raises((ValueError, FileNotFoundError), match=name):
        LLM(path)
    serves_normally(tiny, baseline)
