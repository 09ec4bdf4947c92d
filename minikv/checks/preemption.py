"""Checker for exercise 05b: preemption, when the pool runs out in the middle of a step.

    pick_victim(candidates) -> RunningSeq           the least important: largest priority value, then newest
    schedule_running(running, budget, free_blocks, block_size, preemption, swap_free_blocks)
        -> (batch, preempted)                       the running sequences' part of one step
        batch      [(request_id, num_tokens)]       in order, as exercise 05a's
        preempted  [(request_id, "recompute" | "swap")]   in the order they were preempted

Three stages, each stopping at the first problem with a message that says where:
  1. pick_victim on hand-picked candidates (priority first, then arrival)
  2. schedule_running on taught states (a victim frees blocks, the victim is the asker, two victims,
     priority, swap, swap space too small, a sequence already in the batch is safe), then random
     ones, against minikv's own Scheduler deciding the same state
  3. (check_preemption_on_engine_run) a real engine run under memory pressure, watched through
     `llm.add_observer`: before every step the state is taken, your function decides it, and its
     decision must be the one the engine's scheduler made
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from minikv.cache.block_manager import BlockManager
from minikv.cache.blocks.allocator import FreeListAllocator
from minikv.checks.report import fail, passed


@dataclass(frozen=True)
class RunningSeq:
    """A running sequence as the scheduler sees it.

    [0, num_computed_tokens)           K/V in its num_blocks blocks
    [num_computed_tokens, num_tokens)  still to run (1 for a decode, a prompt's rest for a prefill)
    priority                           lower = more important (SamplingParams.priority, default 0)
    arrival                            order of arrival: larger = newer
    """

    request_id: str
    num_tokens: int
    num_computed_tokens: int
    num_blocks: int
    priority: int = 0
    arrival: int = 0


def _seq(rid: str, num_tokens: int, computed: int, arrival: int, priority: int = 0, bs: int = 4) -> RunningSeq:
    return RunningSeq(rid, num_tokens, computed, -(-computed // bs), priority, arrival)


# ---- stage 1: the victim ------------------------------------------------------------------------------

VICTIM_CASES = [  # (lesson, candidates, expected id)
    ("equal priorities: the newest arrival goes", [_seq("a", 9, 8, 0), _seq("b", 9, 8, 1), _seq("c", 9, 8, 2)], "c"),
    ("the list is not in arrival order: go by arrival, not by position",
     [_seq("c", 9, 8, 2), _seq("a", 9, 8, 0), _seq("b", 9, 8, 1)], "c"),
    ("a larger priority value is LESS important: it goes first, even if it is the oldest",
     [_seq("a", 9, 8, 0, priority=1), _seq("b", 9, 8, 1), _seq("c", 9, 8, 2)], "a"),
    ("two of the least important priority: the newer of them", [_seq("a", 9, 8, 0, 2), _seq("b", 9, 8, 1, 2),
                                                                 _seq("c", 9, 8, 2, 0)], "b"),
    ("one candidate", [_seq("a", 9, 8, 0)], "a"),
]


def _describe(seqs) -> str:
    return ", ".join(f"{s.request_id}(priority {s.priority}, arrival {s.arrival}, {s.num_computed_tokens}/"
                     f"{s.num_tokens} computed, {s.num_blocks} blocks)" for s in seqs) or "none"


def check_pick_victim(pick_victim) -> None:
    for n, (lesson, cands, want) in enumerate(VICTIM_CASES):
        case = f"case {n}: {lesson}\n  candidates: {_describe(cands)}"
        try:
            got = pick_victim(list(cands))
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001  shown to the learner
            fail(case, "pick_victim raised", f"{type(e).__name__}: {e}")
        rid = getattr(got, "request_id", got)
        if rid != want:
            fail(case, f"it picked {rid!r}", f"expected {want!r}",
                 "the victim is the LEAST important: the largest priority value (lower = more important), and "
                 "among those the newest arrival (the largest `arrival`): max(candidates, key=(priority, arrival))")
    passed(len(VICTIM_CASES), "pick_victim takes the least important: largest priority value, then the newest")


# ---- stage 2: the running part of a step ----------------------------------------------------------------

@dataclass(frozen=True)
class PreemptCase:
    running: tuple[RunningSeq, ...]  # oldest first, as the scheduler holds them
    budget: int
    free_blocks: int
    block_size: int = 4
    preemption: str = "recompute"
    swap_free_blocks: int = 0
    lesson: str = "random"

    def describe(self) -> str:
        swap = f", swap space {self.swap_free_blocks} free blocks" if self.preemption == "swap" else ""
        return (f"{self.lesson}\n  running (oldest first): {_describe(self.running)}\n"
                f"  budget {self.budget} tokens, {self.free_blocks} free blocks of {self.block_size} tokens, "
                f"preemption={self.preemption!r}{swap}")


class _SwapStandIn:
    """What the scheduler asks of a swap space to decide (its room); no tensors move."""

    def __init__(self, num_blocks: int):
        self.allocator = FreeListAllocator(max(num_blocks, 0))

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    def swap_out(self, blocks: list[int]) -> list[int]:
        return [self.allocator.allocate() for _ in blocks]

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self.allocator.free(b)

    def reset(self) -> None:
        self.allocator = FreeListAllocator(self.allocator.num_blocks)


def reference_running(case: PreemptCase) -> tuple[list[tuple[str, int]], list[tuple[str, str]]]:
    """minikv's Scheduler deciding this state: (the batch, the preempted with their mode)."""
    from minikv.engine.sampling_params import SamplingParams
    from minikv.engine.scheduler import Scheduler
    from minikv.engine.sequence import Sequence, SequenceStatus

    held = sum(s.num_blocks for s in case.running)
    bm = BlockManager(held + case.free_blocks + 1, case.block_size)
    bm.grow(Sequence([1], SamplingParams()), case.block_size)  # one block nobody will free: free == case's
    sch = Scheduler(bm, max(len(case.running), 1), case.budget, enable_chunked_prefill=True,
                    preemption=case.preemption,
                    swap_space=_SwapStandIn(case.swap_free_blocks) if case.preemption == "swap" else None)
    seqs = {}
    for info in case.running:
        seq = Sequence([1] * info.num_tokens, SamplingParams(max_tokens=1_000_000, ignore_eos=True,
                                                             priority=info.priority), request_id=info.request_id)
        seq.arrival_time = float(info.arrival)
        seq.num_computed_tokens = info.num_computed_tokens
        bm.grow(seq, info.num_blocks * case.block_size)
        seq.status = SequenceStatus.RUNNING
        sch.running.append(seq)
        seqs[info.request_id] = seq
    batch = sch.schedule()
    preempted = [(s.request_id, "swap" if s.status == SequenceStatus.SWAPPED else "recompute") for s in batch.preempted]
    return [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)], preempted


