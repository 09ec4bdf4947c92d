"""The fused decoder-layer kernels equal the torch model they replace, kernel by kernel and end to end.

Runs in Triton's interpreter on the CPU: float32 agrees to the last bits, float16 within a few units
in the last place (the kernels round once where torch rounds after every op). Shapes are ragged on
purpose: 1, 3 and 17 tokens; hidden sizes 576 (SmolLM2) and 896 (Qwen2.5-0.5B), not powers of two;
head_dim 64 and 128 with grouped-query heads.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before minikv.kernels defines the kernels

import copy  # noqa: E402
import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from minikv import LLM, SamplingParams  # noqa: E402
from minikv.attention.metadata import AttentionMetadata  # noqa: E402
from minikv.attention.naive import NaiveBackend  # noqa: E402
from minikv.engine.config import EngineConfig  # noqa: E402
from minikv.engine.cuda_graph import DecodeGraphs  # noqa: E402
from minikv.kernels import fused_add_rms_norm, rotary_qkv, silu_and_mul  # noqa: E402
from minikv.model.config import ModelConfig  # noqa: E402
from minikv.model.llama import LlamaForCausalLM, RMSNorm, apply_rope, uninitialised_weights  # noqa: E402
from minikv.model.loader import load_model  # noqa: E402

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-2, rtol=1e-2)}


def randn(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [576, 896])
@pytest.mark.parametrize("T", [1, 3, 17])
def test_fused_add_rms_norm_equals_residual_add_then_rmsnorm(T, hidden, dtype):
    x, residual = randn(T, hidden, dtype=dtype, seed=1), randn(T, hidden, dtype=dtype, seed=2)
    norm = RMSNorm(hidden, 1e-6).to(dtype)
    norm.weight.data = randn(hidden, dtype=dtype, seed=3)
    out, new_residual = fused_add_rms_norm(x, residual, norm.weight, norm.eps)
    torch.testing.assert_close(new_residual, x + residual, atol=0, rtol=0)  # the add itself is exact
    torch.testing.assert_close(out, norm(x + residual), **TOL[dtype])
    out, same = fused_add_rms_norm(x, None, norm.weight, norm.eps)  # first layer: no residual yet
    assert same is x
    torch.testing.assert_close(out, norm(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("inter", [1536, 4864])
@pytest.mark.parametrize("T", [1, 3, 17])
def test_silu_and_mul_equals_silu_gate_times_up(T, inter, dtype):
    gate_up = randn(T, 2 * inter, dtype=dtype) * 3
    torch.testing.assert_close(silu_and_mul(gate_up), F.silu(gate_up[:, :inter]) * gate_up[:, inter:], **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (14, 2, 64), (8, 2, 128)], ids=["smollm2", "qwen2.5", "hd128"])
@pytest.mark.parametrize("T", [1, 3, 17])
def test_rotary_qkv_equals_split_then_apply_rope(T, heads, dtype):
    num_heads, num_kv_heads, head_dim = heads
    qkv = randn(T, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    positions = torch.randint(0, 32768, (T,), generator=torch.Generator().manual_seed(4))
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    q, k, v = rotary_qkv(qkv, positions, inv_freq, num_heads, num_kv_heads)
    angles = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    q_ref, k_ref, v_ref = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    torch.testing.assert_close(q, apply_rope(q_ref.reshape(T, num_heads, head_dim), cos, sin), **TOL[dtype])
    torch.testing.assert_close(k, apply_rope(k_ref.reshape(T, num_kv_heads, head_dim), cos, sin), **TOL[dtype])
    torch.testing.assert_close(v, v_ref.reshape(T, num_kv_heads, head_dim), atol=0, rtol=0)
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()


def test_fused_kernels_name_the_shape_they_need():
    with pytest.raises(ValueError, match=r"\[T, 1024\]"):
        rotary_qkv(torch.zeros(2, 1000), torch.zeros(2, dtype=torch.long), torch.ones(32), 12, 2)
    with pytest.raises(ValueError, match="does not match hidden size 64"):
        fused_add_rms_norm(torch.zeros(2, 64), None, torch.ones(63), 1e-6)
    with pytest.raises(ValueError, match="2 \\* intermediate"):
        silu_and_mul(torch.zeros(2, 7))


def small_qwen2() -> ModelConfig:
    """Qwen2's features at a small size: q/k/v biases, tied embeddings, GQA, head_dim 64."""
    return ModelConfig(vocab_size=300, hidden_size=192, intermediate_size=320, num_layers=2, num_heads=6,
                       num_kv_heads=2, head_dim=64, rope_theta=1e6, tie_word_embeddings=True, qkv_bias=True,
                       model_type="qwen2")


