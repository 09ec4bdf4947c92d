"""Checker for exercise 10a: a two-tier LRU block store under the prefix cache.

    class TwoTierStore(fast_blocks, slow_blocks):
        put(key, value)     the key becomes the most recent block of the fast tier (leaving the slow
                            tier if it was there); the fast tier's least recent block beyond its
                            capacity goes DOWN to the slow tier (as its most recent); the slow tier's
                            least recent beyond its capacity is dropped
        get(key)            its value or None; a hit makes the key the most recent of its own tier
        key in store        held by either tier (no change of order)
        where(key)          "fast", "slow" or None

Two stages, each stopping at the first problem with a message that says where:
  1. check_two_tier_store: taught scripts, then random operations against a reference built on two
     OrderedDicts; after each operation every key's tier and every get's value are compared
  2. check_store_in_engine: the engine's pool evicts into your store (the `kv_offload_store` seam) on a
     chat that no longer fits the pool; the tokens must equal recomputing, and the hits per tier and
     what each tier holds at the end must equal the reference store's
"""
from __future__ import annotations

import random
from collections import OrderedDict

from minikv.checks.report import fail, passed


class ReferenceTwoTierStore:
    """The contract on two OrderedDicts (least recent first)."""

    def __init__(self, fast_blocks: int, slow_blocks: int):
        if fast_blocks < 1 or slow_blocks < 1:
            raise ValueError(f"each tier holds at least one block, got {fast_blocks} and {slow_blocks}")
        self.fast_blocks, self.slow_blocks = fast_blocks, slow_blocks
        self.fast: OrderedDict = OrderedDict()
        self.slow: OrderedDict = OrderedDict()

    def put(self, key, value) -> None:
        self.slow.pop(key, None)
        self.fast[key] = value
        self.fast.move_to_end(key)
        if len(self.fast) > self.fast_blocks:
            old, old_value = self.fast.popitem(last=False)
            self.slow[old] = old_value  # down a tier, as the slow tier's most recent
            if len(self.slow) > self.slow_blocks:
                self.slow.popitem(last=False)  # out of the last tier: dropped

    def get(self, key):
        for tier in (self.fast, self.slow):
            if key in tier:
                tier.move_to_end(key)
                return tier[key]
        return None

    def __contains__(self, key) -> bool:
        return key in self.fast or key in self.slow

    def where(self, key) -> str | None:
        return "fast" if key in self.fast else "slow" if key in self.slow else None


# ---- stage 1 -------------------------------------------------------------------------------------
SCRIPTS = [  # (lesson, fast, slow, operations): ("put", k) / ("get", k)
    ("blocks within the fast tier's capacity stay there", 2, 2, [("put", "a"), ("put", "b")]),
    ("the fast tier's least recent block goes down to the slow tier", 2, 2,
     [("put", "a"), ("put", "b"), ("put", "c")]),
    ("the slow tier's least recent block is dropped", 1, 2,
     [("put", "a"), ("put", "b"), ("put", "c"), ("put", "d")]),
    ("a hit in the fast tier makes its block the most recent: another one goes down", 2, 2,
     [("put", "a"), ("put", "b"), ("get", "a"), ("put", "c")]),
    ("a hit in the slow tier makes it the slow tier's most recent: another one is dropped", 1, 2,
     [("put", "a"), ("put", "b"), ("put", "c"), ("get", "a"), ("put", "d")]),
    ("put of a key in the slow tier brings it back up to the fast tier", 1, 2,
     [("put", "a"), ("put", "b"), ("put", "a")]),
    ("put of a key already in the fast tier refreshes it, nothing moves down", 2, 2,
     [("put", "a"), ("put", "b"), ("put", "a"), ("put", "c")]),
    ("a miss returns None and changes nothing", 1, 1, [("put", "a"), ("get", "z"), ("put", "b")]),
]


def _value(key, version: int = 0):
    return ("K/V of", key, version)


def _state(store, keys) -> dict:
    return {k: store.where(k) for k in keys}


def _call(case: str, store, op: str, key, value=None):
    try:
        return store.put(key, value) if op == "put" else store.get(key)
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001  shown to the learner
        fail(case, f"{op}({key!r}) raised {type(e).__name__}", str(e))


def _compare(case: str, mine, ref, keys, op, key, got, want) -> None:
    if op == "get" and got != want:
        fail(case, f"get({key!r}) returned {got!r}", f"expected {want!r}",
             "get returns the value put under this very key, None when neither tier holds it")
    try:
        have = _state(mine, keys)
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001
        fail(case, f"where() raised {type(e).__name__}", str(e), 'where(key) returns "fast", "slow" or None')
    should = _state(ref, keys)
    if have != should:
        bad = next(k for k in keys if have[k] != should[k])
        hint = ("the fast tier's least recent block goes down to the slow tier, never straight out"
                if should[bad] == "slow" and have[bad] is None else
                "only the slow tier's least recent block is dropped, and only when it is over capacity"
                if should[bad] is not None and have[bad] is None else
                "a hit (get) makes a key the most recent of its own tier; put makes it the fast tier's most recent")
        fail(case, f"key {bad!r} is in tier {have[bad]!r}", f"expected {should[bad]!r}\n  every key: expected "
             f"{should}\n             got      {have}", hint)
    for k in keys:
        if (k in mine) != (should[k] is not None):
            fail(case, f"`{k!r} in store` is {k in mine}", f"expected {should[k] is not None}",
                 "__contains__ looks in both tiers")