def _r(rid, n, computed, arrival, priority=0):
    return _seq(rid, n, computed, arrival, priority)


PREEMPT_CASES = [
    PreemptCase((_r("a", 9, 8, 0), _r("b", 7, 6, 1)), 16, 2, lesson="everything fits: nobody is preempted"),
    PreemptCase((_r("a", 9, 8, 0), _r("b", 7, 6, 1), _r("c", 6, 5, 2)), 16, 0,
                lesson="a (the oldest) needs a new block and none is free: the newest, c, is preempted; its "
                       "blocks let a and b run"),
    PreemptCase((_r("a", 8, 7, 0), _r("b", 9, 8, 1)), 16, 0,
                lesson="the sequence that needs a block is itself the newest: it preempts itself and does not "
                       "run this step"),
    PreemptCase((_r("a", 20, 8, 0), _r("b", 7, 6, 1), _r("c", 7, 6, 2)), 12, 0,
                lesson="a's chunk of 12 tokens needs 3 new blocks; each victim frees 2: preempt c, then b, and a "
                       "runs alone"),
    PreemptCase((_r("a", 9, 8, 0, priority=1), _r("b", 9, 8, 1), _r("c", 7, 6, 2)), 16, 0,
                lesson="priority: a is the oldest but the least important (priority 1): it is the victim, "
                       "although c is newer"),
    PreemptCase((_r("a", 9, 8, 0), _r("b", 7, 6, 1), _r("c", 6, 5, 2)), 16, 0, preemption="swap", swap_free_blocks=8,
                lesson="swap, with room in the swap space: the victim is swapped out, not recomputed"),
    PreemptCase((_r("a", 9, 8, 0), _r("b", 7, 6, 1), _r("c", 14, 13, 2)), 16, 0, preemption="swap",
                swap_free_blocks=2,
                lesson="swap, but the victim's 4 blocks do not fit in 2 free swap blocks: it falls back to recompute"),
    PreemptCase((_r("a", 5, 4, 0), _r("b", 9, 8, 1), _r("c", 6, 5, 2)), 16, 1,
                lesson="a takes the last free block; b then needs one: a is already in this step's batch and is "
                       "never a victim, so c goes"),
    PreemptCase((_r("a", 30, 8, 0), _r("b", 9, 8, 1)), 8, 0,
                lesson="the budget limits a's chunk to 8 tokens (2 new blocks): b goes, and a runs 8"),
    PreemptCase((_r("a", 9, 8, 0), _r("b", 40, 12, 1), _r("c", 9, 8, 2)), 4, 0,
                lesson="a decodes (1 token) after c is preempted; the budget left (3) runs a chunk of b that fits "
                       "its blocks"),
]


