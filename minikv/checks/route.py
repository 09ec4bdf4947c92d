"""Checker for exercise 15a: the router's choice of a replica (match or balance).

    choose(replicas, blocks, turn) -> index
        replicas  list[ReplicaState]: up, load (requests in flight), matched (blocks of this request's
                  prefix the router believes the replica holds), cached (blocks it holds in all)
        blocks    full blocks in the request
        turn      a counter that grows by one per request (to share ties in turn)
        returns   the replica holding the longest prefix (ties: less loaded, then lower index) when that
                  prefix is more than `min_match` (half) of the request and the replica has at most
                  `balance_threshold` (4) requests in flight beyond the least loaded one; else the least
                  loaded replica (ties: fewest cached blocks, then the `turn`-th of those left). Never a
                  replica that is down.

Two stages, each stopping at the first problem with a message that says where:
  1. taught cases, then random states against the reference `minikv.serve.router.cache_aware`
  2. (check_route_in_router) your choose as the router's policy seam, on a scripted multi-turn chat
     load of many users: every routing decision must be the reference policy's, each user's later
     turns must stay on one replica, and more prefix blocks must be found than under round robin
"""
from __future__ import annotations

import random

from minikv.checks.report import fail, passed
from minikv.serve.router import ReplicaState, RouterState, cache_aware


def _r(up: bool, load: int, matched: int, cached: int) -> ReplicaState:
    return ReplicaState(up, load, matched, cached)


CASES = [  # (lesson, replicas, blocks, turn, hint if the answer is wrong)
    ("the longest cached prefix wins when loads are close",
     [_r(True, 1, 2, 40), _r(True, 2, 9, 40), _r(True, 0, 0, 40)], 12, 0,
     "take the replica with the most `matched` blocks when its match counts and its load is close to the least"),
    ("a match must cover more than half the request to count: a shared system prompt is no reason to pile up",
     [_r(True, 0, 3, 40), _r(True, 0, 0, 10)], 10, 0,
     "3 of 10 blocks is not more than half: fall back to the least loaded replica (ties: fewest cached blocks)"),
    ("balance beats the match when that replica has more than 4 requests in flight beyond the least loaded",
     [_r(True, 7, 9, 40), _r(True, 2, 0, 40)], 10, 0,
     "compare replicas[best].load - min(load) with 4: more than 4 beyond, and the least loaded wins"),
    ("exactly 4 beyond the least loaded is still close enough: the match wins",
     [_r(True, 6, 9, 40), _r(True, 2, 0, 40)], 10, 0,
     "the threshold allows up to 4 requests beyond the least loaded (<= 4, not < 4)"),
    ("a replica that is down is never chosen, however much it holds",
     [_r(False, 0, 10, 90), _r(True, 3, 0, 5), _r(True, 3, 0, 2)], 10, 0,
     "skip replicas with up == False in every step (the match, the least load and the ties)"),
    ("no match anywhere: the least loaded replica",
     [_r(True, 3, 0, 1), _r(True, 1, 0, 50), _r(True, 2, 0, 0)], 6, 0,
     "without a match, the smallest load wins, whatever the caches hold"),
    ("equal loads and no match: the replica holding fewest blocks, so new conversations spread",
     [_r(True, 0, 0, 30), _r(True, 0, 0, 10), _r(True, 0, 0, 20)], 6, 0,
     "among the least loaded, take the one with the fewest `cached` blocks"),
    ("a tie on load and cached blocks is shared in turn",
     [_r(True, 0, 0, 0), _r(True, 0, 0, 0), _r(True, 1, 0, 0)], 4, 3,
     "among replicas equal on load and cached blocks (in index order), take the (turn % count)-th"),
    ("two replicas hold the same prefix: the less loaded of them",
     [_r(True, 3, 8, 40), _r(True, 1, 8, 40)], 10, 0,
     "ties on `matched` go to the less loaded replica, then to the lower index"),
]


def _ask(choose, case: str, replicas: list[ReplicaState], blocks: int, turn: int):
    try:
        return choose(list(replicas), blocks, turn)
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001  shown to the learner
        fail(case, f"choose raised {type(e).__name__}: {e}", "expected the index of a replica that is up")


def _show(replicas: list[ReplicaState], blocks: int, turn: int) -> str:
    rows = "\n".join(f"    {i}: up {r.up!s:5}  load {r.load:>2}  matched {r.matched:>2}  cached {r.cached:>3}"
                     for i, r in enumerate(replicas))
    return f"  request of {blocks} blocks, turn {turn}; replicas:\n{rows}"


