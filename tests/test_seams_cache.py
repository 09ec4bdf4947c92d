"""The two seams on the cache and scheduler side: a learner's copy-on-write rule (rung 6, exercise 07a)
and a learner's scheduling decision (rung 5, exercise 05a).

For each: the engine's own rule passed through the seam gives the engine's own tokens, and a wrong
function is stopped with a message that names what is wrong, before it can corrupt the pool."""
import pytest

from minikv import LLM, SamplingParams
from minikv.cache.block_manager import BlockManager, copy_on_write_rule
from minikv.engine.schedule_step import SeqInfo
from minikv.engine.scheduler import Scheduler
from minikv.engine.sequence import Sequence, SequenceStatus

BS = 4


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (tests/conftest.py)


# ---- copy_on_write ------------------------------------------------------------------------------
def learner_copy_on_write(block_table, ref_count, num_computed_tokens, num_tokens, block_size, allocate):
    """Exercise 07a's answer, written as a learner would."""
    copies = []
    for i in range(num_computed_tokens // block_size, min(len(block_table), -(-num_tokens // block_size))):
        if ref_count[block_table[i]] > 1:
            new = allocate()
            ref_count[new], ref_count[block_table[i]] = 1, ref_count[block_table[i]] - 1
            copies.append((block_table[i], new))
            block_table[i] = new
    return copies


def forked_pair(bm: BlockManager) -> tuple[Sequence, Sequence]:
    """A 10-token prompt (blocks [0-3][4-7][8-9 _ _]) and a fork of it, both about to write position 10."""
    parent = Sequence(list(range(10)), SamplingParams())
    bm.grow(parent, 10)
    parent.num_computed_tokens = 10
    parent.output_token_ids.append(50)
    child = Sequence(parent.prompt_token_ids, SamplingParams())
    child.output_token_ids = [51]
    bm.fork(parent, child)
    child.num_computed_tokens = 10
    return parent, child


@pytest.mark.parametrize("rule", [None, copy_on_write_rule, learner_copy_on_write])
def test_copy_on_write_through_the_seam_equals_the_built_in_rule(rule):
    bm = BlockManager(16, BS, copy_on_write=rule)
    parent, child = forked_pair(bm)
    shared = parent.block_table[2]
    copies = bm.copy_on_write(parent, 11)
    assert copies == [(shared, parent.block_table[2])] and parent.block_table[:2] == child.block_table[:2]
    assert bm.copy_on_write(child, 11) == []  # the last owner writes in place
    assert child.block_table[2] == shared and bm.num_cow_copies == 1
    bm.check([parent, child])


def _into_a_block_in_use(table, refs, start, end, bs, allocate):
    return [(table[2], table[0])]


def _out_of_range(table, refs, start, end, bs, allocate):
    return [(table[2], 99)]


def _allocates_but_returns_nothing(table, refs, start, end, bs, allocate):
    allocate()
    return []


def _appends(table, refs, start, end, bs, allocate):
    table.append(table[0])
    return []


@pytest.mark.parametrize("fn, message", [
    (lambda *a: None, "returned None"),
    (lambda *a: [3], "expected a list of \\(src, dst\\) pairs"),
    (_into_a_block_in_use, "did not come from allocate\\(\\)"),
    (_out_of_range, "block ids are in \\[0, 16\\)"),
    (_allocates_but_returns_nothing, "each allocated block holds exactly one copy"),
    (_appends, "changed the length of block_table from 3 to 4"),
])
def test_a_wrong_copy_on_write_is_stopped_with_what_is_wrong(fn, message):
    bm = BlockManager(16, BS, copy_on_write=fn)
    parent, _ = forked_pair(bm)
    with pytest.raises(ValueError, match=message):
        bm.copy_on_write(parent, 11)


def test_copy_on_write_must_be_a_function():
    with pytest.raises(TypeError, match="copy_on_write must be a function"):
        BlockManager(16, BS, copy_on_write="rule")


# ---- schedule_step ------------------------------------------------------------------------------
def fcfs_schedule_step(running: list[SeqInfo], waiting: list[SeqInfo], budget: int, max_num_seqs: int,
                       free_blocks: int, block_size: int) -> list[tuple[str, int]]:
    """Exercise 05a's answer: the built-in policy when nothing needs preempting."""
    def new_blocks(seq: SeqInfo, n: int) -> int:
        return max(0, -(-(seq.num_computed_tokens + n) // block_size) - seq.num_blocks)

    batch = []
    for seq in running:
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if n:
            free_blocks -= new_blocks(seq, n)
            batch.append((seq.request_id, n))
            budget -= n
    seats = max_num_seqs - len(running)
    for seq in waiting:
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if n == 0 or seats == 0 or new_blocks(seq, n) > free_blocks:
            break
        free_blocks -= new_blocks(seq, n)
        batch.append((seq.request_id, n))
        budget, seats = budget - n, seats - 1
    return batch


def scheduler_state(schedule_step=None, budget: int = 16, max_num_seqs: int = 4, num_blocks: int = 16) -> Scheduler:
    """Two running sequences (a decode, a chunked prompt) and three waiting prompts."""
    sch = Scheduler(BlockManager(num_blocks, BS), max_num_seqs, budget, schedule_step=schedule_step)
    for rid, n, computed in (("a", 10, 9), ("b", 30, 8)):
        seq = Sequence(list(range(n)), SamplingParams(), request_id=rid)
        sch.bm.grow(seq, computed)
        seq.num_computed_tokens, seq.status = computed, SequenceStatus.RUNNING
        sch.running.append(seq)
    for rid, n in (("c", 3), ("d", 6), ("e", 2)):
        sch.add(Sequence(list(range(n)), SamplingParams(), request_id=rid))
    return sch


def decisions(sch: Scheduler, steps: int = 4) -> list[list[tuple[str, int, int]]]:
    """The batches of a few steps (request, start, tokens), each step's tokens counted as computed."""
    out = []
    for _ in range(steps):
        batch = sch.schedule()
        out.append([(s.request_id, start, n) for s, start, n in zip(batch.seqs, batch.starts, batch.num_new_tokens)])
        sch.update(batch)
    return out


def test_a_schedule_step_through_the_seam_makes_the_schedulers_decisions():
    want = decisions(scheduler_state())
    assert want[0] == [("a", 9, 1), ("b", 8, 15)]  # the chunk takes the rest of the budget: nobody admitted
    mine = scheduler_state(fcfs_schedule_step)
    events = []
    mine.on_event = lambda step, request_id, event: events.append(event)
    assert decisions(mine) == want
    assert events == ["admit"] * 2  # the scheduler reports what the function admitted
    mine.bm.check(mine.all_sequences())


@pytest.mark.parametrize("decision, message", [
    (None, "returned None"),
    ([("a",)], "expected a list of \\(request_id, num_tokens\\) pairs"),
    ([("zz", 1)], "chose request 'zz', which is neither running \\['a', 'b'\\] nor waiting"),
    ([("a", 1), ("a", 1)], "chose request 'a' twice"),
    ([("a", 2)], "gave request 'a' 2 tokens, but it has 1 left to run"),
    ([("b", 17)], "more than the budget of 16 tokens"),
    ([("c", 3), ("d", 6), ("e", 2)], "admits request 'e' but all max_num_seqs = 4 seats are taken"),
])
def test_a_wrong_schedule_step_is_stopped_before_anything_changes(decision, message):
    sch = scheduler_state(lambda *args: decision)
    before = [(s.request_id, s.num_computed_tokens, list(s.block_table)) for s in sch.all_sequences()]
    with pytest.raises(ValueError, match=message):
        sch.schedule()
    assert [(s.request_id, s.num_computed_tokens, list(s.block_table)) for s in sch.all_sequences()] == before


def test_a_schedule_step_that_needs_blocks_nobody_has_is_stopped():
    sch = scheduler_state(lambda *args: [("a", 1), ("b", 15)], num_blocks=6)  # b needs 4 more, 1 is free
    with pytest.raises(ValueError, match="blocks that needs are not free \\(1 free"):
        sch.schedule()


# ---- through the engine: LLM(..., copy_on_write=fn, schedule_step=fn) ---------------------------
def paged(**kwargs) -> LLM:
    return LLM("tiny-random", kv_backend="paged", block_size=BS, num_blocks=64, **kwargs)


PROMPTS = [[(13 * i + 7 * j) % 300 + 3 for j in range(n)] for i, n in enumerate((9, 23, 4, 15, 6))]


def test_the_engine_on_a_learners_copy_on_write_gives_its_own_tokens():
    samples = SamplingParams(max_tokens=10, n=3, temperature=1.0, seed=0, ignore_eos=True)

    def run(llm):
        out = [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS[:2], samples)]
        beams = [c.token_ids for c in llm.beam_search(PROMPTS[1], 3, 8)[0].outputs]
        return out, beams, llm.stats()["cow_copies"]

    want = run(paged())
    assert want[2] > 0  # the samples really shared a partial block
    assert run(paged(copy_on_write=learner_copy_on_write)) == want


def test_the_engine_on_a_wrong_copy_on_write_stops_with_the_reason():
    llm = paged(copy_on_write=_into_a_block_in_use)
    with pytest.raises(ValueError, match="_into_a_block_in_use .* did not come from allocate"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, n=2, temperature=1.0, seed=0, ignore_eos=True))


def test_the_engine_on_a_learners_schedule_step_gives_its_own_tokens():
    kwargs = dict(max_num_seqs=3, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    want = [o.token_ids for o in paged(**kwargs).generate(PROMPTS, params)]
    llm = paged(schedule_step=fcfs_schedule_step, **kwargs)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want
    assert llm.scheduler.num_preemptions == 0


def test_the_engine_on_a_wrong_schedule_step_stops_with_the_reason():
    def greedy_for_tokens(running, waiting, budget, max_num_seqs, free_blocks, block_size):
        return [(s.request_id, s.num_tokens - s.num_computed_tokens) for s in running + waiting]

    llm = paged(schedule_step=greedy_for_tokens, max_num_seqs=3, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="greedy_for_tokens at engine step \\d+ runs more than the budget of 16"):
        llm.generate(PROMPTS, SamplingParams(max_tokens=4, ignore_eos=True))