def test_merged_projections_are_views_that_load_save_tie_and_survive_a_dtype_move():
    torch.manual_seed(0)
    model = LlamaForCausalLM(small_qwen2())
    keys = list(model.state_dict())
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    for merged, parts in ((attn.qkv_weight, (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)),
                          (attn.qkv_bias, (attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias)),
                          (mlp.gate_up_weight, (mlp.gate_proj.weight, mlp.up_proj.weight))):
        assert all(p.untyped_storage().data_ptr() == merged.untyped_storage().data_ptr() for p in parts)
    assert list(model.state_dict()) == keys  # the Hugging Face names, and nothing more
    fresh = {name: torch.randn_like(t) for name, t in model.state_dict().items()}
    model.load_state_dict(fresh)
    torch.testing.assert_close(attn.qkv_bias, torch.cat([fresh[f"model.layers.0.self_attn.{p}_proj.bias"]
                                                         for p in "qkv"]), atol=0, rtol=0)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    before = attn.qkv_weight
    model.to(torch.float32)  # no move: the merged weights stay where they are (a CUDA graph may hold them)
    assert attn.qkv_weight is before
    model.half()  # a dtype move gives each parameter its own memory: the model merges again
    assert attn.qkv_weight.dtype == torch.float16
    assert attn.v_proj.weight.untyped_storage().data_ptr() == attn.qkv_weight.untyped_storage().data_ptr()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    twin = copy.deepcopy(model).model.layers[0].mlp  # so does a copy
    assert twin.up_proj.weight.untyped_storage().data_ptr() == twin.gate_up_weight.untyped_storage().data_ptr()
    torch.testing.assert_close(twin.gate_up_weight, mlp.gate_up_weight, atol=0, rtol=0)


def test_a_model_built_for_a_checkpoint_merges_without_copying_and_loads_into_the_merged_matrix():
    """Inside uninitialised_weights() the merged matrices are allocated, not copied from memory that holds
    nothing yet; the checkpoint then lands in them through the views. Outside, a merge keeps the values."""
    from minikv.model import llama

    with pytest.raises(RuntimeError, match="inside"):
        with uninitialised_weights():
            assert llama._uninitialised
            raise RuntimeError("inside")
    assert not llama._uninitialised  # restored after an error too
    torch.manual_seed(0)
    source = LlamaForCausalLM(small_qwen2())
    with uninitialised_weights():
        model = LlamaForCausalLM(small_qwen2())
    attn = model.model.layers[1].self_attn
    assert all(p.untyped_storage().data_ptr() == attn.qkv_weight.untyped_storage().data_ptr()
               for p in (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight))
    model.load_state_dict(source.state_dict())
    for name in ("qkv_weight", "qkv_bias"):
        torch.testing.assert_close(getattr(attn, name), getattr(source.model.layers[1].self_attn, name), atol=0, rtol=0)
    torch.testing.assert_close(model.model.layers[1].mlp.gate_up_weight, source.model.layers[1].mlp.gate_up_weight,
                               atol=0, rtol=0)
    mlp = source.model.layers[0].mlp  # outside the context a merge copies: the merged rows are the old values
    up = mlp.up_proj.weight.detach().clone()
    mlp.gate_up_weight = None
    mlp.merge_projections()
    torch.testing.assert_close(mlp.gate_up_weight[-up.shape[0]:], up, atol=0, rtol=0)


def greedy_tokens(model, fused_ops: bool, prompts, max_tokens: int = 4, **options) -> list[list[int]]:
    llm = LLM(model, dtype="float32", fused_ops=fused_ops, **options)
    assert llm.model.fused_ops is fused_ops
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("options", [dict(kv_backend="contiguous"), dict(kv_backend="paged", attention="torch")],
                         ids=["contiguous", "paged"])
