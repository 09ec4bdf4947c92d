"""The paged-KV checkers pass the reference answers and catch the mistakes learners make.

Each planted bug is one a learner is likely to write; the checker must fail on it with an
AssertionError whose message points at the rule that was broken.
"""
from __future__ import annotations

import pytest

from minikv.cache.blocks.allocator import NoFreeBlocksError
from minikv.checks.paged import (
    SCHEDULE_CASES,
    check_allocator_in_engine,
    check_block_allocator,
    check_schedule_in_engine,
    check_schedule_step,
    check_slot_mapping,
    check_slot_mapping_in_engine,
    random_schedule_cases,
    reference_schedule,
)


# ---- exercise 04a: slot mapping ------------------------------------------------------------------
def slot_mapping(block_table, positions, block_size):
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


SLOT_BUGS = {
    "positions returned as slots": (lambda t, ps, bs: list(ps), "looked up in block_table"),
    "offset with // instead of %": (lambda t, ps, bs: [t[p // bs] * bs + p // bs for p in ps], "p % block_size"),
    "block id not multiplied": (lambda t, ps, bs: [t[p // bs] + p % bs for p in ps], "multiply"),
    "table indexed by p % len": (lambda t, ps, bs: [t[p % len(t)] * bs + p % bs for p in ps], "logical block"),
    "off by one": (lambda t, ps, bs: [t[p // bs] * bs + p % bs + 1 for p in ps], "first wrong slot"),
    "forgot to return": (lambda t, ps, bs: None, "return"),
}


def test_task_04_reference_slot_mapping_passes():
    check_slot_mapping(slot_mapping)


def test_task_04_slot_mapping_may_return_a_tensor():
    import torch

    check_slot_mapping(lambda t, ps, bs: torch.tensor(slot_mapping(t, ps, bs)), num_random=20)


@pytest.mark.parametrize("bug", sorted(SLOT_BUGS))
def test_task_04_slot_mapping_bugs_are_caught_and_named(bug):
    fn, words = SLOT_BUGS[bug]
    with pytest.raises(AssertionError, match=words):
        check_slot_mapping(fn)


def test_task_04_engine_runs_on_the_reference_slot_mapping(capsys):
    check_slot_mapping_in_engine(slot_mapping)
    assert "same 12 tokens" in capsys.readouterr().out


def test_task_04_engine_catches_a_slot_mapping_that_writes_the_wrong_slot():
    def swapped_offsets(t, ps, bs):  # positions 0 and 1 of every block trade places
        return [t[p // bs] * bs + (p % bs ^ 1) for p in ps]

    with pytest.raises(AssertionError, match="differ"):
        check_slot_mapping_in_engine(swapped_offsets)


def test_task_04_engine_check_leaves_the_runner_as_it_was():
    from minikv import LLM

    llm = LLM("tiny-random", kv_backend="paged", block_size=4, num_blocks=48)
    check_slot_mapping_in_engine(slot_mapping, llm=llm)
    assert "slot_mapping" not in vars(llm.runner)


# ---- exercise 04b: a block allocator -------------------------------------------------------------
class StackAllocator:
    """Reference answer with another policy than the engine's FIFO: last freed, first reused."""

    def __init__(self, num_blocks):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._is_free = [True] * num_blocks

    def allocate(self):
        if not self._free:
            raise NoFreeBlocksError(f"all {self.num_blocks} blocks are in use")
        b = self._free.pop()
        self._is_free[b] = False
        return b

    def free(self, block_id):
        if self._is_free[block_id]:
            raise RuntimeError(f"block {block_id} freed twice")
        self._is_free[block_id] = True
        self._free.append(block_id)

    @property
    def num_free_blocks(self):
        return len(self._free)


class NoDoubleFreeCheck(StackAllocator):
    def free(self, block_id):
        self._is_free[block_id] = True
        self._free.append(block_id)


class PeeksInsteadOfPops(StackAllocator):
    def allocate(self):
        if not self._free:
            raise NoFreeBlocksError("full")
        return self._free[-1]  # hands the same block out again and again


class RingAllocator(StackAllocator):
    """Hands out ids 0, 1, 2, ... and wraps around, whether or not the block came back."""

    def __init__(self, num_blocks):
        super().__init__(num_blocks)
        self.next_id, self.count = 0, num_blocks

    def allocate(self):
        if self.count == 0:
            raise NoFreeBlocksError("full")
        self.count -= 1
        self.next_id += 1
        return (self.next_id - 1) % self.num_blocks

    def free(self, block_id):
        self.count += 1

    @property
    def num_free_blocks(self):
        return self.count


class ForgetsToCountFrees(StackAllocator):
    def __init__(self, num_blocks):
        super().__init__(num_blocks)
        self.count = num_blocks

    def allocate(self):
        self.count -= 1
        return super().allocate()

    def free(self, block_id):
        super().free(block_id)  # self.count is never raised again

    @property
    def num_free_blocks(self):
        return self.count


class NeverReuses(StackAllocator):
    def free(self, block_id):
        if self._is_free[block_id]:
            raise RuntimeError("double free")
        self._is_free[block_id] = True  # marked free, but never put back on the list


class WrongErrorWhenFull(StackAllocator):
    def allocate(self):
        if not self._free:
            raise IndexError("pop from empty list")
        return super().allocate()


class ReturnsNoneWhenFull(StackAllocator):
    def allocate(self):
        return super().allocate() if self._free else None


class OffByOneIds(StackAllocator):
    def allocate(self):
        return super().allocate() + 1


ALLOCATOR_BUGS = {
    NoDoubleFreeCheck: "twice",
    PeeksInsteadOfPops: "num_free_blocks after 1 allocate",
    RingAllocator: "the only free one",
    ForgetsToCountFrees: "num_free_blocks",
    NeverReuses: "after free",
    WrongErrorWhenFull: "NoFreeBlocksError",
    ReturnsNoneWhenFull: "NoFreeBlocksError",
    OffByOneIds: r"\[0, 8\)",
}


def test_task_05_reference_allocator_passes():
    check_block_allocator(StackAllocator)


def test_task_05_the_engines_own_allocator_passes():
    from minikv.cache.blocks.allocator import FreeListAllocator

    check_block_allocator(FreeListAllocator)


@pytest.mark.parametrize("bug", sorted(ALLOCATOR_BUGS, key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_task_05_allocator_bugs_are_caught_and_named(bug):
    with pytest.raises(AssertionError, match=ALLOCATOR_BUGS[bug]):
        check_block_allocator(bug)


def test_task_05_engine_runs_on_another_allocator_under_pressure():
    stats = check_allocator_in_engine(StackAllocator)
    assert stats["num_preemptions"] > 0, "the check must put the pool under pressure"


def test_task_05_engine_catches_an_allocator_that_hands_out_a_used_block():
    class FreesTwiceIntoTheList(StackAllocator):
        def free(self, block_id):
            super().free(block_id)
            self._free.insert(0, block_id)  # the block now sits twice in the free list

        @property
        def num_free_blocks(self):
            return len(set(self._free))

    with pytest.raises(AssertionError, match="still in use"):
        check_allocator_in_engine(FreesTwiceIntoTheList)


def test_task_05_engine_catches_an_allocator_that_loses_blocks():
    with pytest.raises(AssertionError):
        check_allocator_in_engine(NeverReuses)


def test_task_05_stub_raises_not_implemented_not_assertion():
    class Stub:
        def __init__(self, num_blocks):
            raise NotImplementedError("write __init__")

    with pytest.raises(NotImplementedError):
        check_block_allocator(Stub)


# ---- exercise 05a: one scheduler step ------------------------------------------------------------
def schedule_step(running, waiting, budget, max_num_seqs, free_blocks, block_size):
    def blocks_for(num_tokens):
        return -(-num_tokens // block_size)

    batch = []
    for s in running:  # oldest first
        n = min(s.num_tokens - s.num_computed_tokens, budget)
        if n == 0:
            continue
        free_blocks -= max(0, blocks_for(s.num_computed_tokens + n) - s.num_blocks)
        batch.append((s.request_id, n))
        budget -= n
    seats = max_num_seqs - len(running)
    for s in waiting:  # first come, first served: stop at the first that does not fit
        n = min(s.num_tokens - s.num_computed_tokens, budget)
        need = blocks_for(s.num_computed_tokens + n) - s.num_blocks
        if n == 0 or need > free_blocks or seats == 0:
            break
        batch.append((s.request_id, n))
        budget, free_blocks, seats = budget - n, free_blocks - need, seats - 1
    return batch


def waiting_first(running, waiting, *args):
    return schedule_step(waiting, [], *args)[: len(waiting)] + schedule_step(running, [], *args)


def no_chunking(running, waiting, budget, max_num_seqs, free_blocks, block_size):
    out = []
    for s in running + waiting:
        n = s.num_tokens - s.num_computed_tokens
        if n <= budget:
            out.append((s.request_id, n))
            budget -= n
    return out


def skips_ahead(running, waiting, budget, max_num_seqs, free_blocks, block_size):
    batch = schedule_step(running, [], budget, max_num_seqs, free_blocks, block_size)
    budget -= sum(n for _, n in batch)
    free_blocks -= sum(max(0, -(-(s.num_computed_tokens + n) // block_size) - s.num_blocks)
                       for s, (_, n) in zip(running, batch))
    for s in waiting:  # `continue` where the scheduler says `break`
        n = min(s.num_tokens, budget)
        need = -(-n // block_size)
        if n and need <= free_blocks and len(batch) < max_num_seqs:
            batch.append((s.request_id, n))
            budget, free_blocks = budget - n, free_blocks - need
    return batch


def ignores_max_num_seqs(running, waiting, budget, max_num_seqs, free_blocks, block_size):
    return schedule_step(running, waiting, budget, 10**6, free_blocks, block_size)


def ignores_running_blocks(running, waiting, budget, max_num_seqs, free_blocks, block_size):
    batch = schedule_step(running, [], budget, max_num_seqs, free_blocks, block_size)
    used = sum(n for _, n in batch)
    rest = schedule_step([], waiting, budget - used, max_num_seqs - len(running), free_blocks, block_size)
    return batch + rest


SCHEDULE_BUGS = {
    "waiting before running": (waiting_first, "running sequences first|batch differs"),
    "no chunked prefill": (no_chunking, "chunk"),
    "skips ahead of a waiting sequence that does not fit": (skips_ahead, "STOPS"),
    "ignores max_num_seqs": (ignores_max_num_seqs, "max_num_seqs caps"),
    "forgets the blocks running sequences take": (ignores_running_blocks, "gone before admission"),
}


def test_task_06_reference_schedule_step_passes():
    check_schedule_step(schedule_step)


@pytest.mark.parametrize("bug", sorted(SCHEDULE_BUGS))
def test_task_06_schedule_bugs_are_caught_with_the_rule_they_break(bug):
    fn, words = SCHEDULE_BUGS[bug]
    with pytest.raises(AssertionError, match=words):
        check_schedule_step(fn)


def test_task_06_taught_cases_never_need_a_preemption():
    for case in SCHEDULE_CASES + random_schedule_cases(100, seed=3):
        batch, preempted = reference_schedule(case)
        assert not preempted, case.describe()


def test_task_06_schedule_step_can_drive_the_engine(capsys):
    check_schedule_in_engine(schedule_step)
    assert "same batches, same tokens" in capsys.readouterr().out


def test_task_06_engine_check_catches_a_wrong_policy_with_the_rule_it_breaks():
    # the scheduler checks the seam's decision as it comes: the message names the seat limit
    with pytest.raises(AssertionError, match="admits request '3' but all max_num_seqs = 3 seats are taken"):
        check_schedule_in_engine(ignores_max_num_seqs)


def test_task_06_engine_check_explains_a_policy_that_stalls_the_engine():
    with pytest.raises(AssertionError, match="could run nothing"):
        check_schedule_in_engine(no_chunking)  # a prompt longer than the budget never runs


def test_task_05_engine_check_on_a_given_llm_loads_the_model_once():
    from minikv import LLM

    llm = LLM("tiny-random", kv_backend="paged", num_blocks=10, block_size=4, max_num_seqs=4,
              max_num_batched_tokens=32, block_allocator=StackAllocator)
    stats = check_allocator_in_engine(StackAllocator, llm=llm)
    assert stats["num_preemptions"] > 0
    assert isinstance(llm.block_manager.allocator, StackAllocator)  # put back after the reference run


def test_task_05_engine_check_refuses_an_llm_built_on_another_allocator():
    from minikv import LLM

    with pytest.raises(ValueError, match="block_allocator=StackAllocator"):
        check_allocator_in_engine(StackAllocator, llm=LLM("tiny-random", kv_backend="paged", num_blocks=10))
