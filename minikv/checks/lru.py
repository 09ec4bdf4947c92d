"""Checker for exercise 06d: the hash chain's LRU free queue, and releasing a finished request tail first.

    class FreeBlockQueue:                   unused cached blocks, least recently used first
        append(block)                       a block joins at the most recently used end
        remove(block)                       a hit takes it out, wherever it is (KeyError if absent)
        popleft() -> block                  the least recently used one, to evict (IndexError if empty)
        __len__, __contains__, __iter__     (iteration: least recently used first)

    release(block_table, ref_count, queue, is_cached) -> [empty blocks]
        a request finished: drop its reference to each of its blocks; a block nobody holds any more
        joins the queue when it is cached, else goes back empty (returned); tail first

Three stages, each stopping at the first problem with a message that says where:
  1. FreeBlockQueue on hand-picked operations, random ones against collections.OrderedDict, and a
     timing that tells O(1) removal from a scan
  2. release and the queue together on taught scenarios (tail first, partial blocks, shared blocks,
     two requests, a hit in between), against the same steps done by the engine's rules
  3. (check_lru_in_engine) SmolLM2 on a small pool with the hash chain keeping its unused blocks in
     your FreeBlockQueue, through the engine's seam `LLM(..., prefix_caching="hash",
     free_block_queue=FreeBlockQueue)` (an engine the check builds each time it runs, so a fixed class
     is the one checked): same tokens, hits and evictions as the engine's own HashChainCache
"""
from __future__ import annotations

import random
import time
from collections import OrderedDict
from typing import Callable

from minikv.checks.report import fail, passed

# ---- references ------------------------------------------------------------------------------------

class ReferenceQueue:
    """The same contract on an OrderedDict (what the learner's linked list must behave like)."""

    def __init__(self) -> None:
        self._d: OrderedDict[int, None] = OrderedDict()

    def append(self, block: int) -> None:
        self._d[block] = None

    def remove(self, block: int) -> None:
        del self._d[block]

    def popleft(self) -> int:
        if not self._d:
            raise IndexError("the free queue is empty")
        return self._d.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, block: int) -> bool:
        return block in self._d

    def __iter__(self):
        return iter(list(self._d))


def reference_release(block_table: list[int], ref_count: list[int], queue,
                      is_cached: Callable[[int], bool]) -> list[int]:
    empty = []
    for block in reversed(block_table):  # tail first: the request's last blocks are evicted first
        ref_count[block] -= 1
        if ref_count[block] == 0:
            if is_cached(block):
                queue.append(block)
            else:
                empty.append(block)
    return empty


# ---- stage 1: the queue ------------------------------------------------------------------------------

def _contents(queue, what: str) -> list[int]:
    try:
        return [int(b) for b in queue]
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001  shown to the learner
        fail(what, f"iterating over the queue raised {type(e).__name__}", str(e),
             "__iter__ yields the blocks, least recently used first")


def _op(queue, op: str, arg=None):
    return getattr(queue, op)() if arg is None else getattr(queue, op)(arg)


QUEUE_SCRIPTS = [  # (lesson, operations): ("append", b) / ("remove", b) / ("popleft", None)
    ("appended blocks leave in the order they came (least recently used first)",
     [("append", 4), ("append", 7), ("append", 2), ("popleft", None), ("popleft", None)]),
    ("a hit removes a block from the middle", [("append", 4), ("append", 7), ("append", 2), ("remove", 7)]),
    ("removing the first and the last block", [("append", 4), ("append", 7), ("append", 2), ("remove", 4),
                                               ("remove", 2), ("popleft", None)]),
    ("a block removed by a hit and released again goes to the back",
     [("append", 4), ("append", 7), ("append", 2), ("remove", 4), ("append", 4), ("popleft", None)]),
    ("the queue empties and fills again", [("append", 1), ("popleft", None), ("append", 2), ("append", 3),
                                           ("remove", 2), ("remove", 3), ("append", 5)]),
]