def random_preempt_cases(num: int, seed: int = 0) -> list[PreemptCase]:
    rng = random.Random(seed)
    cases = []
    while len(cases) < num:
        bs = rng.choice([2, 4])
        running = []
        for i in range(rng.randint(1, 5)):
            n = rng.randint(2, 30)
            computed = n - 1 if rng.random() < 0.6 else rng.randint(0, n - 1)
            running.append(_seq(f"r{i}", n, computed, i if rng.random() < 0.8 else rng.randint(0, 9),
                                rng.choice([0, 0, 0, 1]), bs))
        mode = rng.choice(["recompute", "swap"])
        case = PreemptCase(tuple(running), rng.randint(1, 40), rng.randint(0, 4), bs, mode,
                           rng.randint(0, 8) if mode == "swap" else 0)
        if len({s.arrival for s in running}) == len(running):  # distinct arrival times, as in an engine
            cases.append(case)
    return cases


def check_schedule_running(schedule_running: Callable, num_random: int = 300, seed: int = 0) -> None:
    cases = PREEMPT_CASES + random_preempt_cases(num_random, seed)
    for i, case in enumerate(cases):
        want_batch, want_pre = reference_running(case)
        desc = f"case {i}: {case.describe()}"
        try:
            raw = schedule_running(list(case.running), case.budget, case.free_blocks, case.block_size,
                                   case.preemption, case.swap_free_blocks)
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001  shown to the learner
            fail(desc, "schedule_running raised", f"{type(e).__name__}: {e}")
        if raw is None:
            fail(desc, "it returned None", "expected (batch, preempted)", "did it forget to `return`?")
        try:
            batch, pre = raw
            batch = [(str(r), int(n)) for r, n in batch if int(n) > 0]
            pre = [(str(r), str(m)) for r, m in pre]
        except (TypeError, ValueError):
            fail(desc, "wrong return type", f"got {raw!r}; expected ([(request_id, num_tokens)], "
                 "[(request_id, 'recompute' | 'swap')])")
        hint = None if case.lesson == "random" else f"this case is about: {case.lesson}"
        if pre != want_pre:
            if [r for r, _ in pre] == [r for r, _ in want_pre]:
                hint = ("the right victims, the wrong mode: swap only when preemption == 'swap' AND the swap space "
                        "has room for ALL the victim's blocks; otherwise recompute")
            fail(desc, "the preempted sequences differ", f"expected {want_pre}\ngot      {pre}", hint)
        if batch != want_batch:
            fail(desc, "the batch differs", f"expected {want_batch}\ngot      {batch}", hint)
    passed(len(cases), "schedule_running preempts the same sequences, in the same mode, as minikv's Scheduler")


