"""The prompt-caching cost calculator (minikv/bench/economics.py) that notebook 12b runs over its replays:
break-even, minimums and granularity, and the hit-rate arithmetic of a growing context."""
from __future__ import annotations

import pytest

from minikv.bench import economics as ec

SONNET = ec.PRICES["claude-sonnet-4.5"]
SONNET_1H = ec.PRICES["claude-sonnet-4.5 (1h)"]
GPT5 = ec.PRICES["gpt-5"]


def test_a_5_minute_write_pays_at_the_first_reuse_and_a_1_hour_write_at_the_second():
    assert ec.uses_to_break_even(1.25, 0.1) == 2  # the write, then one read: 1.25 + 0.1 < 2
    assert ec.cost_ratio(2, 1.25, 0.1) == pytest.approx(1.35 / 2)
    assert ec.cost_ratio(1, 1.25, 0.1) > 1  # used once, a write only costs more
    assert ec.uses_to_break_even(2.0, 0.1) == 3  # 2 + 0.1 = 2.1 > 2, 2 + 0.2 = 2.2 < 3
    assert ec.cost_ratio(2, 2.0, 0.1) > 1 > ec.cost_ratio(3, 2.0, 0.1)


def test_break_even_is_the_smallest_number_of_uses_that_costs_less_than_no_cache():
    for w in (0.9, 1.0, 1.25, 1.9, 2.0, 3.0):
        for r in (0.0, 0.1, 0.25, 0.5):
            n = ec.uses_to_break_even(w, r)
            assert ec.cost_ratio(n, w, r) < 1, (w, r, n)
            assert n == 1 or ec.cost_ratio(n - 1, w, r) >= 1, (w, r, n)


def test_a_read_as_dear_as_the_input_never_pays_and_says_so():
    with pytest.raises(ValueError, match="read_multiplier"):
        ec.uses_to_break_even(1.25, 1.0)


def test_a_prompt_below_the_models_minimum_is_never_cached():
    assert SONNET.min_cacheable_tokens == 1024
    assert ec.request_bill(1023, 1000, SONNET) == ec.Bill(uncached=1023, written=0, read=0)
    assert ec.request_bill(1024, 0, SONNET) == ec.Bill(uncached=0, written=1024, read=0)
    # a cached prefix shorter than the minimum is not read; the whole prompt is written again
    assert ec.request_bill(3000, 1000, SONNET) == ec.Bill(0, 3000, 0)
    assert ec.request_bill(3000, 2000, SONNET) == ec.Bill(0, 1000, 2000)
    assert {p.min_cacheable_tokens for p in ec.PRICES.values() if p.vendor == "Anthropic"} == {1024, 2048, 4096}


def test_openai_reads_in_steps_of_128_tokens_with_no_write_premium():
    bill = ec.request_bill(2000, 1300, GPT5)
    assert bill == ec.Bill(0, 2000 - 1280, 1280)
    assert bill.cost(GPT5) == pytest.approx((720 + 1280 * 0.1) * 1.25 / 1e6)
    assert ec.request_bill(2000, 0, GPT5).cost(GPT5) == ec.request_bill(2000, 0, GPT5, cache=False).cost(GPT5)


def test_bill_cost_applies_the_multipliers():
    bill = ec.Bill(uncached=100, written=1000, read=10_000)
    assert bill.tokens == 11_100
    assert bill.cost(SONNET) == pytest.approx((100 + 1000 * 1.25 + 10_000 * 0.1) * 3.0 / 1e6)
    assert bill.cost(SONNET_1H) == pytest.approx((100 + 1000 * 2.0 + 10_000 * 0.1) * 3.0 / 1e6)


def test_a_growing_context_reaches_a_high_hit_rate_and_the_ideal_rate_is_its_closed_form():
    lengths = ec.growing_context(base=2000, append=150, steps=20)
    assert lengths[:3] == [2000, 2150, 2300]
    rate = ec.agent_loop_hit_rate(2000, 150, 20)
    assert rate == pytest.approx(sum(lengths[:-1]) / sum(lengths))
    assert 0.85 < rate < 0.95
    assert ec.agent_loop_hit_rate(2000, 150, 200) > rate  # it climbs toward 1 - append / context


def test_a_changed_early_token_turns_caching_into_a_surcharge():
    lengths = ec.growing_context(base=2000, append=150, steps=20)
    plain = ec.replay_cost(lengths, [0] * 20, SONNET, cache=False)
    hits = ec.replay_cost(lengths, [0] + lengths[:-1], SONNET)
    misses = ec.replay_cost(lengths, [0] * 20, SONNET)  # every prompt written, never read
    assert hits < 0.25 * plain
    assert misses == pytest.approx(1.25 * plain)


def test_bad_inputs_name_the_limit():
    with pytest.raises(ValueError, match="cached_prefix must be between 0 and prompt_tokens"):
        ec.request_bill(100, 200, SONNET)
    with pytest.raises(ValueError, match="one per prompt"):
        ec.replay_cost([1, 2], [0], SONNET)
    with pytest.raises(ValueError, match="read_multiplier"):
        ec.CachePrices("x", "y", 1.0, 1.0, 1.5, 0)


def test_the_table_is_dated_and_every_row_names_its_source():
    assert ec.PRICES_AS_OF.count("-") == 2
    assert all(p.source.startswith("https://") for p in ec.PRICES.values())
    assert "as of " + ec.PRICES_AS_OF in ec.table()
