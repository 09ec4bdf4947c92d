"""Beam search on shared blocks equals a beam search that recomputes every beam from scratch."""
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minikv import LLM, SamplingParams
from minikv.engine.beam import best_candidates

from beam_reference import reference_beam_search
from engine_checks import checked

PROMPTS = [[7, 3, 91, 45, 12, 300, 8, 77, 150, 23], list(range(20, 37)), [5, 6, 7]]


@pytest.fixture(scope="module")
def tiny():
    return LLM("tiny-random", kv_backend="paged", block_size=4, num_blocks=256)


_refs = {}


def reference(llm, prompts, width, max_tokens, eos=None, length_penalty=1.0):
    eos = llm.eos_token_ids if eos is None else eos
    key = lambda p: (tuple(p), width, max_tokens, tuple(sorted(eos)), length_penalty)  # noqa: E731
    for p in prompts:
        if key(p) not in _refs:
            _refs[key(p)] = reference_beam_search(llm.model, p, width, max_tokens, eos, length_penalty=length_penalty)
    return [_refs[key(p)] for p in prompts]


def assert_same_beams(outs, refs):
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert [c.token_ids for c in out.outputs] == [h.token_ids for h in ref], f"prompt {i}"
        for c, h in zip(out.outputs, ref):
            assert c.cumulative_logprob == pytest.approx(h.cumulative_logprob, abs=1e-4)
            assert c.finish_reason == h.finish_reason


@pytest.mark.parametrize("width", [1, 2, 4])
def test_beam_search_equals_the_recompute_everything_reference(tiny, width):
    outs = checked(tiny).beam_search(PROMPTS, beam_width=width, max_tokens=8)
    assert_same_beams(outs, reference(tiny, PROMPTS, width, 8))
    assert all(len(o.outputs) == width for o in outs)
    assert outs[0].token_ids == outs[0].outputs[0].token_ids
    assert tiny.stats()["used_blocks"] == 0


def test_width_one_is_greedy(tiny):
    beam = tiny.beam_search(PROMPTS[0], beam_width=1, max_tokens=10)[0]
    greedy = tiny.generate(PROMPTS[0], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert beam.token_ids == greedy.token_ids


def test_beams_are_ranked_best_first(tiny):
    # (a wider beam need not beat greedy: the greedy path can be pruned on the way)
    out = tiny.beam_search(PROMPTS[0], beam_width=4, max_tokens=8)[0]
    scores = [c.cumulative_logprob for c in out.outputs]
    assert scores == sorted(scores, reverse=True)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4


def test_eos_ends_a_beam_as_a_finished_hypothesis(tiny):
    free_run = reference(tiny, PROMPTS[:1], 3, 6)[0]
    eos = {free_run[0].token_ids[2]}  # a token the beams meet: make it the end of sequence
    tiny.eos_token_ids, saved = eos, tiny.eos_token_ids
    try:  # length_penalty 0: raw cumulative logprob, so a beam that stopped early ranks high
        outs = tiny.beam_search(PROMPTS[:1], beam_width=3, max_tokens=6, length_penalty=0.0)
    finally:
        tiny.eos_token_ids = saved
    refs = reference(tiny, PROMPTS[:1], 3, 6, eos=eos, length_penalty=0.0)
    assert_same_beams(outs, refs)
    assert any(c.finish_reason == "stop" and c.token_ids[-1] in eos for c in outs[0].outputs)


def test_length_penalty_ranks_like_the_reference(tiny):
    free_run = reference(tiny, PROMPTS[:1], 3, 6)[0]
    eos = {free_run[0].token_ids[2]}
    tiny.eos_token_ids, saved = eos, tiny.eos_token_ids
    try:
        for lp in (0.0, 2.0):
            assert_same_beams(tiny.beam_search(PROMPTS[:1], 3, 6, length_penalty=lp),
                              reference(tiny, PROMPTS[:1], 3, 6, eos=eos, length_penalty=lp))
    finally:
        tiny.eos_token_ids = saved


def test_beams_share_blocks(tiny):
    tiny.beam_search(PROMPTS[1], beam_width=4, max_tokens=8)  # 17-token prompt: 5 blocks of 4
    s = tiny.stats()
    assert s["forks"] >= 3 and s["cow_copies"] > 0
    assert s["peak_used_blocks"] < s["peak_blocks_unshared"]
    assert s["used_blocks"] == 0


@pytest.mark.parametrize("preemption,num_blocks", [("recompute", 7), ("recompute", 10), ("swap", 9)])
def test_beam_search_stays_exact_under_memory_pressure(tiny, preemption, num_blocks):
    llm = checked(LLM("tiny-random", kv_backend="paged", block_size=4, num_blocks=num_blocks, preemption=preemption,
                      max_num_batched_tokens=32))
    outs = llm.beam_search(PROMPTS, beam_width=3, max_tokens=10)
    assert_same_beams(outs, reference(tiny, PROMPTS, 3, 10))
    assert llm.stats()["num_preemptions"] > 0
    assert llm.stats()["used_blocks"] == 0


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10_000), width=st.integers(1, 4), num_blocks=st.integers(7, 20),
       preemption=st.sampled_from(["recompute", "swap"]))
def test_random_beam_searches_under_pressure_equal_the_reference(tiny, seed, width, num_blocks, preemption):
    rng = random.Random(seed)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(1, 17))] for _ in range(rng.randint(1, 2))]
    max_tokens = rng.randint(1, 10)  # at most 27 tokens: 7 blocks, one beam always fits
    llm = checked(LLM("tiny-random", kv_backend="paged", block_size=4, num_blocks=num_blocks, preemption=preemption,
                      max_num_batched_tokens=rng.choice([8, 32])))
    assert_same_beams(llm.beam_search(prompts, width, max_tokens), reference(tiny, prompts, width, max_tokens))
    assert llm.stats()["used_blocks"] == 0


def test_beam_search_next_to_sampled_requests(tiny):
    llm = checked(LLM("tiny-random", kv_backend="paged", block_size=4, num_blocks=64))
    other = llm.add_request(PROMPTS[2], SamplingParams(max_tokens=12, ignore_eos=True))
    outs = llm.beam_search(PROMPTS[:1], beam_width=3, max_tokens=6)
    assert_same_beams(outs, reference(tiny, PROMPTS[:1], 3, 6))
    while llm.has_unfinished():
        llm.step()
    alone = tiny.generate(PROMPTS[2], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert other.output_token_ids == alone.token_ids


def test_best_candidates_breaks_ties_by_beam_then_token():
    logprobs = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.5, 0.25, 0.25]]))
    assert [(b, t) for b, t, _ in best_candidates([0.0, 0.0], logprobs, 4)] == [(0, 0), (1, 0), (0, 1), (0, 2)]


def test_beam_search_needs_the_paged_pool_and_seats():
    with pytest.raises(ValueError, match="paged"):
        LLM("tiny-random", kv_backend="contiguous").beam_search(PROMPTS[0])
    with pytest.raises(ValueError, match="raise max_num_seqs"):
        LLM("tiny-random", kv_backend="paged", max_num_seqs=2).beam_search(PROMPTS[0], beam_width=3)
