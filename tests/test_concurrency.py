"""Several callers on one engine: threads, a generate inside a stream loop, aborts mid-stream. Each
call gets exactly its own outputs, and every streamed request ends with a finished event."""
import threading

import pytest

from minikv import LLM, SamplingParams

PROMPTS = [[(7 * i + j) % 300 + 3 for j in range(5 + i)] for i in range(8)]
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("prefix_caching", [None, "hash", "radix"])
def test_two_threads_calling_generate_each_get_exactly_their_own_outputs(prefix_caching):
    llm = LLM("tiny-random", kv_backend="paged", block_size=4, num_blocks=128, prefix_caching=prefix_caching)
    want = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    got: dict[int, list] = {0: [], 1: []}
    errors = []

    def caller(k: int, prompts: list) -> None:
        try:
            for _ in range(4):
                got[k].append([o.token_ids for o in llm.generate(prompts, PARAMS)])
        except Exception as e:  # noqa: BLE001  reported below
            errors.append(e)

    threads = [threading.Thread(target=caller, args=(0, PROMPTS[:4])),
               threading.Thread(target=caller, args=(1, PROMPTS[4:]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert got[0] == [want[:4]] * 4 and got[1] == [want[4:]] * 4
    llm.block_manager.check([])
    assert not llm.has_unfinished()


def test_generate_inside_a_stream_loop_leaves_the_outer_stream_whole():
    llm = LLM("tiny-random", kv_backend="paged", block_size=4, num_blocks=64)
    alone = llm.generate(PROMPTS[:2], PARAMS)
    events, inner = [], None
    for event in llm.stream(PROMPTS[:2], PARAMS):
        events.append(event)
        if inner is None:
            inner = llm.generate(PROMPTS[2:3], PARAMS)[0]
    for i, out in enumerate(alone):
        mine = [e for e in events if e.index == i]
        assert [e.token_id for e in mine] == out.token_ids
        assert mine[-1].finished and not any(e.finished for e in mine[:-1])
    assert inner.token_ids == llm.generate(PROMPTS[2:3], PARAMS)[0].token_ids


def test_a_request_aborted_during_a_stream_ends_with_a_finished_abort_event():
    llm = LLM("tiny-random", kv_backend="paged", block_size=4, num_blocks=64)
    seqs = []
    stream = llm.stream(PROMPTS[:2], SamplingParams(max_tokens=20, ignore_eos=True))
    first = next(stream)
    seq = next(s for s in llm.scheduler.all_sequences() if s.request_id == first.request_id)
    llm.abort(seq)
    rest = list(stream)
    last = [e for e in [first] + rest if e.index == first.index][-1]
    assert last.finished and last.finish_reason == "abort" and last.token_id is None
    other = [e for e in rest if e.index != first.index]
    assert other[-1].finished and other[-1].finish_reason == "length"
    assert llm.block_manager.num_free_blocks == 64 and not seqs


def test_abort_of_something_that_is_not_a_request_is_a_clear_error():
    llm = LLM("tiny-random", kv_backend="contiguous")
    with pytest.raises(ValueError, match="abort takes the Sequence that add_request returned"):
        llm.abort(None)


def test_a_sample_that_finishes_before_it_finds_a_seat_never_runs_again():
    # B (n=2) is prefilled in two chunks; C takes the second seat meanwhile, so B's fork finds no seat
    # and waits, though max_tokens=1 finishes it on the prompt's logits
    llm = LLM("tiny-random", kv_backend="paged", block_size=4, num_blocks=64, max_num_seqs=2,
              max_num_batched_tokens=16)
    b, c = list(range(3, 23)), [30, 31, 32]
    params = [SamplingParams(max_tokens=1, n=2, temperature=1.0, seed=1), SamplingParams(max_tokens=5, ignore_eos=True)]
    out = llm.generate([b, c], params)
    assert [len(s.token_ids) for s in out[0].outputs] == [1, 1]
    assert len(out[1].token_ids) == 5
    assert not llm.has_unfinished()
    stream = llm.stream([b, c], [SamplingParams(max_tokens=4, n=2, temperature=1.0, seed=2), params[1]])
    next(stream)
    stream.close()  # the consumer stops early: nothing of it may run in the next call
    assert not llm.has_unfinished()
    assert llm.block_manager.num_free_blocks == 64


def test_pinned_blocks_count_against_what_a_request_may_need():
    llm = LLM("tiny-random", kv_backend="paged", block_size=4, num_blocks=8, prefix_caching="hash",
              max_model_len=32)
    system = list(range(3, 19))  # 4 full blocks
    assert llm.pin_prefix(system) == 16
    # 28 prompt + 4 output tokens need 8 blocks; only 4 are not pinned: refused now, not mid-generation
    with pytest.raises(ValueError, match="may need 8 blocks .* 4 of the pool's 8 blocks are pinned"):
        llm.generate([list(range(100, 128))], SamplingParams(max_tokens=4))
    assert not llm.has_unfinished()
    # a request that starts with the pinned prefix shares those blocks, so it fits
    out = llm.generate([system + [40, 41, 42]], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8
    # and one that fits beside the pins runs
    assert len(llm.generate([list(range(100, 110))], SamplingParams(max_tokens=4))[0].token_ids) >= 1
    llm.block_manager.check([])
