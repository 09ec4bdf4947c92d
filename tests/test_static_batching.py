"""Rung 3, static batching: per request, the tokens of rung 2; the waste counted exactly; the
batch-resizing pitfall reproduced."""
import random

import pytest

from minikv import LLM, SamplingParams
from minikv.engine.static_batching import DECODE, EMPTY, IDLE, PAD, PROMPT, StaticBatcher


def mixed_requests(n=7, seed=0, vocab=512, max_prompt=20, max_out=12, ignore_eos=True):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(1, max_prompt))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(1, max_out), ignore_eos=ignore_eos) for _ in prompts]
    return prompts, params


def one_at_a_time(llm, prompts, params):
    """Rung 2: the contiguous cache, each request alone."""
    return [llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (tests/conftest.py)


@pytest.fixture(scope="module")
def tiny():
    return LLM("tiny-random", kv_backend="contiguous", max_num_seqs=1)


@pytest.fixture(scope="module")
def rung2(tiny):
    """Mixed prompt lengths and max_tokens, with and without EOS, and their rung-2 tokens."""
    cases = {}
    for ignore_eos in (True, False):
        prompts, params = mixed_requests(ignore_eos=ignore_eos)
        cases[ignore_eos] = prompts, params, one_at_a_time(tiny, prompts, params)
    return cases


@pytest.mark.parametrize("batch_size", [1, 3, 4, 7, 10])
@pytest.mark.parametrize("ignore_eos", [True, False])
def test_static_batch_tokens_equal_rung2_per_request(tiny, rung2, batch_size, ignore_eos):
    prompts, params, ref = rung2[ignore_eos]
    outs = StaticBatcher(tiny, batch_size).generate(prompts, params)
    assert [o.token_ids for o in outs] == ref


def test_outputs_come_back_in_prompt_order_with_finish_reasons(tiny):
    prompts, params = mixed_requests(n=5)
    outs = StaticBatcher(tiny, 2).generate(prompts, params)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [len(o.token_ids) for o in outs] == [p.max_tokens for p in params]
    assert all(o.finish_reason == "length" for o in outs)


def test_prompt_padding_is_masked_whatever_the_pad_token(tiny):
    prompts, params = mixed_requests(n=4)
    a = StaticBatcher(tiny, 4, pad_token_id=0).generate(prompts, params)
    b = StaticBatcher(tiny, 4, pad_token_id=123).generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_waste_statistics_on_a_hand_computed_case(tiny):
    # batch 0: a (3 prompt, 2 new) and b (5 prompt, 4 new); batch 1: c (4 prompt, 3 new) alone
    #   column   0 1 2 3 4 | 5 6 7         column   0 1 2 3 | 4 5
    #   slot 0   . . a a a | a ~ ~         slot 0   c c c c | c c
    #   slot 1   b b b b b | b b b         slot 1   (empty)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14, 15, 16]]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (2, 4, 3)]
    batcher = StaticBatcher(tiny, 2)
    batcher.generate(prompts, params)
    s = batcher.stats
    assert (s.num_batches, s.num_steps) == (2, 4 + 3)
    assert (s.prompt_tokens, s.prompt_pad_tokens) == (12, 2)
    assert (s.decode_tokens, s.idle_decode_tokens) == (1 + 3 + 2, 2)
    assert (s.tokens_computed, s.useful_tokens, s.wasted_tokens) == (22, 18, 4)
    assert s.generated_tokens == 9 and s.slot_steps == 2 * 7
    assert s.slot_utilisation == pytest.approx(9 / 14)
    assert s.waste_fraction == pytest.approx(4 / 22)
    assert s.wall_time > 0
    b0, b1 = s.traces
    assert b0.request_indices == [0, 1] and b1.request_indices == [2]
    assert b0.cells.tolist() == [[PAD, PAD, PROMPT, PROMPT, PROMPT, DECODE, IDLE, IDLE], [PROMPT] * 5 + [DECODE] * 3]
    assert b1.cells.tolist() == [[PROMPT] * 4 + [DECODE] * 2, [EMPTY] * 6]


def test_next_batch_starts_only_when_the_whole_batch_is_done(tiny):
    prompts, params = mixed_requests(n=4)
    outs = StaticBatcher(tiny, 2).generate(prompts, params)
    first_batch_done = max(o.metrics.token_times[-1] for o in outs[:2])
    assert min(o.metrics.token_times[0] for o in outs[2:]) > first_batch_done
    assert all(o.time_to_first_token > 0 for o in outs)


def test_renumbering_slots_without_moving_cache_rows_corrupts_outputs(tiny):
    # requests 0 and 1 finish at the prefill; 2 and 3 are renumbered to slots 0 and 1
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (1, 1, 12, 12)]
    ref = one_at_a_time(tiny, prompts, params)
    renumbered = [o.token_ids for o in StaticBatcher(tiny, 4, compact="renumber").generate(prompts, params)]
    assert renumbered[:2] == ref[:2]  # finished before any compaction
    assert renumbered[2] != ref[2] and renumbered[3] != ref[3]  # they read requests 0 and 1's K/V
    assert renumbered[2][0] == ref[2][0] and renumbered[3][0] == ref[3][0]  # right until the renumbering


def test_compacting_with_the_cache_row_moved_keeps_outputs_and_drops_idle_rows(tiny, rung2):
    prompts, params, ref = rung2[True]
    kept, moved = StaticBatcher(tiny, 4), StaticBatcher(tiny, 4, compact="move")
    assert [o.token_ids for o in kept.generate(prompts, params)] == ref
    assert [o.token_ids for o in moved.generate(prompts, params)] == ref
    assert kept.stats.idle_decode_tokens > 0 and moved.stats.idle_decode_tokens == 0
    # compute saved, but the slots still wait for the longest request: utilisation is unchanged
    assert moved.stats.tokens_computed == kept.stats.tokens_computed - kept.stats.idle_decode_tokens
    assert moved.stats.slot_utilisation == kept.stats.slot_utilisation


@pytest.mark.parametrize("bad", [0, -2, 1.5])
def test_batch_size_below_one_is_rejected_with_a_clear_error(tiny, bad):
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        StaticBatcher(tiny, bad)


def test_unknown_compact_mode_is_rejected(tiny):
    with pytest.raises(ValueError, match="unknown compact mode"):
        StaticBatcher(tiny, 2, compact="shrink")


@pytest.mark.slow
def test_static_batch_tokens_equal_rung2_on_smollm2(smollm2_dir):
    llm = LLM("smollm2-135m", kv_backend="contiguous", max_num_seqs=1)
    prompts = [llm.chat_prompt(q) for q in ("Hi!", "What is the capital of France?", "Name three colours.")]
    params = [SamplingParams(max_tokens=m) for m in (6, 3, 8)]
    outs = StaticBatcher(llm, 3).generate(prompts, params)
    assert [o.token_ids for o in outs] == one_at_a_time(llm, prompts, params)
    assert outs[1].text and outs[1].finish_reason in ("stop", "length")
