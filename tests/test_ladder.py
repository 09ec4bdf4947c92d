"""The equivalence ladder: every rung gives the tokens of the rung below (greedy)."""
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from minikv import LLM, SamplingParams


def mixed_requests(n=10, seed=0, vocab=512, max_prompt=40, max_out=24):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, max_prompt))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(1, max_out), ignore_eos=True) for _ in prompts]
    return prompts, params


@pytest.fixture(scope="module")
def rung2_tiny():
    prompts, params = mixed_requests()
    outs = LLM("tiny-random", kv_backend="contiguous", max_num_seqs=1).generate(prompts, params)
    return prompts, params, [o.token_ids for o in outs]


def test_rung1_naive_equals_rung2_contiguous_on_tiny_random(rung2_tiny):
    prompts, params, ref = rung2_tiny
    outs = LLM("tiny-random", kv_backend="naive").generate(prompts, params)
    assert [o.token_ids for o in outs] == ref


def test_contiguous_batched_rows_equal_one_at_a_time(rung2_tiny):
    prompts, params, ref = rung2_tiny
    outs = LLM("tiny-random", kv_backend="contiguous", max_num_seqs=4).generate(prompts, params)
    assert [o.token_ids for o in outs] == ref


PAGED_VARIANTS = {
    "block16-roomy": dict(block_size=16),
    "block4-pressure-recompute": dict(block_size=4, num_blocks=20, max_model_len=80),
    "block4-pressure-swap": dict(block_size=4, num_blocks=20, max_model_len=80, preemption="swap"),
    # the head-major pool through store, gather, swap out and back in
    "block4-pressure-swap-head-major": dict(block_size=4, num_blocks=20, max_model_len=80, preemption="swap",
                                            kv_layout="hnd"),
    "block8-small-budget-chunked": dict(block_size=8, num_blocks=40, max_num_batched_tokens=7),
    "block8-chunked-off": dict(block_size=8, num_blocks=40, enable_chunked_prefill=False, max_model_len=320,
                               max_num_batched_tokens=320),
    "block32-pressure-swap-chunked": dict(block_size=32, num_blocks=4, max_model_len=128, preemption="swap",
                                          max_num_batched_tokens=16),
    "block4-swap-space-full-falls-back": dict(block_size=4, num_blocks=20, max_model_len=80, preemption="swap",
                                              swap_blocks=3),
}


@pytest.mark.parametrize("variant", list(PAGED_VARIANTS))
def test_rung5_paged_continuous_batching_equals_rung2(rung2_tiny, variant):
    prompts, params, ref = rung2_tiny
    llm = LLM("tiny-random", kv_backend="paged", **PAGED_VARIANTS[variant])
    outs = llm.generate(prompts, params)
    for i, (o, r) in enumerate(zip(outs, ref)):
        assert o.token_ids == r, f"request {i} differs under {variant}"
    stats = llm.stats()
    assert stats["used_blocks"] == 0 and stats["free_blocks"] == stats["num_blocks"]
    if "pressure" in variant:
        assert stats["num_preemptions"] > 0, "the variant was meant to preempt"
    if "swap" in variant and "full" not in variant:
        assert stats["num_swaps"] > 0 and stats["swapped_in_blocks"] == stats["swapped_out_blocks"] > 0
    if "full" in variant:
        assert stats["num_recomputes"] > 0, "a full swap space must fall back to recompute"


@pytest.mark.slow
def test_smollm2_greedy_naive_equals_contiguous_equals_paged_equals_transformers(smollm2_dir):
    prompts = ["The three primary colors are", "def fibonacci(n):", "KV caching speeds up decoding because"]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    naive = LLM("smollm2-135m", kv_backend="naive")
    outs = {kv: [o.token_ids for o in naive.derive(kv_backend=kv).generate(prompts, params)]  # same weights
            for kv in ("naive", "contiguous", "paged")}
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    llm_tok = naive.tokenizer
    ref = []
    for p in prompts:
        ids = torch.tensor([llm_tok.encode(p, add_special_tokens=False)])
        gen = hf.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=2)
        ref.append(gen[0, ids.shape[1]:].tolist())
    assert outs["naive"] == ref
    assert outs["contiguous"] == ref
    assert outs["paged"] == ref