def check_two_tier_store(store_cls, num_random: int = 300, seed: int = 0) -> None:
    for n, (lesson, fast, slow, script) in enumerate(SCRIPTS):
        mine, ref, done = store_cls(fast, slow), ReferenceTwoTierStore(fast, slow), []
        keys = sorted({k for _, k in script})
        for op, key in script:
            done.append(f"{op}({key!r})")
            case = f"case {n}: {lesson}\n  TwoTierStore({fast}, {slow}), then {', '.join(done)}"
            got = _call(case, mine, op, key, _value(key))
            want = ref.put(key, _value(key)) if op == "put" else ref.get(key)
            _compare(case, mine, ref, keys, op, key, got, want)
    rng = random.Random(seed)
    for trial in range(3):
        fast, slow = rng.randint(1, 4), rng.randint(1, 6)
        mine, ref, keys, done = store_cls(fast, slow), ReferenceTwoTierStore(fast, slow), list("abcdefghij"), []
        for i in range(num_random // 3):
            op, key = rng.choice(["put", "put", "get"]), rng.choice(keys)
            done.append(f"{op}({key!r})")
            case = (f"random run {trial}: TwoTierStore({fast}, {slow}), operation {i + 1}; the last few: "
                    f"{', '.join(done[-6:])}")
            value = _value(key, i)
            got = _call(case, mine, op, key, value)
            want = ref.put(key, value) if op == "put" else ref.get(key)
            _compare(case, mine, ref, keys, op, key, got, want)
    passed(len(SCRIPTS) + num_random // 3 * 3, "your TwoTierStore keeps, moves down and drops the blocks the "
                                              "reference does, and get returns each key's own value")


# ---- stage 2 -------------------------------------------------------------------------------------
def chat(llm, params, users: int = 3, turns: int = 3) -> tuple[list[list[int]], list[list[int]]]:
    """Users take turns; each prompt is the user's whole history. Returns (outputs, final histories)."""
    system = list(range(300, 308))
    history = [system + [(37 * u + j) % 250 + 1 for j in range(6)] for u in range(users)]
    outs = []
    for turn in range(turns):
        for u in range(users):
            out = llm.generate({"prompt_token_ids": history[u]}, params)[0]
            outs.append(out.token_ids)
            history[u] = history[u] + out.token_ids + [(41 * u + 5 * turn + j) % 250 + 1 for j in range(6)]
    return outs, history


def check_store_in_engine(llm, store_cls, fast_blocks: int, slow_blocks: int) -> dict:
    """`llm` runs with kv_offload_store=store_cls(fast_blocks, slow_blocks) on a pool too small for the
    chat. Same tokens as recomputing; same hits per tier and same final tiers as the reference store."""
    from minikv import SamplingParams

    store = llm.offload_store
    if store is None or type(store).__name__ != store_cls.__name__:
        raise ValueError("build the LLM with kv_offload_store=TwoTierStore(fast_blocks, slow_blocks)")
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    mine, history = chat(llm, params)
    pc = llm.stats()["prefix_cache"]
    off = llm.derive(kv_offload_store=None)
    want, _ = chat(off, params)
    reference = llm.derive(kv_offload_store=ReferenceTwoTierStore(fast_blocks, slow_blocks))
    chat(reference, params)
    ref_pc = reference.stats()["prefix_cache"]
    for i, (got, exp) in enumerate(zip(mine, want)):
        if got != exp:
            fail(f"request {i + 1} of the chat", "its tokens differ from recomputing every block",
                 f"expected {exp}\ngot      {got}",
                 "get must return the very value put under that key (a block's K/V), never another's")
    if not ref_pc["evicted_blocks"]:
        fail("the whole run", "the pool evicted nothing", "the store was never used",
             "build the LLM with a smaller num_blocks")
    if pc["hits_by_tier"] != ref_pc["hits_by_tier"]:
        fail("the whole run", f"tokens served per tier {pc['hits_by_tier']}",
             f"with the reference store {ref_pc['hits_by_tier']}",
             "the same evictions must leave the same blocks in the same tiers")
    keys = list(reference.offload_store.fast) + list(reference.offload_store.slow)
    have = {k.hex()[:8]: store.where(k) for k in keys}
    should = {k.hex()[:8]: reference.offload_store.where(k) for k in keys}
    if have != should or len(keys) != sum(1 for k in keys if k in store):
        fail("the end of the run", f"your tiers hold {have}", f"the reference's hold {should}")
    served = sum(v for t, v in pc["hits_by_tier"].items() if t != "pool")
    passed(len(mine), f"the engine's tokens equal recomputing, {served} tokens came back from your store "
                      f"({', '.join(f'{t} {v}' for t, v in pc['hits_by_tier'].items())})")
    return pc
