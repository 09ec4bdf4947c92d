"""Checkers for the paged-KV exercises: slot mapping (04), a block allocator (05), one scheduler step (06).

Each checker runs the learner's code on hand-picked cases first (each one teaches a rule, and its
failure message names that rule), then on random ones, against the engine's own code; then it
plugs the learner's code into a running LLM and compares the generated tokens with the engine's.

    exercise 04a  slot_mapping(block_table, positions, block_size) -> slots
        block_table  [7, 2, 9]   logical block i of the sequence lives in physical block block_table[i]
        positions    [4, 5, 6]   positions whose K/V this step writes
        slots        [8, 9, 10]  slot = block_table[p // block_size] * block_size + p % block_size

    exercise 04b  class MyAllocator:  MyAllocator(num_blocks); .allocate() -> id; .free(id); .num_free_blocks
                  (the BlockAllocator protocol of minikv/cache/blocks/allocator.py)

    exercise 05a  schedule_step(running, waiting, budget, max_num_seqs, free_blocks, block_size)
                      -> [(request_id, num_tokens), ...] in batch order
        running, waiting  lists of SeqInfo (oldest first / first come first)
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from minikv.cache.block_manager import BlockManager
from minikv.cache.blocks.allocator import FreeListAllocator, NoFreeBlocksError
from minikv.cache.blocks.block_table import slot_mapping as engine_slot_mapping
from minikv.checks.report import fail, passed
from minikv.engine.schedule_step import SeqInfo

# ---- exercise 04a: slot mapping ----------------------------------------------------------------
reference_slot_mapping = engine_slot_mapping  # the engine's own formula (minikv/cache/blocks/block_table.py)


# (block_table, positions, block_size, what the case teaches)
SLOT_CASES = [
    ([5], [0, 1, 2], 4, "one block: slot = block * block_size + offset"),
    ([3, 0], [0, 1, 2, 3, 4, 5], 4, "crossing into the second logical block"),
    ([7, 2, 9], [4, 5, 6, 7, 8, 9], 4, "physical blocks are in any order: look each one up in block_table"),
    ([7, 2, 9], [9], 4, "a decode step writes one position, in the middle of the last block"),
    ([1, 6, 4, 0], [6, 7, 8, 9, 10], 4, "a prefill chunk starts mid-sequence, not at position 0"),
    ([11, 3], [15, 16, 17], 16, "block_size 16: the engine's default"),
]


def _as_int_list(got) -> list[int] | None:
    try:
        if hasattr(got, "tolist"):
            got = got.tolist()
        return [int(x) for x in got]
    except (TypeError, ValueError):
        return None


def _slot_hint(block_table, positions, block_size, got) -> str | None:
    guesses = {
        "you returned the positions themselves: the logical block p // block_size must be looked up in "
        "block_table to find the physical block": list(positions),
        "the offset inside the block is p % block_size, not p // block_size":
            [block_table[p // block_size] * block_size + p // block_size for p in positions],
        "multiply the physical block id by block_size (a block holds block_size slots)":
            [block_table[p // block_size] + p % block_size for p in positions],
        "index block_table with the logical block p // block_size, not with the position p % len(block_table)":
            [block_table[p % len(block_table)] * block_size + p % block_size for p in positions],
    }
    return next((h for h, g in guesses.items() if g == got), None)


def check_slot_mapping(slot_mapping: Callable, num_random: int = 200, seed: int = 0) -> None:
    """Hand-picked cases, then random block tables and position ranges, against the engine's rule."""
    rng = random.Random(seed)
    cases = list(SLOT_CASES)
    for _ in range(num_random):
        bs = rng.choice([4, 8, 16])
        table = rng.sample(range(64), rng.randint(1, 6))
        end = rng.randint(1, len(table) * bs)
        start = rng.randint(0, end - 1)
        cases.append((table, list(range(start, end)), bs, "random"))
    for i, (table, positions, bs, lesson) in enumerate(cases):
        expected = reference_slot_mapping(table, positions, bs)
        raw = slot_mapping(list(table), list(positions), bs)
        got = _as_int_list(raw)
        case = (f"case {i} ({lesson}): block_table={table}, block_size={bs}, "
                f"positions {positions[0]}..{positions[-1]}")
        if got is None:
            fail(case, "wrong return type", f"got {type(raw).__name__}; expected a list of {len(expected)} ints",
                 "did the function forget to `return`?" if raw is None else None)
        if len(got) != len(expected):
            fail(case, "wrong length", f"got {len(got)} slots for {len(positions)} positions; one slot per position")
        j = next((j for j, (e, g) in enumerate(zip(expected, got)) if e != g), None)
        if j is not None:
            p = positions[j]
            fail(case, f"first wrong slot at position {p}",
                 f"logical block {p // bs}, offset {p % bs}: expected block_table[{p // bs}] * {bs} + {p % bs} = "
                 f"{table[p // bs]} * {bs} + {p % bs} = {expected[j]}, got {got[j]}\n"
                 f"expected {expected}\ngot      {got}", _slot_hint(table, positions, bs, got))
    passed(len(cases), "slot_mapping equals block_table[p // block_size] * block_size + p % block_size")


