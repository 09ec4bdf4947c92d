"""Sampling, stopping, streaming and timings."""
import pytest
import torch

from minikv import LLM, SamplingParams
from minikv.engine.sampler import filtered_probs


@pytest.fixture(scope="module")
def tiny():
    return LLM("tiny-random", kv_backend="paged", block_size=8, num_blocks=64)


PROMPT = [5, 17, 99, 3]


def test_same_seed_same_sample_whatever_is_batched_beside_it(tiny):
    p = SamplingParams(max_tokens=12, temperature=1.0, seed=123, ignore_eos=True)
    alone = tiny.generate([PROMPT], p)[0].token_ids
    crowd = tiny.generate([[7, 8], PROMPT, [9] * 20],
                          [SamplingParams(max_tokens=5, temperature=1.0, seed=1), p, SamplingParams(max_tokens=3)])
    assert crowd[1].token_ids == alone
    other_seed = tiny.generate([PROMPT], SamplingParams(max_tokens=12, temperature=1.0, seed=124, ignore_eos=True))
    assert other_seed[0].token_ids != alone


def test_top_k_1_and_tiny_top_p_are_greedy(tiny):
    greedy = tiny.generate([PROMPT], SamplingParams(max_tokens=10, ignore_eos=True))[0].token_ids
    k1 = tiny.generate([PROMPT], SamplingParams(max_tokens=10, temperature=1.3, top_k=1, seed=0, ignore_eos=True))
    p0 = tiny.generate([PROMPT], SamplingParams(max_tokens=10, temperature=1.3, top_p=1e-6, seed=0, ignore_eos=True))
    assert k1[0].token_ids == greedy and p0[0].token_ids == greedy


def test_filtered_probs_keep_exactly_top_k_and_the_top_p_nucleus():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (probs > 0).tolist() == [True, True, False, False, False]
    full = torch.softmax(logits, -1)
    p = float(full[0] + full[1] / 2)  # the nucleus must include the second token, not the third
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=p))
    assert (probs > 0).tolist() == [True, True, False, False, False]
    assert torch.isclose(probs.sum(), torch.tensor(1.0))


def test_eos_stops_unless_ignored(tiny):
    greedy = tiny.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    tiny.eos_token_ids = {greedy[2]}
    try:
        stopped = tiny.generate([PROMPT], SamplingParams(max_tokens=8))[0]
        ignored = tiny.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    finally:
        tiny.eos_token_ids = {2}
    assert stopped.token_ids == greedy[:3] and stopped.finish_reason == "stop"
    assert ignored.token_ids == greedy and ignored.finish_reason == "length"


def test_streaming_yields_every_token_in_order_with_timings(tiny):
    events = list(tiny.stream([PROMPT, [1, 2]], SamplingParams(max_tokens=6, ignore_eos=True)))
    outs = tiny.generate([PROMPT, [1, 2]], SamplingParams(max_tokens=6, ignore_eos=True))
    for i in range(2):
        assert [e.token_id for e in events if e.index == i] == outs[i].token_ids
    assert [e.finished for e in events if e.index == 0][-1]
    o = outs[0]
    assert o.time_to_first_token > 0 and o.inter_token_latency > 0
    assert len(o.metrics.inter_token_latencies) == 5


def test_stopping_a_stream_early_returns_every_block(tiny):
    for _ in tiny.stream([PROMPT, [4] * 30], SamplingParams(max_tokens=20, ignore_eos=True)):
        break
    assert not tiny.has_unfinished()
    assert tiny.block_manager.num_free_blocks == tiny.block_manager.num_blocks


def test_abort_mid_flight_returns_blocks(tiny):
    a = tiny.add_request([1] * 20, SamplingParams(max_tokens=30, ignore_eos=True))
    b = tiny.add_request([2] * 5, SamplingParams(max_tokens=3, ignore_eos=True))
    tiny.step()
    tiny.step()
    assert a.block_table
    tiny.abort(a)
    assert a.finish_reason == "abort" and a.block_table == []
    while tiny.has_unfinished():
        tiny.step()
    assert len(b.output_token_ids) == 3
    assert tiny.block_manager.num_free_blocks == tiny.block_manager.num_blocks


@pytest.mark.slow
def test_smollm2_stop_string_and_chat_template():
    llm = LLM("smollm2-135m", kv_backend="contiguous")
    prompt = llm.chat_prompt("Count from 1 to 10, separated by commas.")
    full = llm.generate(prompt, SamplingParams(max_tokens=40))[0]
    assert "4" in full.text
    cut = llm.generate(prompt, SamplingParams(max_tokens=40, stop=["4"]))[0]
    assert cut.finish_reason == "stop" and "4" not in cut.text and full.text.startswith(cut.text)
    streamed = "".join(e.text_delta for e in llm.stream(prompt, SamplingParams(max_tokens=40)))
    assert streamed == full.text


def test_stream_yields_only_its_own_requests_and_those_queued_with_add_request_still_finish(tiny):
    earlier = tiny.add_request([3, 4, 5], SamplingParams(max_tokens=4, ignore_eos=True))
    events = list(tiny.stream([PROMPT], SamplingParams(max_tokens=3, ignore_eos=True)))
    assert [e.index for e in events] == [0, 0, 0] and {e.request_id for e in events} != {earlier.request_id}
    while tiny.has_unfinished():  # the stream ran them alongside its own; step() finishes what is left
        tiny.step()
    assert len(earlier.output_token_ids) == 4 and earlier.is_finished