def check_free_queue(queue_cls, num_random: int = 300, seed: int = 0) -> None:
    for n, (lesson, script) in enumerate(QUEUE_SCRIPTS):
        mine, ref, done = _new(queue_cls, f"case {n}"), ReferenceQueue(), []
        for op, arg in script:
            done.append(f"{op}({'' if arg is None else arg})")
            case = f"case {n}: {lesson}\n  operations: {', '.join(done)}"
            got = _call(case, mine, op, arg)
            want = _op(ref, op, arg)
            if op == "popleft" and got != want:
                fail(case, f"popleft() returned {got!r}", f"expected {want}, the least recently used block",
                     "append adds at the back, popleft takes from the front")
            _same(case, mine, ref)
    # errors the contract names
    q = _new(queue_cls, "errors")
    try:
        q.popleft()
    except IndexError:
        pass
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001
        fail("popleft() on an empty queue", f"raised {type(e).__name__}", "expected IndexError")
    else:
        fail("popleft() on an empty queue", "returned instead of raising", "expected IndexError: nothing to evict")
    q.append(3)
    try:
        q.remove(9)
    except KeyError:
        pass
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001
        fail("remove(9) when only 3 is queued", f"raised {type(e).__name__}", "expected KeyError")
    else:
        fail("remove(9) when only 3 is queued", "returned instead of raising",
             "expected KeyError: removing a block that is not there is a bug in the caller")
    # random operations against the reference
    rng = random.Random(seed)
    mine, ref, done = _new(queue_cls, "random"), ReferenceQueue(), []
    for _ in range(num_random):
        held = list(ref)
        r = rng.random()
        if held and r < 0.3:
            op, arg = "remove", rng.choice(held)
        elif held and (r < 0.5 or len(held) == 40):  # all 40 ids queued: nothing new to append
            op, arg = "popleft", None
        else:
            op, arg = "append", rng.choice([b for b in range(40) if b not in ref])
        done.append(f"{op}({'' if arg is None else arg})")
        case = f"random operations, the last ones: {', '.join(done[-6:])}"
        got, want = _call(case, mine, op, arg), _op(ref, op, arg)
        if op == "popleft" and got != want:
            fail(case, f"popleft() returned {got!r}", f"expected {want}")
        _same(case, mine, ref)
    _timing(queue_cls)
    passed(len(QUEUE_SCRIPTS) + 2 + num_random, f"{queue_cls.__name__} keeps LRU order, removes from anywhere, "
                                                "and removes in O(1)")


def _new(queue_cls, case: str):
    try:
        return queue_cls()
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001
        fail(case, f"{queue_cls.__name__}() raised {type(e).__name__}", str(e))


def _call(case: str, queue, op: str, arg):
    try:
        return _op(queue, op, arg)
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001
        fail(case, f"{op}({'' if arg is None else arg}) raised {type(e).__name__}", str(e))


def _same(case: str, mine, ref) -> None:
    got, want = _contents(mine, case), list(ref)
    if got != want:
        hint = ("the same blocks in another order: append adds at the MOST recently used end (the back)"
                if sorted(got) == sorted(want) else
                "a removed block must leave the queue, and no block may appear twice")
        fail(case, "the queue's contents differ", f"expected {want} (least recently used first)\ngot      {got}", hint)
    try:
        n = len(mine)
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001
        fail(case, f"len(queue) raised {type(e).__name__}", str(e))
    if n != len(want):
        fail(case, f"len(queue) is {n}", f"expected {len(want)}")
    for b in want:
        if b not in mine:
            fail(case, f"{b} in queue is False", f"block {b} is queued: {want}")


