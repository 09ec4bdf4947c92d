"""Checker for exercise 11a: the fair scheduler's choice of the next request (a virtual token counter).

    pick_next(waiting, counters) -> request_id
        waiting   list[WaitingInfo]: request_id, tenant, priority, order (0 = first in the queue), num_tokens
        counters  {tenant: service so far}; a tenant missing from it has had none (0)
        returns   the request of the backlogged tenant with the smallest counter; within that tenant,
                  the smallest priority value, then the smallest order. Tenants with equal counters:
                  the one whose request comes first in the queue.

Two stages, each stopping at the first problem with a message that says where:
  1. taught cases (FCFS is not fair, the smallest counter, priorities within a tenant, ties, a tenant
     never served), then random queues against the reference `minikv.engine.fair.pick_next`
  2. (check_fair_in_engine) tiny-random with schedule_policy="vtc" and your pick_next as the seam:
     tenant A floods, tenant B sends a few short requests; the admission order must be the engine's
     own, B must not wait behind the flood, and every request's tokens must equal FCFS's
"""
from __future__ import annotations

import random

from minikv.checks.report import fail, passed
from minikv.engine.fair import WaitingInfo
from minikv.engine.fair import pick_next as reference_pick_next


def _w(rid: str, tenant: str, order: int, priority: int = 0, num_tokens: int = 16) -> WaitingInfo:
    return WaitingInfo(rid, tenant, priority, order, num_tokens)


CASES = [  # (lesson, waiting, counters, hint if the answer is wrong)
    ("the first in the queue is not always next: tenant B has had less service than tenant A",
     [_w("A1", "A", 0), _w("A2", "A", 1), _w("B1", "B", 2)], {"A": 900.0, "B": 40.0},
     "pick the TENANT first (the smallest counter among tenants with a waiting request), then its request"),
    ("the smallest counter wins, whatever the queue order",
     [_w("C1", "C", 0), _w("A1", "A", 1), _w("B1", "B", 2)], {"A": 300.0, "B": 200.0, "C": 250.0},
     "compare counters[tenant] of every waiting request's tenant; the smallest one wins"),
    ("within the chosen tenant, its oldest request goes first",
     [_w("A1", "A", 0), _w("B1", "B", 1), _w("B2", "B", 2)], {"A": 90.0, "B": 10.0},
     "among the chosen tenant's requests, take the smallest order"),
    ("priorities still apply within a tenant: its most important request (lowest value) goes first",
     [_w("B1", "B", 0), _w("A1", "A", 1), _w("B2", "B", 2, priority=-1)], {"A": 70.0, "B": 10.0},
     "within a tenant, sort by (priority, order): a lower priority value is more important"),
    ("a priority does not jump the fair order between tenants",
     [_w("A1", "A", 0, priority=-5), _w("B1", "B", 1)], {"A": 500.0, "B": 10.0},
     "priority orders the requests of ONE tenant; which tenant goes next is decided by the counters alone"),
    ("equal counters: the tenant whose request comes first in the queue",
     [_w("B1", "B", 0), _w("A1", "A", 1)], {"A": 50.0, "B": 50.0},
     "break ties between tenants by the order of their first waiting request (FCFS among equals)"),
    ("a tenant missing from counters has had no service at all (0)",
     [_w("A1", "A", 0), _w("N1", "new", 1)], {"A": 5.0},
     "use counters.get(tenant, 0.0): a tenant never served counts 0"),
    ("a tenant with nothing waiting is not a candidate, however small its counter",
     [_w("A1", "A", 0), _w("B1", "B", 1)], {"A": 80.0, "B": 60.0, "idle": 0.0},
     "only the tenants of the waiting requests are candidates; return a waiting request's id"),
    ("one waiting request: it is next", [_w("A7", "A", 0)], {"A": 1e6}, "return its request_id"),
]


def _ask(pick_next, case: str, waiting: list[WaitingInfo], counters: dict[str, float]):
    try:
        return pick_next(list(waiting), dict(counters))
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001  shown to the learner
        fail(case, f"pick_next raised {type(e).__name__}: {e}", "expected the request_id of a waiting request")


def _show(waiting: list[WaitingInfo], counters: dict[str, float]) -> str:
    rows = "\n".join(f"    {w.request_id:>4}  tenant {w.tenant!r:8} priority {w.priority:>3}  order {w.order}"
                     for w in waiting)
    return f"  waiting:\n{rows}\n  counters: {counters}"