def check_slot_mapping_in_engine(slot_mapping: Callable, llm=None, prompts=None, max_tokens: int = 12) -> None:
    """Run a paged engine whose model runner writes K/V through the learner's slot mapping, plugged into
    the rung-4 seam: `LLM(..., kv_backend="paged", slot_mapping=slot_mapping)`.

    Generates greedily with the engine's own mapping, then with the learner's, on the same weights; the
    tokens must be the same. A wrong mapping writes keys where another token (or request) reads them."""
    from minikv import LLM, SamplingParams

    llm = llm or LLM("tiny-random", kv_backend="paged", block_size=4, num_blocks=48, max_num_batched_tokens=32)
    if llm.block_size is None:
        raise ValueError(f"this LLM uses kv_backend={llm.kv_backend!r}; build it with kv_backend='paged'")
    prompts = prompts or ([[(7 * i + 3 * j) % 200 + 3 for j in range(n)] for i, n in enumerate((9, 21, 5, 14))]
                          if llm.tokenizer is None else ["The KV cache", "Paged attention stores", "A block table"])
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(prompts, params)]

    def learner_mapping(block_table: list[int], positions: list[int], block_size: int) -> list[int]:
        return _as_int_list(slot_mapping(list(block_table), list(positions), block_size)) or []

    mine = llm.derive(slot_mapping=learner_mapping)  # the rung-4 seam: LLM(..., slot_mapping=fn)
    try:
        got = [o.token_ids for o in mine.generate(prompts, params)]
    except NotImplementedError:  # an unfinished stub: say so, not "crashed"
        raise
    except (IndexError, RuntimeError, ValueError) as e:
        fail("the engine with your slot_mapping", "crashed", f"{type(e).__name__}: {e}",
             "a slot outside [0, num_blocks * block_size) means a block id or an offset is wrong")
    for i, (w, g) in enumerate(zip(want, got)):
        if w != g:
            j = next((k for k, (a, b) in enumerate(zip(w, g)) if a != b), min(len(w), len(g)))
            fail(f"request {i} of {len(prompts)}", f"generated tokens differ from token {j} on",
                 f"engine: {w}\nyours:  {g}", "a token whose K/V went to the wrong slot is read back wrong later")
    passed(len(prompts), f"the paged engine ran on your slot_mapping and generated the same {max_tokens} tokens")


# ---- exercise 04b: a block allocator -------------------------------------------------------------
def _call(case: str, what: str, fn, *args):
    try:
        return fn(*args)
    except NotImplementedError:
        raise
    except Exception as e:  # the learner's own error: say where it came from
        fail(case, f"{what} raised {type(e).__name__}", str(e) or "(no message)")


