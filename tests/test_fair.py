"""Fair scheduling between tenants (schedule_policy="vtc", minikv/engine/fair.py): a tenant that floods
the engine cannot starve another's requests; the order changes, the tokens of each request do not."""
from __future__ import annotations

import pytest

from minikv import LLM, SamplingParams
from minikv.engine.fair import VirtualTokenCounter, WaitingInfo, pick_next
from minikv.engine.sequence import Sequence


class Admissions:
    def __init__(self):
        self.order: list[str] = []

    def on_event(self, llm, step, request_id, event):
        if event == "admit":
            self.order.append(request_id)


def flood_then_one(policy: str, **options) -> tuple[list[str], dict]:
    """Tenant A queues 10 requests, then tenant B one; two seats. Returns the admission order and outputs."""
    llm = LLM("tiny-random", kv_backend="paged", block_size=4, num_blocks=64, max_num_seqs=2,
              schedule_policy=policy, **options)
    seen = Admissions()
    llm.add_observer(seen)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    seqs = [llm.add_request([3 + i] * 10, params, request_id=f"A{i}", tenant="A") for i in range(10)]
    seqs.append(llm.add_request([99] * 4, params, request_id="B0", tenant="B"))
    while llm.has_unfinished():
        llm.step()
    return seen.order, {s.request_id: s.output_token_ids for s in seqs}


def test_fcfs_makes_the_short_request_of_a_quiet_tenant_wait_behind_the_whole_flood():
    order, _ = flood_then_one("fcfs")
    assert order.index("B0") == 10


def test_vtc_admits_the_quiet_tenant_as_soon_as_a_seat_frees_and_changes_no_tokens():
    order, outputs = flood_then_one("vtc")
    assert order.index("B0") == 1  # A0 is charged its prompt on admission; B, served nothing yet, goes next
    assert outputs == flood_then_one("fcfs")[1]  # same tokens per request, only the order differs


def test_an_idle_tenant_banks_no_credit():
    vtc = VirtualTokenCounter()
    a = Sequence([1] * 8, SamplingParams())
    a.tenant = "A"
    vtc.arrive(a, [])
    vtc.admitted(a, 1000)  # A has been served a lot while B was away
    b = Sequence([1] * 8, SamplingParams())
    b.tenant = "B"
    vtc.counters["B"] = 10.0
    vtc.arrive(b, [a])  # B comes back: lifted to the smallest counter of the tenants that have work
    assert vtc.counters == {"A": 1000.0, "B": 1000.0}
    vtc.generated(b, 3)
    assert vtc.counters["B"] == 1000.0 + 2.0 * 3  # an output token weighs twice a prompt token


def test_priority_still_applies_within_a_tenant():
    waiting = [WaitingInfo("A0", "A", 0, 0, 5), WaitingInfo("A1", "A", -1, 1, 5), WaitingInfo("B0", "B", 0, 2, 5)]
    assert pick_next(waiting, {"A": 0.0, "B": 50.0}) == "A1"  # A has had less service; its urgent one first
    assert pick_next(waiting, {"A": 80.0, "B": 50.0}) == "B0"


def test_a_learners_pick_next_runs_through_the_named_seam_and_a_wrong_answer_is_named():
    calls = []

    def oldest_first(waiting, counters):
        calls.append(len(waiting))
        return waiting[0].request_id

    order, _ = flood_then_one("vtc", pick_next=oldest_first)
    assert calls and order.index("B0") == 10  # the learner's rule is the one that ran: FCFS again
    with pytest.raises(ValueError, match="bad returned 'nobody', which is not a waiting request"):
        def bad(waiting, counters):
            return "nobody"
        flood_then_one("vtc", pick_next=bad)
    with pytest.raises(ValueError, match="pick_next plugs into rung 10"):
        LLM("tiny-random", kv_backend="paged", pick_next=oldest_first)
