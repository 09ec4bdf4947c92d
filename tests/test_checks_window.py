"""Exercise 09b's checker (which blocks a sliding window with sinks may give back) passes the
reference answer, catches the mistakes learners make and names them, and the engine runs a long
generation on the learner's rule through the `window_free_rule` seam."""
from __future__ import annotations

import pytest

from minikv import LLM
from minikv.checks.window import check_window_in_engine, check_window_rule


def window_free_rule(block_table, num_computed_tokens, block_size, sliding_window, sink_tokens):
    first = -(-sink_tokens // block_size)
    end = (num_computed_tokens - sliding_window + 1) // block_size
    return [i for i in range(first, min(end, len(block_table))) if block_table[i] != -1]


def window_off_by_one(block_table, num_computed_tokens, block_size, sliding_window, sink_tokens):
    return window_free_rule(block_table, num_computed_tokens - 1, block_size, sliding_window, sink_tokens)


def first_position_only(block_table, num_computed_tokens, block_size, sliding_window, sink_tokens):
    first, seen = -(-sink_tokens // block_size), num_computed_tokens - sliding_window + 1
    return [i for i in range(first, len(block_table)) if i * block_size < seen and block_table[i] != -1]


def sinks_floor(block_table, num_computed_tokens, block_size, sliding_window, sink_tokens):
    end = (num_computed_tokens - sliding_window + 1) // block_size
    return [i for i in range(sink_tokens // block_size, min(end, len(block_table))) if block_table[i] != -1]


def frees_twice(block_table, num_computed_tokens, block_size, sliding_window, sink_tokens):
    first, end = -(-sink_tokens // block_size), (num_computed_tokens - sliding_window + 1) // block_size
    return list(range(first, min(end, len(block_table))))


def physical_ids(block_table, *args):
    return [block_table[i] for i in window_free_rule(block_table, *args)]


def never(block_table, *args):
    return []


def test_task_09b_reference_answer_passes(capsys):
    check_window_rule(window_free_rule)
    assert "cases passed" in capsys.readouterr().out


@pytest.mark.parametrize("fn, words", [
    (window_off_by_one, "num_computed_tokens - sliding_window \\+ 1, not num_computed_tokens - sliding_window"),
    (first_position_only, "still in sight.*\n.*LAST position"),
    (sinks_floor, "ceil\\(sink_tokens / block_size\\)"),
    (frees_twice, "already given back"),
    (physical_ids, "logical indexes"),
    (never, "holds no sink and no later query sees it: it may go"),
    (lambda *a: None, "returned None"),
])
def test_task_09b_rule_bugs_are_caught_and_named(fn, words):
    with pytest.raises(AssertionError, match=words):
        check_window_rule(fn)


def _engine(num_blocks: int = 24):
    return LLM("tiny-random", kv_backend="paged", block_size=4, num_blocks=num_blocks, max_model_len=200,
               max_num_batched_tokens=16, sliding_window=16, sink_tokens=4)


def test_task_09b_engine_on_the_learners_rule_equals_its_own(capsys):
    stats = check_window_in_engine(_engine(), window_free_rule, max_tokens=40)
    assert stats["window_freed_blocks"] > 0 and "the same tokens" in capsys.readouterr().out


def test_task_09b_engine_refuses_an_unsafe_rule_and_reports_a_lazy_one():
    with pytest.raises(AssertionError, match="(?s)the engine refused your answer.*still sees"):
        check_window_in_engine(_engine(), first_position_only, max_tokens=40)
    with pytest.raises(AssertionError, match="(?s)gave back .* blocks"):
        check_window_in_engine(_engine(num_blocks=64), never, max_tokens=40)


def test_task_09b_the_check_runs_the_rule_it_is_given_not_one_the_llm_was_built_with():
    """A learner who fixes the rule and re-runs only the check cell gets the fixed rule checked."""
    stale = LLM("tiny-random", kv_backend="paged", block_size=4, num_blocks=24, max_model_len=200,
                max_num_batched_tokens=16, sliding_window=16, sink_tokens=4, window_free_rule=first_position_only)
    check_window_in_engine(stale, window_free_rule, max_tokens=40)