def check_block_allocator(allocator_cls, num_blocks: int = 8, num_random: int = 2000, seed: int = 0) -> None:
    """The protocol, rule by rule, then random allocate/free sequences against a model of the pool."""
    alloc = allocator_cls(num_blocks)
    case = f"{allocator_cls.__name__}({num_blocks}), fresh"
    if getattr(alloc, "num_blocks", None) != num_blocks:
        fail(case, "num_blocks", f"expected the attribute num_blocks == {num_blocks}, got "
             f"{getattr(alloc, 'num_blocks', 'no attribute')}")
    if alloc.num_free_blocks != num_blocks:
        fail(case, "num_free_blocks", f"a fresh pool has every block free: expected {num_blocks}, "
             f"got {alloc.num_free_blocks}")
    held: list[int] = []
    for k in range(num_blocks):
        b = _call(case, f"allocate() number {k + 1}", alloc.allocate)
        if not isinstance(b, int) or not 0 <= b < num_blocks:
            fail(case, f"allocate() number {k + 1}", f"returned {b!r}; expected an int block id in [0, {num_blocks})")
        if b in held:
            fail(case, f"allocate() number {k + 1}", f"returned block {b}, which is already handed out "
                 f"(held: {held})", "an allocated block must leave the free list until it is freed")
        held.append(b)
        if alloc.num_free_blocks != num_blocks - k - 1:
            fail(case, f"num_free_blocks after {k + 1} allocate()", f"expected {num_blocks - k - 1}, "
                 f"got {alloc.num_free_blocks}")
    case = f"{allocator_cls.__name__}({num_blocks}), every block allocated"
    try:
        extra = alloc.allocate()
    except NoFreeBlocksError:
        pass
    except NotImplementedError:
        raise
    except Exception as e:
        fail(case, "allocate() on a full pool", f"raised {type(e).__name__}: {e}",
             "raise minikv.cache.NoFreeBlocksError: the block manager and the notebooks expect that type")
    else:
        fail(case, "allocate() on a full pool", f"returned {extra!r}; expected it to raise NoFreeBlocksError",
             "with no free block left, handing one out means two sequences would share it")
    victim = held[num_blocks // 2]
    _call(case, f"free({victim})", alloc.free, victim)
    if alloc.num_free_blocks != 1:
        fail(case, f"num_free_blocks after free({victim})", f"expected 1, got {alloc.num_free_blocks}",
             "free() must put the block back where allocate() will find it, and count it as free")
    again = _call(case, "allocate() after a free", alloc.allocate)
    if again != victim:
        fail(case, f"allocate() after free({victim})", f"returned {again!r}; block {victim} is the only free one")
    _call(case, f"free({victim})", alloc.free, victim)
    try:
        alloc.free(victim)
    except NotImplementedError:
        raise
    except Exception:
        pass
    else:
        fail(case, f"free({victim}) twice", "the second free did not raise",
             f"after a double free, block {victim} would sit twice in the free list and be handed to two sequences")
    # random sequences of allocate / free, checked against a set of held blocks
    rng = random.Random(seed)
    n = rng.randint(4, 32)
    alloc, held_set, ops = allocator_cls(n), set(), []
    for _ in range(num_random):
        if held_set and (len(held_set) == n or rng.random() < 0.45):
            b = rng.choice(sorted(held_set))
            ops.append(f"free({b})")
            _call(f"random run on {allocator_cls.__name__}({n})", ops[-1], alloc.free, b)
            held_set.discard(b)
        else:
            b = _call(f"random run on {allocator_cls.__name__}({n})", "allocate()", alloc.allocate)
            ops.append(f"allocate() -> {b}")
            if b in held_set or not isinstance(b, int) or not 0 <= b < n:
                fail(f"random run on {allocator_cls.__name__}({n})", f"operation {len(ops)}",
                     f"allocate() returned {b!r} while {sorted(held_set)} are held\nlast operations: {ops[-6:]}",
                     "a freed block must go back exactly once, and an allocated one must leave the free list")
            held_set.add(b)
        if alloc.num_free_blocks != n - len(held_set):
            fail(f"random run on {allocator_cls.__name__}({n})", f"num_free_blocks after operation {len(ops)}",
                 f"expected {n - len(held_set)}, got {alloc.num_free_blocks}\nlast operations: {ops[-6:]}")
    passed(num_random + 2 * num_blocks + 5, f"{allocator_cls.__name__} follows the BlockAllocator protocol")


def check_allocator_in_engine(allocator_cls, llm=None, prompts=None, max_tokens: int = 24, num_blocks: int = 14,
                              block_size: int = 4, preemption: str = "recompute") -> dict:
    """Run the paged engine on `allocator_cls` with a pool too small for every request at once (so
    blocks are freed and reused, and sequences preempted) and compare the tokens with the engine's
    own allocator. Returns the stats of the run on the learner's allocator.

    llm: None builds two tiny-random engines, `LLM(..., block_allocator=allocator_cls)` and one on the
    engine's FreeListAllocator. Or pass an engine already built with `block_allocator=allocator_cls`
    (e.g. SmolLM2 with a small num_blocks): it runs the prompts on the learner's allocator, then on
    `llm.derive(block_allocator=None)` (the same weights, the engine's FreeListAllocator), so the model
    is loaded once."""
    from minikv import LLM, SamplingParams

    if llm is None:
        kwargs = dict(kv_backend="paged", num_blocks=num_blocks, block_size=block_size, max_num_seqs=4,
                      max_num_batched_tokens=32, preemption=preemption)
        ref, llm = LLM("tiny-random", block_allocator=FreeListAllocator, **kwargs), None
    else:
        if llm.block_size is None or not isinstance(llm.view.block_allocator, allocator_cls):
            raise ValueError(f"build the LLM with kv_backend='paged' and block_allocator={allocator_cls.__name__}")
        ref = None
    model = llm or ref
    prompts = prompts or ([[(11 * i + 5 * j) % 400 + 3 for j in range(n)] for i, n in enumerate((12, 7, 17, 9, 5))]
                          if model.tokenizer is None else
                          [model.chat_prompt(q) for q in ("What is a block table?", "Name two colors.", "Say hi.")])
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    view = model.view
    case = (f"{view.num_blocks} blocks of {model.block_size} tokens, {len(prompts)} requests, "
            f"{view.preemption}")

    def run_learner() -> tuple[list[list[int]], dict]:
        try:
            out = [o.token_ids for o in learner.generate(prompts, params)]
        except NotImplementedError:
            raise
        except Exception as e:
            fail(case, f"the engine on {allocator_cls.__name__} raised {type(e).__name__}", str(e),
                 "'still in use' = allocate() handed out a held block; 'freed twice' = free() took a free block; "
                 "'could run nothing' = freed blocks never came back (num_free_blocks stuck)")
        return out, learner.stats()

    if ref is not None:  # two engines
        want = [o.token_ids for o in ref.generate(prompts, params)]
        ref_preemptions = ref.stats()["num_preemptions"]
        del ref
        learner = LLM("tiny-random", block_allocator=allocator_cls, **kwargs)
        got, stats = run_learner()
    else:  # the learner's engine: the reference runs on the same weights with the engine's own allocator
        learner = llm
        before = learner.stats()["num_preemptions"]
        got, stats = run_learner()
        stats["num_preemptions"] -= before
        if view.used_blocks:
            fail(case, "blocks leaked", f"{view.used_blocks} blocks still in use after every request finished")
        reference = llm.derive(block_allocator=None)
        want = [o.token_ids for o in reference.generate(prompts, params)]
        ref_preemptions = reference.stats()["num_preemptions"]
    for i, (w, g) in enumerate(zip(want, got)):
        if w != g:
            j = next((k for k, (a, b) in enumerate(zip(w, g)) if a != b), min(len(w), len(g)))
            fail(case, f"request {i}: tokens differ from token {j} on", f"reference allocator: {w}\nyours: {g}",
                 "the same scheduling with other block ids must give the same tokens: a block handed to two "
                 "sequences at once lets one overwrite the other's K/V")
    learner.view.check()
    if stats["used_blocks"] != 0:
        fail(case, "blocks leaked", f"{stats['used_blocks']} blocks still in use after every request finished")
    passed(len(prompts), f"the engine ran on {allocator_cls.__name__} under memory pressure "
           f"({stats['num_preemptions']} preemptions, reference {ref_preemptions}) and generated the "
           "same tokens as with FreeListAllocator")
    return stats


# ---- exercise 05a: one scheduler decision --------------------------------------------------------
@dataclass(frozen=True)
class ScheduleCase:
    running: tuple[SeqInfo, ...]
    waiting: tuple[SeqInfo, ...]
    budget: int
    max_num_seqs: int
    free_blocks: int
    block_size: int = 4
    lesson: str = "random"

    def describe(self) -> str:
        show = lambda seqs: ", ".join(f"{s.request_id}({s.num_computed_tokens}/{s.num_tokens} computed, "  # noqa: E731
                                      f"{s.num_blocks} blocks)" for s in seqs) or "none"
        return (f"{self.lesson}\n  running: {show(self.running)}\n  waiting: {show(self.waiting)}\n"
                f"  budget {self.budget} tokens, max_num_seqs {self.max_num_seqs}, {self.free_blocks} free blocks "
                f"of {self.block_size} tokens")


def _running(rid: str, num_tokens: int, computed: int, block_size: int = 4) -> SeqInfo:
    return SeqInfo(rid, num_tokens, computed, -(-computed // block_size))


SCHEDULE_CASES = [
    ScheduleCase((_running("a", 10, 9), _running("b", 7, 6)), (), 16, 8, 4,
                 lesson="two decodes: each running sequence runs 1 token"),
    ScheduleCase((_running("a", 30, 8),), (), 12, 8, 10,
                 lesson="a prompt longer than the budget runs a chunk of min(remaining, budget) tokens"),
    ScheduleCase((_running("a", 10, 9), _running("b", 40, 0)), (SeqInfo("c", 5),), 16, 8, 20,
                 lesson="running sequences first, oldest first; the budget they leave admits nobody"),
    ScheduleCase((_running("a", 10, 9),), (SeqInfo("b", 6), SeqInfo("c", 3)), 16, 8, 20,
                 lesson="after the running ones, waiting sequences are admitted in arrival order"),
    ScheduleCase((_running("a", 10, 9),), (SeqInfo("b", 20), SeqInfo("c", 3)), 12, 8, 20,
                 lesson="a waiting prompt longer than what is left of the budget is admitted with a chunk"),
    ScheduleCase((_running("a", 10, 9),), (SeqInfo("b", 24), SeqInfo("c", 3)), 32, 8, 4,
                 lesson="blocks: the first waiting sequence does not fit, so admission STOPS (no skipping ahead)"),
    ScheduleCase((_running("a", 10, 9), _running("b", 9, 8)), (SeqInfo("c", 4), SeqInfo("d", 4)), 32, 3, 20,
                 lesson="max_num_seqs caps how many sequences run: 2 running + 1 admitted = 3"),
    ScheduleCase((_running("a", 13, 12), _running("b", 9, 8)), (SeqInfo("c", 20),), 30, 8, 6,
                 lesson="blocks the running sequences take this step are gone before admission"),
    ScheduleCase((), (SeqInfo("p", 19),), 64, 8, 8,
                 lesson="a preempted (recomputed) sequence waits with prompt + output to prefill again"),
    ScheduleCase((_running("a", 50, 20), _running("b", 10, 9)), (), 8, 8, 20,
                 lesson="the oldest takes the whole budget; a decode after it gets 0 tokens and waits a step"),
]


def reference_schedule(case: ScheduleCase) -> tuple[list[tuple[str, int]], bool]:
    """The real minikv Scheduler's decision on this state: ([(request_id, tokens)], preempted anyone)."""
    from minikv.engine.sampling_params import SamplingParams
    from minikv.engine.scheduler import Scheduler
    from minikv.engine.sequence import Sequence, SequenceStatus

    total = case.free_blocks + sum(s.num_blocks for s in case.running)
    bm = BlockManager(max(total, 1), case.block_size)
    sch = Scheduler(bm, case.max_num_seqs, case.budget, enable_chunked_prefill=True)
    params = SamplingParams(max_tokens=1_000_000, ignore_eos=True)
    for info, queue in [(s, "running") for s in case.running] + [(s, "waiting") for s in case.waiting]:
        seq = Sequence([1] * info.num_tokens, params, request_id=info.request_id)
        seq.num_computed_tokens = info.num_computed_tokens
        if queue == "running":
            bm.grow(seq, info.num_blocks * case.block_size)
            seq.status = SequenceStatus.RUNNING
            sch.running.append(seq)
        else:
            sch.waiting.append(seq)
    if total == 0:  # no block at all: BlockManager needs one, make it unusable
        bm.grow(Sequence([1], params), case.block_size)
    batch = sch.schedule()
    return [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)], bool(batch.preempted)


def random_schedule_cases(num: int, seed: int = 0) -> list[ScheduleCase]:
    """Random states the scheduler decides without preempting anyone."""
    rng = random.Random(seed)
    cases: list[ScheduleCase] = []
    while len(cases) < num:
        bs = rng.choice([2, 4, 8])
        running = []
        for i in range(rng.randint(0, 4)):
            n = rng.randint(1, 40)
            computed = n - 1 if rng.random() < 0.6 else rng.randint(0, n - 1)
            running.append(_running(f"r{i}", n, computed, bs))
        waiting = [SeqInfo(f"w{i}", rng.randint(1, 40)) for i in range(rng.randint(0, 4))]
        case = ScheduleCase(tuple(running), tuple(waiting), rng.randint(1, 48), rng.randint(1, 6),
                            rng.randint(0, 24), bs)
        if not running and not waiting:
            continue
        if len(running) > case.max_num_seqs:
            continue
        if not reference_schedule(case)[1]:
            cases.append(case)
    return cases


def check_schedule_step(schedule_step: Callable, num_random: int = 300, seed: int = 0) -> None:
    """The learner's decision against the engine's Scheduler on taught cases, then random states."""
    cases = SCHEDULE_CASES + random_schedule_cases(num_random, seed)
    for i, case in enumerate(cases):
        expected, _ = reference_schedule(case)
        raw = schedule_step(list(case.running), list(case.waiting), case.budget, case.max_num_seqs,
                            case.free_blocks, case.block_size)
        if raw is None:
            fail(f"case {i}: {case.describe()}", "got None", "expected a list of (request_id, num_tokens)",
                 "did the function forget to `return`?")
        try:
            got = [(str(r), int(n)) for r, n in raw]
        except (TypeError, ValueError):
            fail(f"case {i}: {case.describe()}", "wrong return type",
                 f"got {raw!r}; expected a list of (request_id, num_tokens) pairs")
        got = [(r, n) for r, n in got if n > 0]  # a sequence given 0 tokens is simply not in the batch
        if got != expected:
            j = next((k for k, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
            want_j = f"{expected[j][0]} with {expected[j][1]} tokens" if j < len(expected) else "nothing more"
            got_j = f"{got[j][0]} with {got[j][1]} tokens" if j < len(got) else "nothing more"
            fail(f"case {i}: {case.describe()}", f"batch differs at entry {j}",
                 f"expected {want_j}, got {got_j}\nexpected batch {expected}\nyour batch     {got}",
                 None if case.lesson == "random" else f"this case is about: {case.lesson}")
    passed(len(cases), "schedule_step makes the same decisions as minikv's Scheduler")


def check_schedule_in_engine(schedule_step: Callable, prompts=None, max_tokens: int = 10) -> None:
    """Let the learner's function drive a paged engine (no memory pressure: no preemption needed) and
    compare tokens and per-step batches with the engine's own scheduler."""
    from minikv import LLM, SamplingParams

    kwargs = dict(kv_backend="paged", num_blocks=64, block_size=4, max_num_seqs=3, max_num_batched_tokens=16)
    prompts = prompts or [[(13 * i + 7 * j) % 300 + 3 for j in range(n)] for i, n in enumerate((9, 23, 4, 15, 6))]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    from minikv.viz.pool import record_trace

    ref = record_trace(LLM("tiny-random", **kwargs), prompts, params)
    llm = LLM("tiny-random", schedule_step=schedule_step, **kwargs)  # the rung-5 seam
    try:
        mine = record_trace(llm, prompts, params, max_steps=len(ref) + 50)
    except NotImplementedError:
        raise
    except Exception as e:
        fail("the engine driven by your schedule_step", f"raised {type(e).__name__}", str(e))
    for step, (a, b) in enumerate(zip(ref.steps, mine.steps)):
        wa = [(s.request_id, s.scheduled) for s in a.batch]
        wb = [(s.request_id, s.scheduled) for s in b.batch]
        if sorted(wa) != sorted(wb):
            fail(f"engine step {step}", "the batch differs", f"engine scheduler {wa}\nyours            {wb}")
    if ref.outputs != mine.outputs or len(ref) != len(mine):
        fail("the whole run", "outputs differ", f"engine {ref.outputs}\nyours  {mine.outputs}")
    passed(len(prompts), f"your schedule_step drove the engine for {len(mine)} steps: same batches, same tokens")
