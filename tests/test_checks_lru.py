"""Exercise 06d's checker (the LRU free queue and tail-first release) passes the reference answers,
catches the mistakes learners make and names them, and the engine keeps its unused cached blocks
in the learner's queue with the HashChainCache's own tokens, hits and evictions (tiny-random here;
the notebook runs SmolLM2)."""
from __future__ import annotations

import pytest

from minikv.checks.lru import check_free_queue, check_release


class FreeBlockQueue:
    def __init__(self):
        self.prev, self.next, self.head, self.tail = {}, {}, None, None

    def append(self, block):
        self.prev[block], self.next[block] = self.tail, None
        if self.tail is None:
            self.head = block
        else:
            self.next[self.tail] = block
        self.tail = block

    def remove(self, block):
        p, n = self.prev.pop(block), self.next.pop(block)
        if p is None:
            self.head = n
        else:
            self.next[p] = n
        if n is None:
            self.tail = p
        else:
            self.prev[n] = p

    def popleft(self):
        if self.head is None:
            raise IndexError("empty")
        b = self.head
        self.remove(b)
        return b

    def __len__(self):
        return len(self.next)

    def __contains__(self, block):
        return block in self.next

    def __iter__(self):
        b = self.head
        while b is not None:
            yield b
            b = self.next[b]


def release(block_table, ref_count, queue, is_cached):
    empty = []
    for b in reversed(block_table):
        ref_count[b] -= 1
        if ref_count[b] == 0:
            (queue.append if is_cached(b) else empty.append)(b)
    return empty


class Stack(FreeBlockQueue):  # evicts the most recently released block
    def popleft(self):
        if self.tail is None:
            raise IndexError("empty")
        b = self.tail
        self.remove(b)
        return b


class PrependQueue(FreeBlockQueue):  # appends at the front
    def append(self, block):
        self.prev[block], self.next[block] = None, self.head
        if self.head is None:
            self.tail = block
        else:
            self.prev[self.head] = block
        self.head = block


class ListQueue:  # right answers, O(n) remove
    def __init__(self):
        self.items = []

    def append(self, b):
        self.items.append(b)

    def remove(self, b):
        if b not in self.items:
            raise KeyError(b)
        self.items.remove(b)

    def popleft(self):
        if not self.items:
            raise IndexError("empty")
        return self.items.pop(0)

    def __len__(self):
        return len(self.items)

    def __contains__(self, b):
        return b in self.items

    def __iter__(self):
        return iter(list(self.items))


class ForgivingRemove(FreeBlockQueue):
    def remove(self, block):
        if block in self.next:
            super().remove(block)


class NoneWhenEmpty(FreeBlockQueue):
    def popleft(self):
        return None if self.head is None else super().popleft()


def release_head_first(block_table, ref_count, queue, is_cached):
    return release(list(reversed(block_table)), ref_count, queue, is_cached)


def release_everything(block_table, ref_count, queue, is_cached):
    for b in reversed(block_table):
        ref_count[b] -= 1
        queue.append(b)
    return []


def release_ignores_cached(block_table, ref_count, queue, is_cached):
    for b in reversed(block_table):
        ref_count[b] -= 1
        if ref_count[b] == 0:
            queue.append(b)
    return []


def test_task_06d_reference_answers_pass(capsys):
    check_free_queue(FreeBlockQueue)
    check_release(release, FreeBlockQueue)
    assert capsys.readouterr().out.count("cases passed") == 2


@pytest.mark.parametrize("queue_cls, words", [
    (Stack, "popleft\\(\\) returned"),
    (PrependQueue, "another order|popleft"),
    (ListQueue, "O\\(1\\)|scans the queue"),
    (ForgivingRemove, "KeyError"),
    (NoneWhenEmpty, "IndexError"),
])
def test_task_06d_queue_bugs_are_caught(queue_cls, words):
    with pytest.raises(AssertionError, match=words):
        check_free_queue(queue_cls)


@pytest.mark.parametrize("fn, words", [
    (release_head_first, "tail first"),
    (release_everything, "only a cached block whose ref_count reaches 0|back empty"),
    (release_ignores_cached, "goes back empty|back empty"),
    (lambda bt, rc, q, c: None, "ref_count"),
])
def test_task_06d_release_bugs_are_caught(fn, words):
    with pytest.raises(AssertionError, match=words):
        check_release(fn, FreeBlockQueue)


def _run_tiny(queue_cls):
    """tiny-random on a 12-block pool, the hash chain's unused blocks in queue_cls (or the engine's own):
    prompts sharing a prefix, a long one that evicts, the first one again."""
    from minikv import LLM, SamplingParams

    prompts = [list(range(3, 19)), list(range(3, 11)) + [50] * 9, list(range(100, 130)), list(range(3, 19))]
    out = []
    for seam in ({"free_block_queue": queue_cls}, {}):
        llm = LLM("tiny-random", kv_backend="paged", block_size=4, num_blocks=12, max_model_len=48,
                  prefix_caching="hash", **seam)
        runs = []
        for p in prompts:
            o = llm.generate(p, SamplingParams(max_tokens=6, ignore_eos=True))[0]
            llm.block_manager.check(llm.scheduler.all_sequences())
            runs.append((o.token_ids, o.num_cached_tokens))
        out.append((runs, llm.prefix_cache.stats()["evicted_blocks"], sorted(llm.prefix_cache.cached_blocks())))
    return out


def test_task_06d_engine_on_the_learners_queue_equals_the_hash_chain():
    mine, ref = _run_tiny(FreeBlockQueue)
    assert mine == ref and mine[1] > 0


def test_task_06d_engine_on_a_stack_evicts_other_blocks():
    mine, ref = _run_tiny(Stack)
    assert mine[2] != ref[2]  # the in-engine check compares exactly this


def test_task_06d_building_the_engine_does_not_call_the_learners_queue():
    from minikv import LLM

    class Unwritten:
        def __init__(self):
            raise NotImplementedError("set up the queue")

    llm = LLM("tiny-random", kv_backend="paged", block_size=4, num_blocks=12, max_model_len=48,
              prefix_caching="hash", free_block_queue=Unwritten)
    with pytest.raises(NotImplementedError):
        len(llm.prefix_cache.free_queue)
