"""Exercise 03a's checker (the left-padding mask) passes the reference mask, catches the mistakes
learners make and names them, and the static batcher attends with the learner's mask (tiny-random
here; the notebook runs SmolLM2)."""
from __future__ import annotations

import pytest
import torch

from minikv.checks.padding import check_padded_mask, check_padded_mask_in_engine


def _parts(pad_lens, q_cols, L):
    return q_cols[:, :, None], torch.arange(L)[None, None, :], pad_lens[:, None, None]


def mask(pad_lens, q_cols, L):
    q, k, pad = _parts(pad_lens, q_cols, L)
    return (k <= q) & ((k >= pad) | (q < pad))


BUGS = {
    "pads visible": (lambda p, q, L: (lambda q, k, pad: k <= q)(*_parts(p, q, L)), "pads are visible"),
    "empty pad rows": (lambda p, q, L: (lambda q, k, pad: (k <= q) & (k >= pad))(*_parts(p, q, L)),
                       "row is empty"),
    "not causal": (lambda p, q, L: (lambda q, k, pad: (k >= pad) | (q < pad))(*_parts(p, q, L)), "not causal"),
    "strict diagonal": (lambda p, q, L: (lambda q, k, pad: (k < q) & ((k >= pad) | (q < pad)))(*_parts(p, q, L)),
                        "diagonal"),
    "off-by-one pad boundary": (lambda p, q, L: (lambda q, k, pad: (k <= q) & ((k > pad) | (q < pad)))(
        *_parts(p, q, L)), "off by one"),
    "an int mask": (lambda p, q, L: mask(p, q, L).int(), "torch.bool"),
    "wrong shape": (lambda p, q, L: mask(p, q, L)[:, 0], "shape"),
    "forgot to return": (lambda p, q, L: None, "return"),
}


def test_task_03a_reference_mask_passes(capsys):
    check_padded_mask(mask)
    assert "cases passed" in capsys.readouterr().out


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_task_03a_mask_bugs_are_caught_and_named(bug):
    fn, words = BUGS[bug]
    with pytest.raises(AssertionError, match=words):
        check_padded_mask(fn, num_random=20)


PROMPTS = [list(range(3, 9)), list(range(20, 37)), [5, 6]]


def test_task_03a_static_batch_on_the_learners_mask_gives_rung_2(capsys):
    from minikv import LLM

    llm = LLM("tiny-random", kv_backend="contiguous", max_num_seqs=1, max_model_len=64)
    check_padded_mask_in_engine(llm, mask, PROMPTS, max_tokens=6)
    assert "rung-2 tokens" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="left pads"):
        check_padded_mask_in_engine(llm, BUGS["pads visible"][0], PROMPTS, max_tokens=6)


def test_task_03a_the_batcher_really_calls_the_learners_mask():
    from minikv import LLM, SamplingParams

    llm = LLM("tiny-random", kv_backend="contiguous", max_num_seqs=1, max_model_len=64)
    calls = []

    def spy(pad_lens, q_cols, L):
        calls.append((pad_lens.tolist(), tuple(q_cols.shape), L))
        return mask(pad_lens, q_cols, L)

    from minikv.engine.static_batching import StaticBatcher

    StaticBatcher(llm, 3, padded_mask=spy).generate(PROMPTS, SamplingParams(max_tokens=3, ignore_eos=True))
    assert calls[0] == ([11, 0, 15], (3, 17), 17)  # the prefill: pads to the longest prompt (17)
    assert calls[1] == ([11, 0, 15], (3, 1), 18)  # then one column per decode step, once per step
    assert len(calls) == 3
