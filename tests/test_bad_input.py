"""Bad input gets a clear error that names the limit and the fix, and leaves nothing behind."""
import pytest

from minikv import LLM, SamplingParams


@pytest.fixture(scope="module")
def tiny():
    return LLM("tiny-random", kv_backend="contiguous", max_model_len=64)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(temperature=-0.5), "temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-1), "top_k must be an integer >= 0"),
    (dict(n=0), "n must be an integer >= 1"),
    (dict(stop=[""]), "stop strings must be non-empty"),
])
def test_sampling_params_are_validated_when_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_empty_prompt(tiny):
    with pytest.raises(ValueError, match="prompt is empty"):
        tiny.generate([[]])


def test_prompt_longer_than_max_model_len_names_both_numbers_and_the_fix(tiny):
    with pytest.raises(ValueError,
                       match="prompt has 65 tokens but max_model_len is 64; raise max_model_len or shorten"):
        tiny.generate([[1] * 65])


def test_token_outside_vocabulary(tiny):
    with pytest.raises(ValueError, match=r"token id 512 is outside the vocabulary \[0, 512\)"):
        tiny.generate([[1, 512]])


def test_string_prompt_without_tokenizer(tiny):
    with pytest.raises(ValueError, match="without a tokenizer; pass prompts as lists of token ids"):
        tiny.generate("hello")


def test_one_bad_prompt_in_a_list_queues_nothing(tiny):
    with pytest.raises(ValueError, match="prompt is empty"):
        tiny.generate([[1, 2, 3], []])
    assert not tiny.has_unfinished()
    assert tiny.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids


def test_prompts_and_params_of_different_lengths(tiny):
    with pytest.raises(ValueError, match="got 2 prompts but 3 SamplingParams"):
        tiny.generate([[1], [2]], [SamplingParams()] * 3)


@pytest.mark.parametrize("kwargs, message", [
    (dict(kv_backend="flash"), "unknown kv_backend 'flash'"),
    (dict(kv_backend="paged", block_size=12), "block_size must be a power of two"),
    (dict(kv_backend="paged", block_size=2), "block_size must be a power of two in \\[4, 1024\\]"),
    (dict(kv_backend="paged", num_blocks=0), "num_blocks must be an integer >= 1"),
    (dict(kv_backend="paged", num_blocks=3, block_size=16, max_model_len=64),
     "holds 48 tokens, too small for one request of max_model_len=64; raise num_blocks .* to at least 4"),
    (dict(kv_backend="paged", kv_cache_memory=10), "holds no block"),
    (dict(kv_backend="paged", max_num_batched_tokens=0), "max_num_batched_tokens must be an integer >= 1"),
    (dict(kv_backend="paged", max_model_len=256, enable_chunked_prefill=False, max_num_batched_tokens=100),
     "max_num_batched_tokens=100 is smaller than max_model_len=256.*enable_chunked_prefill=True"),
    (dict(kv_backend="paged", preemption="drop"), "preemption must be one of recompute, swap"),
    (dict(kv_backend="contiguous", attention="triton"), "attention='triton' runs on the paged pool"),
    (dict(kv_backend="contiguous", kv_layout="hnd"),
     "kv_layout is an option of the paged pool .* use kv_backend='paged'"),
    (dict(kv_backend="paged", kv_layout="headmajor"), "kv_layout must be (None or )?one of nhd, hnd"),
    (dict(max_model_len=10**6), "exceeds the model's 2,?048 positions"),
])
def test_engine_options_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM("tiny-random", **kwargs)


def test_request_that_can_never_fit_the_pool_is_refused_at_submission_and_others_are_served():
    llm = LLM("tiny-random", kv_backend="paged", num_blocks=4, block_size=8)  # 32 tokens in all
    good = llm.add_request([1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="prompt has 40 tokens but the KV pool holds only 32 .* it can never fit"):
        llm.add_request(list(range(40)), SamplingParams(max_tokens=4))
    other = llm.add_request([4, 5], SamplingParams(max_tokens=4))
    while llm.has_unfinished():
        llm.step()
    assert len(good.output_token_ids) == 4 and len(other.output_token_ids) == 4
    assert llm.block_manager.num_free_blocks == 4


def test_generation_stops_at_max_model_len_with_reason_length():
    llm = LLM("tiny-random", kv_backend="paged", num_blocks=2, block_size=8)  # pool and max_model_len: 16
    out = llm.generate([[1] * 10], SamplingParams(max_tokens=50, ignore_eos=True))[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"


def test_broken_allocator_raises_instead_of_hanging():
    class Forgetful:
        """Never takes blocks back: the engine must say it is stuck, not spin forever."""

        def __init__(self, num_blocks):
            self.num_blocks, self.left = num_blocks, list(range(num_blocks))

        def allocate(self):
            return self.left.pop()

        def free(self, block_id):
            pass

        @property
        def num_free_blocks(self):
            return len(self.left)

    llm = LLM("tiny-random", kv_backend="paged", num_blocks=4, block_size=4, block_allocator=Forgetful)
    with pytest.raises(RuntimeError, match="could run nothing this step"):
        llm.generate([[1] * 10, [2] * 10, [3] * 10], SamplingParams(max_tokens=5, ignore_eos=True))


# ---- issue 11: every bad value is a ValueError (or FileNotFoundError) naming the argument, and the
# engine serves normally afterwards

BAD_SAMPLING = [
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=1e-45), "temperature"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(ignore_eos="no"), "ignore_eos"),
    (dict(stop=5), "stop"),
    (dict(priority="high"), "priority"),
    (dict(seed="abc"), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(seed=2**64 - 1, n=2), "seed"),
    (dict(top_k=1.5), "top_k"),
    (dict(n=1.0), "n must be"),
]