def check_choose(choose, num_random: int = 300, seed: int = 0) -> None:
    for n, (lesson, replicas, blocks, turn, hint) in enumerate(CASES):
        case = f"case {n}: {lesson}\n{_show(replicas, blocks, turn)}"
        got, want = _ask(choose, case, replicas, blocks, turn), cache_aware(replicas, blocks, turn)
        if got is None:
            fail(case, "choose returned None", f"expected {want}", "did it forget to `return`?")
        if got != want:
            fail(case, f"choose returned {got!r}", f"expected {want}", hint)
    rng = random.Random(seed)
    for i in range(num_random):
        blocks = rng.randint(1, 12)
        replicas = [_r(rng.random() < 0.85, rng.choice([0, 0, 1, 2, 3, 5, 8]), rng.randint(0, blocks),
                       rng.choice([0, 10, 10, 30])) for _ in range(rng.randint(1, 4))]
        if not any(r.up for r in replicas):
            replicas[0] = _r(True, *[getattr(replicas[0], f) for f in ("load", "matched", "cached")])
        turn = rng.randint(0, 9)
        case = f"random state {i}\n{_show(replicas, blocks, turn)}"
        got, want = _ask(choose, case, replicas, blocks, turn), cache_aware(replicas, blocks, turn)
        if got != want:
            fail(case, f"choose returned {got!r}", f"expected {want}",
                 "the longest match if it covers more than half the request and its load is within 4 of the "
                 "least; else the least loaded (ties: fewest cached, then the turn-th); never a replica down")
    passed(len(CASES) + num_random, "choose matches the cached prefix or balances the load as the router does")


# ---- stage 2: inside the router ---------------------------------------------------------------------

def chat_load(users: int = 7, turns: int = 4) -> list[tuple[int, dict, str]]:
    """(user, request body, the answer) of a multi-turn chat load, turn by turn: every user shares a
    system prompt, and each user's next prompt is the last one with its answer and a new question."""
    out = []
    for t in range(1, turns + 1):
        for u in range(users):
            msgs = [{"role": "system", "content": "You are a helpful assistant. " * 4}]
            for k in range(t):
                msgs.append({"role": "user", "content": f"user {u} asks question {k}: " + "why? " * 40})
                if k < t - 1:
                    msgs.append({"role": "assistant", "content": f"answer {k} to user {u}. " * 6})
            out.append((u, {"messages": msgs}, f"answer {t - 1} to user {u}. " * 6))
    return out


def replay(policy, replicas: int = 3, users: int = 7, turns: int = 4) -> tuple[list[int], list[list[int]], int]:
    """The load through a RouterState with `policy` as its seam (no HTTP): each request's replica, each
    user's replicas, and the prefix blocks found where the requests went."""
    state = RouterState([f"http://replica-{i}" for i in range(replicas)], policy)
    chosen, where, matched = [], [[] for _ in range(users)], 0
    for u, body, answer in chat_load(users, turns):
        units, block, salt = state.prefix_of(body, True, "")
        pick = state.pick(units, block, salt)
        i = state.replicas.index(pick.replica)
        chosen.append(i)
        where[u].append(i)
        matched += pick.matched
        state.release(pick)
        state.learn(pick, units + f"<assistant>{answer}\x1e", block, salt, None)
    return chosen, where, matched


def check_route_in_router(choose) -> list[list[int]]:
    """Your choose as the router's policy seam (`RouterState(..., policy=choose)`) on 7 users x 4 turns
    over 3 replicas; returns each user's replicas, turn by turn."""
    case = "7 users x 4 turns of chat over 3 replicas, one shared system prompt"
    try:
        mine, where, matched = replay(choose)
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001
        fail(case, f"the router failed with your choose ({type(e).__name__}: {e})", "return the index of a replica")
    want, want_where, _ = replay("cache_aware")
    if mine != want:
        k = next(i for i, (a, b) in enumerate(zip(mine, want)) if a != b)
        fail(case, f"request {k} (user {k % 7}, turn {k // 7 + 1}) went to replica {mine[k]}",
             f"the router's own policy sends it to replica {want[k]}",
             "run stage 1 first: its cases show the rule one piece at a time")
    _, _, rr_matched = replay("round_robin")
    if any(len(set(w[1:])) != 1 for w in where) or matched <= rr_matched:
        fail(case, "users' later turns moved between replicas", "each conversation should stay where its cache is")
    passed(3, f"the router ran your choose: each user's turns stay on one replica, {matched} prefix blocks found "
              f"where they went (round robin: {rr_matched})")
    return where