def _timing(queue_cls, n: int = 8_000) -> None:
    """O(1) remove: removing n blocks from the middle must cost about what appending them did."""
    rng = random.Random(0)
    q = queue_cls()
    t0 = time.perf_counter()
    for b in range(n):
        q.append(b)
    t_append = time.perf_counter() - t0
    order = list(range(n // 4, 3 * n // 4))
    rng.shuffle(order)
    t0 = time.perf_counter()
    for b in order:
        q.remove(b)
    t_remove = time.perf_counter() - t0
    per_append, per_remove = t_append / n, t_remove / len(order)
    if per_remove > 40 * per_append + 2e-5:
        fail(f"{n:,} blocks appended, then {len(order):,} removed from the middle in random order",
             f"a remove took {per_remove * 1e6:.1f} us, an append {per_append * 1e6:.1f} us",
             "remove scans the queue: with a pool of 100,000 blocks every prefix hit would pay for it",
             "keep each block's neighbours (prev and next) in dicts or on nodes found through a dict: a doubly "
             "linked list unlinks a block in O(1); list.remove and deque.remove are O(n)")


# ---- stage 2: release ----------------------------------------------------------------------------------

RELEASE_SCENARIOS = [
    # (lesson, steps): ("start", table) a request takes these blocks (cached ones come out of the queue:
    # a hit); ("finish", table, cached or None = all) release; ("evict", n) popleft n times
    ("a request of 3 cached blocks finishes: its LAST block is evicted first",
     [("start", [4, 7, 2]), ("finish", [4, 7, 2], None), ("evict", 1)]),
    ("its partial last block holds no key: it goes back empty, not into the queue",
     [("start", [4, 7, 9]), ("finish", [4, 7, 9], {4, 7}), ("evict", 1)]),
    ("a block another request still holds stays out of the queue",
     [("start", [4]), ("start", [4, 7, 2]), ("finish", [4, 7, 2], None)]),
    ("two requests finish one after the other: the first one's blocks go first (LRU)",
     [("start", [1, 2]), ("start", [5, 6]), ("finish", [1, 2], None), ("finish", [5, 6], None), ("evict", 3)]),
    ("a second request hits the first one's prefix; once it finishes, the shared prefix is the last to go",
     [("start", [1, 2, 3]), ("finish", [1, 2, 3], None), ("start", [1, 2, 8]), ("finish", [1, 2, 8], None),
      ("evict", 4)]),
]


def check_release(release, queue_cls) -> None:
    """release + the learner's queue against reference_release + ReferenceQueue, step by step."""
    for n, (lesson, steps) in enumerate(RELEASE_SCENARIOS):
        mine, ref = _new(queue_cls, f"case {n}"), ReferenceQueue()
        count_mine, count_ref = [0] * 16, [0] * 16
        done: list[str] = []
        for step in steps:
            kind = step[0]
            if kind == "start":
                hits = [b for b in step[1] if b in ref]
                for b in step[1]:
                    if b in ref:
                        ref.remove(b)
                        _call(f"case {n}: {lesson}", mine, "remove", b)
                    count_mine[b] += 1
                    count_ref[b] += 1
                done.append(f"a request takes {step[1]}" + (f" (hits {hits})" if hits else ""))
                continue
            if kind == "evict":
                done.append(f"evict {step[1]}")
                case = f"case {n}: {lesson}\n  steps: " + "; ".join(done)
                got = [_call(case, mine, "popleft", None) for _ in range(step[1])]
                want = [ref.popleft() for _ in range(step[1])]
                if got != want:
                    fail(case, f"the blocks evicted, in order: {got}", f"expected {want}",
                         "release must append the request's blocks TAIL FIRST: its last block is the least likely "
                         "to be shared by the next request, so it should be the first to go")
                continue
            table, cached = step[1], step[2]
            is_cached = (lambda b: True) if cached is None else (lambda b, c=cached: b in c)
            done.append(f"release({table}) ({'all cached' if cached is None else f'cached: {sorted(cached)}'})")
            case = f"case {n}: {lesson}\n  steps: " + "; ".join(done)
            before = list(count_mine)
            try:
                empty = release(list(table), count_mine, mine, is_cached)
            except NotImplementedError:
                raise
            except Exception as e:  # noqa: BLE001
                fail(case, f"release raised {type(e).__name__}", str(e))
            want_empty = reference_release(list(table), count_ref, ref, is_cached)
            if count_mine != count_ref:
                b = next(i for i, (x, y) in enumerate(zip(count_mine, count_ref)) if x != y)
                fail(case, f"ref_count[{b}] is {count_mine[b]} after release", f"expected {count_ref[b]} (it was "
                     f"{before[b]})", "drop exactly one reference per block of the finished request")
            if list(empty or []) != want_empty:
                fail(case, f"release returned {empty!r}", f"expected the blocks that go back empty: {want_empty}",
                     "a block whose count reaches 0 and that holds no key (is_cached False) is returned, in release "
                     "order; a cached one joins the queue instead")
            got_q, want_q = _contents(mine, case), list(ref)
            if got_q != want_q:
                hint = ("tail first: walk the block table from its end, so the last block joins the queue first"
                        if sorted(got_q) == sorted(want_q) else
                        "only a cached block whose ref_count reaches 0 joins the queue; a block another request "
                        "still holds stays out")
                fail(case, "the queue after release differs", f"expected {want_q} (least recently used first)\n"
                     f"got      {got_q}", hint)
    passed(len(RELEASE_SCENARIOS), "release gives back a finished request's blocks tail first, keeps shared ones, "
                                   "and sends uncached ones back empty")


# ---- stage 3: the engine keeps its unused cached blocks in the learner's queue ----------------------

def check_lru_in_engine(llm, queue_cls, system: str, questions: list[str], long_prompt: str,
                        max_tokens: int = 6) -> dict:
    """The hash chain keeps its unused blocks in your queue: `llm.derive(prefix_caching="hash",
    free_block_queue=queue_cls)`, built here from `llm`'s weights and small pool each time the check
    runs (so a fixed class is checked without rebuilding anything). A chat, the same questions asked
    fresh, then a long request that evicts. Tokens, hits and the number of evicted blocks must
    equal the engine's HashChainCache on the same requests (`llm.derive(prefix_caching="hash")`)."""
    from minikv.checks.radix import chat_then_evict

    if llm.block_size is None:
        raise ValueError("build the LLM with kv_backend='paged': the prefix cache keeps whole blocks")
    base = llm
    llm = base.derive(prefix_caching="hash", eviction="lru", free_block_queue=queue_cls)
    mine = chat_then_evict(llm, system, questions, long_prompt, max_tokens, learner=True)
    stats, kept = llm.prefix_cache.stats(), sorted(llm.prefix_cache.cached_blocks())
    ref_engine = base.derive(prefix_caching="hash", eviction="lru", free_block_queue=None)
    ref = chat_then_evict(ref_engine, system, questions, long_prompt, max_tokens, learner=False)
    ref_stats = ref_engine.prefix_cache.stats()
    for (what, toks, hit), (_, want_toks, want_hit) in zip(mine, ref):
        if toks != want_toks:
            fail(what, "its tokens differ from the engine's HashChainCache", f"expected {want_toks}\ngot      {toks}")
        if hit != want_hit:
            fail(what, f"{hit} tokens came from the cache; with the engine's HashChainCache {want_hit}",
                 "the same requests on the same pool must evict the same blocks and hit the same ones",
                 "popleft must return the least recently released block")
    if stats["evicted_blocks"] != ref_stats["evicted_blocks"] or not stats["evicted_blocks"]:
        fail("the whole run", f"{stats['evicted_blocks']} blocks evicted", f"the engine's cache evicted "
             f"{ref_stats['evicted_blocks']}", "build the LLM with a smaller num_blocks" if not
             ref_stats["evicted_blocks"] else None)
    if kept != sorted(ref_engine.prefix_cache.cached_blocks()):
        fail("the whole run", f"the cache ends holding blocks {kept}",
             f"the engine's HashChainCache ends holding {sorted(ref_engine.prefix_cache.cached_blocks())}",
             "eviction took other blocks: popleft must return the least recently released block")
    passed(len(mine), f"with your FreeBlockQueue the engine gives the hash chain's tokens and hits "
                      f"({sum(h for _, _, h in mine)} cached tokens, {stats['evicted_blocks']} blocks evicted)")
    return stats