@pytest.mark.parametrize("kwargs, names", BAD_SAMPLING, ids=[repr(k) for k, _ in BAD_SAMPLING])
def test_bad_sampling_value_names_its_argument(tiny, kwargs, names):
    with pytest.raises(ValueError, match=names):
        tiny.generate([[1, 2, 3]], SamplingParams(**{"max_tokens": 2, **kwargs}))
    assert len(tiny.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids) == 2


BAD_PROMPTS = [
    ([1.7, 2], r"prompt\[0\] is 1.7"),
    ([1, True], r"prompt\[1\] is True"),
    ({"prompt_token_ids": "123"}, "prompt_token_ids must be a list of token ids"),
    (None, "a prompt is text, a list of token ids or a dict"),
    (5, "a prompt is text, a list of token ids or a dict"),
    ({"prompt_token_ids": [1], "cache_salt": 1}, "cache_salt must be a string or None"),
    ({"prompt_token_ids": [1], "cache_salt": [1]}, "cache_salt must be a string or None"),
    ({"prompt_ids": [1]}, "a dict prompt needs exactly one of 'prompt'"),
]


@pytest.mark.parametrize("prompt, message", BAD_PROMPTS, ids=[repr(p) for p, _ in BAD_PROMPTS])
def test_bad_prompt_names_what_to_pass(tiny, prompt, message):
    with pytest.raises(ValueError, match=message):
        tiny.add_request(prompt, SamplingParams(max_tokens=2))
    assert not tiny.has_unfinished()
    assert len(tiny.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids) == 2


def _checkpoint(path):
    import json

    from safetensors.torch import save_file

    from minikv.model.config import ModelConfig
    from minikv.model.llama import LlamaForCausalLM
    from minikv.model.named import TINY_RANDOM_CONFIG

    path.mkdir()
    model = LlamaForCausalLM(ModelConfig.from_hf(TINY_RANDOM_CONFIG))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(TINY_RANDOM_CONFIG))
    return path


def _break(tmp_path, how):
    if how in ("random.gguf", "empty.gguf"):
        f = tmp_path / "model.gguf"
        f.write_bytes(bytes(range(256)) * 64 if how == "random.gguf" else b"")
        return f
    ckpt = _checkpoint(tmp_path / "ckpt")
    if how == "corrupt config":
        (ckpt / "config.json").write_text("{ not json")
    elif how == "config without heads":
        (ckpt / "config.json").write_text((ckpt / "config.json").read_text().replace('"num_attention_heads"', '"x"'))
    elif how == "truncated weights":
        w = ckpt / "model.safetensors"
        w.write_bytes(w.read_bytes()[:1000])
    return ckpt


@pytest.mark.parametrize("how, error, message", [
    ("random.gguf", ValueError, "model.gguf is not a GGUF file"),
    ("empty.gguf", ValueError, r"model.gguf is empty \(0 bytes\)"),
    ("corrupt config", ValueError, "config.json is not valid JSON"),
    ("config without heads", ValueError, "config.json is missing 'num_attention_heads'"),
    ("truncated weights", ValueError, "could not read the weights in .*model.safetensors"),
])
def test_broken_model_file_is_named(tmp_path, monkeypatch, how, error, message):
    monkeypatch.setenv("MINIKV_CACHE", str(tmp_path / "cache"))
    with pytest.raises(error, match=message):
        LLM(str(_break(tmp_path, how)), kv_backend="contiguous")


def test_missing_model_path_and_unknown_dtype(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"model path {tmp_path / 'nope'} does not exist"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="dtype must be one of .*float32.*got 'float8'"):
        LLM("tiny-random", dtype="float8")