def test_tiny_random_greedy_tokens_equal_with_fused_ops(options):
    prompts = [[5, 17, 42, 7, 99, 3, 8], [11, 12, 13]]
    loaded = load_model("tiny-random")
    unfused = greedy_tokens(loaded, False, prompts, **options)
    assert greedy_tokens(loaded, True, prompts, **options) == unfused


def test_fused_ops_through_the_decode_graphs_padded_static_buffers():
    """Paged Triton attention and the buffers a CUDA graph replays (run eagerly on a CPU): 3 sequences in
    a bucket of 4, the padding row at position 0 with no slot."""
    prompts = [list(range(10, 21)), [7], list(range(50, 55))]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (4, 3, 2)]
    options = dict(dtype="float32", kv_backend="paged", attention="triton", block_size=8, num_blocks=32,
                   max_model_len=64, max_num_batched_tokens=32, max_num_seqs=4, cuda_graphs=False)
    unfused = LLM("tiny-random", fused_ops=False, **options)
    want = [o.token_ids for o in unfused.generate(prompts, params, use_tqdm=False)]
    llm = LLM("tiny-random", fused_ops=True, **options)
    graphs = DecodeGraphs(llm.model, llm.backend, llm.device, llm.block_size, 4, llm.max_model_len,
                          llm.config.vocab_size, capture=False)
    steps, run = [], graphs.run
    graphs.run = lambda inputs: steps.append(inputs.num_seqs) or run(inputs)
    llm.runner.decode_graphs = graphs
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    assert 3 in steps  # decode steps of 3 sequences ran in the bucket of 4


def test_float16_model_logits_close_with_fused_ops():
    loaded = load_model("tiny-random", dtype=torch.float16)
    lens = [9, 4]  # two ragged prompts in one flattened batch
    ids = torch.randint(0, 512, (sum(lens),), generator=torch.Generator().manual_seed(5))
    positions = torch.cat([torch.arange(n) for n in lens])
    meta = AttentionMetadata.build(lens, lens)
    model, logits = loaded.model, {}
    for fused in (False, True):
        model.fused_ops = fused
        with torch.inference_mode():
            logits[fused] = model(ids, positions, meta, NaiveBackend())
    scale = logits[False].abs().max()
    assert (logits[True] - logits[False]).abs().max() <= 1e-2 * scale
    assert torch.equal(logits[True].argmax(-1), logits[False].argmax(-1))


def test_qwen2_checkpoint_with_bias_and_tied_embeddings_greedy_tokens_equal_with_fused_ops(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    cfg = small_qwen2()
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.5 if name.endswith("bias") else 1.0 if "embed" in name else p.shape[-1] ** -0.5)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": True, "max_position_embeddings": 512, "eos_token_id": 2}))
    loaded = load_model(tmp_path)
    prompts = [[3, 141, 59, 26, 53], [58, 97]]
    unfused = greedy_tokens(loaded, False, prompts)
    assert greedy_tokens(loaded, True, prompts) == unfused
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    torch.testing.assert_close(loaded.model.model.layers[1].self_attn.k_proj.bias,
                               state["model.layers.1.self_attn.k_proj.bias"], atol=0, rtol=0)


@pytest.mark.slow  # over 6 s on a 2-core machine: make test runs it, make test-fast leaves it out
def test_smollm2_greedy_tokens_equal_with_fused_ops():
    loaded = load_model("smollm2-135m")
    prompts = ["The capital of France is", "1, 2, 3,"]
    unfused = greedy_tokens(loaded, False, prompts, max_tokens=3)  # 3 steps of 30 layers in the interpreter
    assert greedy_tokens(loaded, True, prompts, max_tokens=3) == unfused


def test_fused_ops_default_off_on_a_cpu_and_checked():
    assert EngineConfig.from_options(model="tiny-random", device="cpu").fused_ops is False
    with pytest.raises(ValueError, match="fused_ops must be True, False or None"):
        EngineConfig.from_options(model="tiny-random", device="cpu", fused_ops="yes")
    with pytest.raises(ValueError, match="bfloat16"):
        EngineConfig.from_options(model="tiny-random", device="cpu", dtype="bfloat16", fused_ops=True)