def check_pick_next(pick_next, num_random: int = 300, seed: int = 0) -> None:
    for n, (lesson, waiting, counters, hint) in enumerate(CASES):
        case = f"case {n}: {lesson}\n{_show(waiting, counters)}"
        got, want = _ask(pick_next, case, waiting, counters), reference_pick_next(waiting, counters)
        if got is None:
            fail(case, "pick_next returned None", f"expected {want!r}", "did it forget to `return`?")
        if got != want:
            fail(case, f"pick_next returned {got!r}", f"expected {want!r}", hint)
    rng = random.Random(seed)
    for i in range(num_random):
        tenants = rng.sample(["A", "B", "C", "D", "E"], rng.randint(1, 4))
        waiting = [_w(f"r{j}", rng.choice(tenants), j, rng.choice([0, 0, 0, 1, -1])) for j in range(rng.randint(1, 8))]
        counters = {t: float(rng.choice([0, 10, 10, 40, 100, 250])) for t in tenants if rng.random() < 0.9}
        case = f"random queue {i}\n{_show(waiting, counters)}"
        got, want = _ask(pick_next, case, waiting, counters), reference_pick_next(waiting, counters)
        if got != want:
            fail(case, f"pick_next returned {got!r}", f"expected {want!r}",
                 "smallest counter (missing = 0; ties: the tenant first in the queue), then within that "
                 "tenant the smallest (priority, order)")
    passed(len(CASES) + num_random, "pick_next chooses the least-served tenant's most important, oldest request")


# ---- stage 2: inside the engine -------------------------------------------------------------------

class _Admissions:
    def __init__(self) -> None:
        self.order: list[str] = []

    def on_event(self, llm, step, request_id, event) -> None:
        if event == "admit":
            self.order.append(request_id)


def noisy_neighbour(llm, pick_next=None, policy: str = "vtc", flood: int = 12, quiet: int = 3):
    """Tenant A queues `flood` requests, then B `quiet` short ones, in one go; two seats. Returns
    (admission order, {request_id: tokens}). `llm` is derived with the policy and the seam."""
    from minikv import SamplingParams

    opts = {"schedule_policy": policy, "max_num_seqs": 2, "prefix_caching": None}
    if pick_next is not None:
        opts["pick_next"] = pick_next
    engine = llm.derive(**opts)
    seen = _Admissions()
    engine.add_observer(seen)
    seqs = [engine.add_request([3 + i] * 12, SamplingParams(max_tokens=8, ignore_eos=True), request_id=f"A{i}",
                               tenant="A") for i in range(flood)]
    seqs += [engine.add_request([200 + i] * 4, SamplingParams(max_tokens=3, ignore_eos=True), request_id=f"B{i}",
                                tenant="B") for i in range(quiet)]
    while engine.has_unfinished():
        engine.step()
    return seen.order, {s.request_id: list(s.output_token_ids) for s in seqs}


def check_fair_in_engine(llm, pick_next) -> list[str]:
    """`llm`: a paged engine (tiny-random is enough). Your pick_next runs as the engine's seam
    (`schedule_policy="vtc", pick_next=...`) on a noisy neighbour; returns your admission order."""
    try:
        mine, tokens = noisy_neighbour(llm, pick_next)
    except NotImplementedError:
        raise
    except ValueError as e:
        fail("tenant A floods (12 requests), then tenant B sends 3 short ones; 2 seats", "the engine refused "
             "your answer", str(e))
    want, ref_tokens = noisy_neighbour(llm)
    fcfs, fcfs_tokens = noisy_neighbour(llm, policy="fcfs")
    case = "tenant A floods (12 requests), then tenant B sends 3 short ones; 2 seats"
    if mine != want:
        i = next(k for k, (a, b) in enumerate(zip(mine, want)) if a != b)
        fail(case, f"admission {i} was {mine[i]!r}", f"the engine's fair scheduler admits {want[i]!r} there\n"
             f"  yours:  {' '.join(mine)}\n  engine: {' '.join(want)}", "stage 1 passed on single choices: "
             "does your function keep state between calls, or change `waiting` or `counters`?")
    b_last = max(mine.index(f"B{i}") for i in range(3))
    if b_last >= fcfs.index("B0"):
        fail(case, f"B's last request was admission {b_last}", f"under FCFS B's first is admission "
             f"{fcfs.index('B0')}: fairness should let B in long before that")
    if tokens != fcfs_tokens or tokens != ref_tokens:
        rid = next(r for r in tokens if tokens[r] != fcfs_tokens[r])
        fail(case, f"request {rid} generated other tokens than under FCFS", "the scheduler changes the ORDER, "
             "never a request's tokens", "a request's tokens depend on its prompt only (greedy)")
    passed(3, f"the engine ran your pick_next: B admitted at {[mine.index(f'B{i}') for i in range(3)]} (FCFS: "
              f"{[fcfs.index(f'B{i}') for i in range(3)]}), every request's tokens unchanged")
    return mine