# ---- stage 3: every step of a real run ------------------------------------------------------------------

class _Replay:
    """An observer: the running state after each step is the state the next step is decided on."""

    def __init__(self, schedule_running, preemption: str):
        self.fn, self.preemption = schedule_running, preemption
        self.state = None
        self.steps = self.preempting_steps = 0
        self.problem: str | None = None

    def snapshot(self, llm) -> None:
        view = llm.view
        order = {s.seq_id: i for i, s in enumerate(sorted(view.sequences(), key=lambda s: s.arrival_time))}
        running = tuple(RunningSeq(s.request_id, s.num_tokens, s.num_computed_tokens, len(s.block_table),
                                   s.params.priority, order[s.seq_id]) for s in view.running)
        self.state = (running, view.max_num_batched_tokens, view.free_blocks, llm.block_size,
                      view.free_swap_blocks)

    def on_schedule(self, llm, batch) -> None:
        if self.problem or self.state is None:
            return
        running, budget, free, bs, swap_free = self.state
        self.steps += 1
        ids = {s.request_id for s in running}
        engine_batch = [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens) if s.request_id in ids]
        engine_pre = [(s.request_id, "swap" if s.status.value == "swapped" else "recompute") for s in batch.preempted]
        self.preempting_steps += bool(engine_pre)
        try:
            mine = self.fn(list(running), budget, free, bs, self.preemption, swap_free)
            mine_batch = [(str(r), int(n)) for r, n in mine[0] if int(n) > 0]
            mine_pre = [(str(r), str(m)) for r, m in mine[1]]
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001
            self.problem = (f"engine step {llm.view.step_index - 1}: schedule_running raised "
                            f"{type(e).__name__}: {e}")
            return
        if (mine_batch, mine_pre) != (engine_batch, engine_pre):
            case = PreemptCase(running, budget, free, bs, self.preemption, swap_free, "a state of the engine run")
            self.problem = (f"engine step {llm.view.step_index - 1}: {case.describe()}\n"
                            f"  the engine ran {engine_batch}, preempted {engine_pre}\n"
                            f"  yours:         {mine_batch}, preempted {mine_pre}")

    def on_step(self, llm, batch, events) -> None:
        self.snapshot(llm)


def check_preemption_on_engine_run(schedule_running, llm=None, preemption: str = "recompute",
                                   max_tokens: int = 24) -> dict:
    """A paged engine on a pool too small for its requests (tiny-random unless `llm` is given), watched
    step by step: your schedule_running must make the engine's own decision, preemptions included."""
    from minikv import LLM, SamplingParams

    if llm is None:
        llm = LLM("tiny-random", kv_backend="paged", num_blocks=14, block_size=4, max_num_seqs=4,
                  max_num_batched_tokens=32, preemption=preemption)
    prompts = [[(11 * i + 5 * j) % 400 + 3 for j in range(n)] for i, n in enumerate((12, 7, 17, 9, 5))]
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, priority=p) for p in (0, 0, 1, 0, 0)]
    replay = _Replay(schedule_running, llm.view.preemption)
    replay.snapshot(llm)
    remove = llm.add_observer(replay)
    try:
        llm.generate(prompts, params)
    finally:
        remove()
    if replay.problem:
        fail(f"a run of {len(prompts)} requests on {llm.view.num_blocks} blocks of {llm.block_size} "
             f"tokens, preemption={llm.view.preemption!r}", "your decision differs from the engine's",
             replay.problem)
    if not replay.preempting_steps:
        fail("the run", "no step preempted anyone", "the pool should be too small", "use fewer blocks")
    passed(replay.steps, f"your schedule_running made the engine's decision at every step of a run under memory "
                         f"pressure ({replay.preempting_steps} steps preempted, preemption="
                         f"{llm.view.preemption!r})")
    return llm.stats()
