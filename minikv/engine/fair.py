"""Fair scheduling between tenants: a virtual token counter (VTC), after Sheng et al., "Fairness in
Serving Large Language Models" (OSDI 2024).

First come, first served lets one tenant that floods the server take every seat: a short request of
another tenant waits behind the whole flood. VTC keeps one counter per tenant, the service it got:

    counter[t] += w_prompt * prompt tokens computed      when a request of t is admitted
    counter[t] += w_output                               for every token generated for t

and admits next a request of the backlogged tenant with the SMALLEST counter (within a tenant: the
most important priority, then the oldest). A tenant that was idle does not bank credit: when it
comes back, its counter is lifted to the smallest counter among the tenants that are waiting, so it
gets its share from now on, not a burst that makes up for the past.

    waiting:  A1 A2 A3 A4 A5 B1          counters: A 9,000   B 120
    FCFS admits A1;  VTC admits B1 (B has had less service), then A1, A2, ...

The choice of the next request is a named seam: `LLM(..., schedule_policy="vtc", pick_next=fn)`,
where fn(waiting, counters) -> request_id (exercise 11a). Seats, blocks and the token budget are
still the scheduler's business: VTC only orders who asks for them first.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from minikv.engine.sequence import Sequence

W_PROMPT, W_OUTPUT = 1.0, 2.0  # the paper's weights: an output token costs about twice a prompt token


@dataclass(frozen=True)
class WaitingInfo:
    """What the fair policy sees of a waiting request. `order` is its place in the waiting queue
    (0 = first: the oldest, or a preempted request put back at the front)."""

    request_id: str
    tenant: str
    priority: int
    order: int
    num_tokens: int


PickNext = Callable[[list[WaitingInfo], dict[str, float]], str]


def tenant_of(seq: Sequence) -> str:
    """A request's tenant (its root's: the samples of one request belong to its tenant); "" if none."""
    return seq.root.tenant or ""


def pick_next(waiting: list[WaitingInfo], counters: dict[str, float]) -> str:
    """The request VTC admits next: of the tenant with the smallest counter, the most important
    (lowest priority value), then the first in the queue. Ties between tenants go to the tenant
    whose first request is first in the queue."""
    first = min(waiting, key=lambda w: (counters.get(w.tenant, 0.0), w.order))
    mine = [w for w in waiting if w.tenant == first.tenant]
    return min(mine, key=lambda w: (w.priority, w.order)).request_id


class VirtualTokenCounter:
    """The counters of the tenants, and the choice of the next waiting request."""

    def __init__(self, pick: PickNext | None = None, w_prompt: float = W_PROMPT, w_output: float = W_OUTPUT):
        self.counters: dict[str, float] = {}
        self.pick = pick or pick_next
        self.w_prompt, self.w_output = w_prompt, w_output

    def arrive(self, seq: Sequence, backlogged: Iterable[Sequence]) -> None:
        """A request arrives. If its tenant had nothing queued or running, lift its counter to the
        smallest counter of the tenants that have (no credit banked while idle)."""
        tenant = tenant_of(seq)
        active = {tenant_of(s) for s in backlogged if s is not seq}
        if tenant in active:
            return
        floor = min((self.counters.get(t, 0.0) for t in active), default=None)
        current = self.counters.get(tenant, 0.0)
        self.counters[tenant] = current if floor is None else max(current, floor)

    def admitted(self, seq: Sequence, prompt_tokens: int) -> None:
        """Charge the prompt tokens the engine computes for it (a prefix-cache hit is free)."""
        t = tenant_of(seq)
        self.counters[t] = self.counters.get(t, 0.0) + self.w_prompt * prompt_tokens

    def generated(self, seq: Sequence, num_tokens: int = 1) -> None:
        t = tenant_of(seq)
        self.counters[t] = self.counters.get(t, 0.0) + self.w_output * num_tokens

    def next_index(self, waiting: list[Sequence]) -> int:
        """Index in `waiting` of the request to admit next (checked: a wrong answer names the fix)."""
        infos = [WaitingInfo(s.request_id, tenant_of(s), s.params.priority, i, s.num_tokens)
                 for i, s in enumerate(waiting)]
        rid = self.pick(infos, dict(self.counters))
        for i, w in enumerate(infos):
            if w.request_id == rid:
                return i
        name = getattr(self.pick, "__name__", "pick_next")
        raise ValueError(f"{name} returned {rid!r}, which is not a waiting request; return the request_id of one "
                         f"of {[w.request_id for w in infos][:8]}")
