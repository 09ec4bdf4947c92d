"""Exercise 11a's checker (the fair scheduler's next request) passes the right answer, catches the
mistakes learners make and names each, and runs the learner's function inside the engine."""
from __future__ import annotations

import pytest

from minikv import LLM
from minikv.checks.fair import check_fair_in_engine, check_pick_next
from minikv.checks.report import CheckFailed


def pick_next(waiting, counters):
    first = min(waiting, key=lambda w: (counters.get(w.tenant, 0.0), w.order))
    mine = [w for w in waiting if w.tenant == first.tenant]
    return min(mine, key=lambda w: (w.priority, w.order)).request_id


def fcfs(waiting, counters):
    return waiting[0].request_id


def largest_counter(waiting, counters):
    return max(waiting, key=lambda w: counters.get(w.tenant, 0.0)).request_id


def no_priority(waiting, counters):
    return min(waiting, key=lambda w: (counters.get(w.tenant, 0.0), w.order)).request_id


def priority_across_tenants(waiting, counters):
    return min(waiting, key=lambda w: (w.priority, counters.get(w.tenant, 0.0), w.order)).request_id


def missing_tenant_crashes(waiting, counters):
    first = min(waiting, key=lambda w: (counters[w.tenant], w.order))
    mine = [w for w in waiting if w.tenant == first.tenant]
    return min(mine, key=lambda w: (w.priority, w.order)).request_id


def ties_by_name(waiting, counters):
    first = min(waiting, key=lambda w: (counters.get(w.tenant, 0.0), w.tenant))
    mine = [w for w in waiting if w.tenant == first.tenant]
    return min(mine, key=lambda w: (w.priority, w.order)).request_id


def test_the_reference_answer_passes_both_stages():
    check_pick_next(pick_next)
    order = check_fair_in_engine(LLM("tiny-random", kv_backend="paged", block_size=4, num_blocks=64), pick_next)
    assert order.index("B0") < 3


@pytest.mark.parametrize("wrong, words", [
    (fcfs, "pick the TENANT first"),
    (largest_counter, "case 0: the first in the queue is not always next"),
    (no_priority, "priorities still apply within a tenant"),
    (priority_across_tenants, "a priority does not jump the fair order between tenants"),
    (missing_tenant_crashes, "raised KeyError"),
    (ties_by_name, "equal counters: the tenant whose request comes first"),
    (lambda waiting, counters: None, "forget to `return`"),
])
def test_each_mistake_is_caught_and_named(wrong, words):
    with pytest.raises(CheckFailed, match=words.replace("(", r"\(").replace(")", r"\)").replace("`", ".")):
        check_pick_next(wrong)


def test_the_engine_stage_catches_an_unfair_pick_and_the_stub():
    llm = LLM("tiny-random", kv_backend="paged", block_size=4, num_blocks=64)
    with pytest.raises(CheckFailed, match="admission 1 was 'A1'"):
        check_fair_in_engine(llm, fcfs)

    def stub(waiting, counters):
        raise NotImplementedError("write pick_next")

    with pytest.raises(NotImplementedError):
        check_pick_next(stub)
