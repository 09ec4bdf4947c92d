"""Copy-on-write fork and parallel sampling: n samples share the prompt's blocks and stay exact."""
import random
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, multiple, rule

from minikv import LLM, SamplingParams
from minikv.cache.block_manager import BlockManager
from minikv.engine.sequence import Sequence

from engine_checks import checked

PROMPT = [7, 3, 91, 45, 12, 300, 8, 77, 150, 23]  # 10 tokens


def paged(**kw) -> LLM:
    return checked(LLM("tiny-random", kv_backend="paged", **{"block_size": 4, "num_blocks": 64, **kw}))


def completions(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_n_greedy_samples_all_equal_the_single_greedy_output():
    llm = paged()
    single = llm.generate(PROMPT, SamplingParams(max_tokens=12))[0].token_ids
    out = llm.generate(PROMPT, SamplingParams(max_tokens=12, n=4))[0]
    assert [c.token_ids for c in out.outputs] == [single] * 4
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert llm.stats()["used_blocks"] == 0


def test_seeded_samples_equal_the_same_seeds_run_one_by_one_without_sharing():
    params = dict(max_tokens=10, temperature=1.0, top_k=50)
    shared = paged().generate([PROMPT, PROMPT[:5]], SamplingParams(n=4, seed=11, **params))
    one_by_one = LLM("tiny-random", kv_backend="contiguous", max_num_seqs=1)
    for prompt, out in zip([PROMPT, PROMPT[:5]], shared):
        alone = [one_by_one.generate(prompt, SamplingParams(seed=11 + i, **params))[0] for i in range(4)]
        assert [c.token_ids for c in out.outputs] == [a.token_ids for a in alone]
    assert len({tuple(c.token_ids) for c in shared[0].outputs}) > 1, "samples with different seeds should differ"


def test_contiguous_backend_runs_n_independent_samples_with_the_same_results():
    sp = SamplingParams(max_tokens=10, temperature=0.8, n=3, seed=5)
    assert completions(LLM("tiny-random", kv_backend="contiguous").generate(PROMPT, sp)) == \
        completions(paged().generate(PROMPT, sp))


def test_request_output_keeps_the_first_sample_at_the_top_level():
    out = paged().generate(PROMPT, SamplingParams(max_tokens=6, temperature=1.0, n=3, seed=0))[0]
    assert len(out.outputs) == 3
    first = out.outputs[0]
    assert (out.token_ids, out.text, out.finish_reason) == (first.token_ids, first.text, first.finish_reason)
    one = paged().generate(PROMPT, SamplingParams(max_tokens=6))[0]
    assert len(one.outputs) == 1 and one.outputs[0].token_ids == one.token_ids


def test_cow_hand_computed_prompt_10_block_4_three_samples():
    """[0-3][4-7][8-9 partial] shared by 3 samples: the first write into the partial block copies it for
    every sample but the last owner (2 copies); blocks 0 and 1 stay shared; the copies hold its K/V."""
    llm = paged()
    bm = llm.block_manager
    root = llm.add_request(PROMPT, SamplingParams(max_tokens=8, n=3))
    llm.step()  # prefill once, fork, each sample draws its first token
    samples = [root] + root.forks
    assert len(samples) == 3 and len({tuple(s.block_table) for s in samples}) == 1
    b0, b1, b2 = root.block_table
    assert [bm.ref_count[b] for b in (b0, b1, b2)] == [3, 3, 3]
    assert bm.num_used_blocks == 3 and bm.num_cow_copies == 0
    kv_b2 = llm.backend.pool.k_cache[:, b2, :2].clone(), llm.backend.pool.v_cache[:, b2, :2].clone()

    llm.step()  # every sample writes position 10, inside the shared partial block
    assert bm.num_cow_copies == 2
    assert [s.block_table[:2] for s in samples] == [[b0, b1]] * 3
    assert [bm.ref_count[b] for b in (b0, b1, b2)] == [3, 3, 1]
    assert samples[2].block_table[2] == b2, "the last owner writes in place"
    copies = [samples[0].block_table[2], samples[1].block_table[2]]
    assert len(set(copies + [b2])) == 3
    for c in copies:  # all layers, K and V, the two slots written by the prefill
        assert torch.equal(llm.backend.pool.k_cache[:, c, :2], kv_b2[0])
        assert torch.equal(llm.backend.pool.v_cache[:, c, :2], kv_b2[1])

    llm.step()  # position 11: every partial block is private now
    llm.step()  # position 12 opens a new block: nothing to copy
    assert bm.num_cow_copies == 2
    while llm.has_unfinished():
        llm.step()
    assert bm.num_free_blocks == bm.num_blocks


def test_prompt_ending_on_a_block_boundary_needs_no_copy():
    llm = paged()
    llm.generate(PROMPT[:8], SamplingParams(max_tokens=6, n=4))
    assert llm.stats()["cow_copies"] == 0 and llm.stats()["forks"] == 3


def test_sharing_saves_blocks_and_stats_report_it():
    prompt = list(range(10, 50))  # 40 tokens = 10 full blocks of 4
    llm = paged(num_blocks=128)
    llm.generate(prompt, SamplingParams(max_tokens=8, n=4, temperature=1.0, seed=1, ignore_eos=True))
    s = llm.stats()
    # 48 tokens per sample = 12 blocks; shared: the 10 prompt blocks once + 2 per sample
    assert s["peak_blocks_unshared"] == 4 * 12
    assert s["peak_used_blocks"] == 10 + 4 * 2
    alone = paged(num_blocks=128)
    alone.generate([prompt] * 4, [SamplingParams(max_tokens=8, temperature=1.0, seed=1 + i, ignore_eos=True)
                                  for i in range(4)])
    assert alone.stats()["peak_used_blocks"] == 4 * 12


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_forked_samples_stay_exact_under_memory_pressure(preemption):
    prompts = [PROMPT, list(range(20, 37)), [5, 6, 7]]
    sp = SamplingParams(max_tokens=20, n=3, temperature=1.0, seed=3)
    want = completions(paged(num_blocks=256).generate(prompts, sp))
    llm = paged(num_blocks=14, preemption=preemption, max_num_batched_tokens=32)
    assert completions(llm.generate(prompts, sp)) == want
    s = llm.stats()
    assert s["num_preemptions"] > 0 and s["cow_copies"] > 0
    assert s["used_blocks"] == 0


def test_stream_tags_each_event_with_its_sample():
    llm = paged()
    events = list(llm.stream([PROMPT, PROMPT[:3]], SamplingParams(max_tokens=5, n=2, ignore_eos=True)))
    seen = {(e.index, e.sample_index) for e in events}
    assert seen == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert len(events) == 2 * 2 * 5


def test_stopping_a_stream_early_frees_every_sample():
    llm = paged()
    for _ in zip(range(3), llm.stream(PROMPT, SamplingParams(max_tokens=30, n=4))):
        pass
    assert not llm.has_unfinished() and llm.stats()["used_blocks"] == 0


def test_more_samples_than_seats_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="raise max_num_seqs"):
        paged(max_num_seqs=2).generate(PROMPT, SamplingParams(n=3))


# ---- Hypothesis: random traces over the block manager, with forks and copy-on-write ---------------------

class ForkTrace(RuleBasedStateMachine):
    """Sequences grow, fork, write and go away at random. A model of the pool's contents checks that
    every sequence reads back its own tokens through its block table (copy-on-write kept them apart)."""

    seqs = Bundle("seqs")

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=24, block_size=4)
        self.pool = [[None] * 4 for _ in range(24)]  # what each slot holds
        self.tokens: dict[int, list[int]] = {}  # seq_id -> the values it wrote, in position order
        self.live: dict[int, Sequence] = {}
        self.counter = 0

    def _write(self, seq: Sequence, k: int) -> bool:
        end = seq.num_computed_tokens + k
        if not self.bm.can_grow(seq, end):
            return False
        self.bm.grow(seq, end)
        for src, dst in self.bm.copy_on_write(seq, end):
            self.pool[dst] = list(self.pool[src])
        for p in range(seq.num_computed_tokens, end):
            self.counter += 1
            self.pool[seq.block_table[p // 4]][p % 4] = self.counter
            self.tokens[seq.seq_id].append(self.counter)
        seq.num_computed_tokens = end
        return True

    @rule(target=seqs, n=st.integers(1, 12))
    def new(self, n):
        seq = Sequence([0] * n, SamplingParams())
        self.tokens[seq.seq_id] = []
        if not self._write(seq, n):
            del self.tokens[seq.seq_id]
            return multiple()
        self.live[seq.seq_id] = seq
        return seq

    @rule(seq=seqs, k=st.integers(1, 6))
    def append(self, seq, k):
        if seq.seq_id in self.live:
            self._write(seq, k)

    @rule(target=seqs, seq=seqs)
    def fork(self, seq):
        if seq.seq_id not in self.live:
            return multiple()
        child = Sequence([0], SamplingParams())
        self.bm.fork(seq, child)
        child.num_computed_tokens = seq.num_computed_tokens
        self.tokens[child.seq_id] = list(self.tokens[seq.seq_id])
        self.live[child.seq_id] = child
        return child

    @rule(seq=consumes(seqs))
    def free(self, seq):
        if self.live.pop(seq.seq_id, None) is not None:
            self.bm.free(seq)

    @invariant()
    def refcounts_equal_table_membership_and_contents_are_private(self):
        self.bm.check(list(self.live.values()))
        for seq in self.live.values():
            got = [self.pool[seq.block_table[p // 4]][p % 4] for p in range(seq.num_computed_tokens)]
            assert got == self.tokens[seq.seq_id], f"sequence {seq.seq_id} reads another's writes"

    def teardown(self):
        for seq in self.live.values():
            self.bm.free(seq)
        assert self.bm.num_free_blocks == self.bm.num_blocks and sum(self.bm.ref_count) == 0


TestForkTrace = ForkTrace.TestCase
TestForkTrace.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(9, 24), preemption=st.sampled_from(["recompute", "swap"]),
       block_size=st.sampled_from([4, 8]))
def test_engine_traces_with_forks_match_the_roomy_run(seed, num_blocks, preemption, block_size):
    rng = random.Random(seed)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(1, 20))] for _ in range(rng.randint(1, 3))]
    params = [SamplingParams(max_tokens=rng.randint(1, 10), n=rng.randint(1, 3), temperature=rng.choice([0.0, 1.0]),
                             seed=rng.randrange(100)) for _ in prompts]
    want = completions(paged(block_size=block_size, num_blocks=256).generate(prompts, params))
    num_blocks = max(num_blocks, -(-30 // block_size))  # one whole request always fits
    llm = paged(block_size=block_size, num_blocks=num_blocks, preemption=preemption, max_model_len=30)
    assert completions(llm.generate(prompts, params)) == want
    assert llm.stats()["used_blocks"] == 0


@pytest.mark.parametrize("prefix_caching", ["hash", "radix"])
def test_forks_and_beams_stay_exact_with_prefix_caching_under_pressure(prefix_caching):
    """Cached prefix blocks and forked blocks are shared through the same ref_counts: a second run hits
    the cache, forks on top of cached blocks, and still gives the tokens of a roomy run without caching."""
    from beam_reference import reference_beam_search

    prompts = [PROMPT, PROMPT + [99, 98], list(range(20, 37))]
    sp = SamplingParams(max_tokens=12, n=3, temperature=1.0, seed=2)
    roomy = paged(num_blocks=256)
    want = completions(roomy.generate(prompts, sp))
    want_beams = [[h.token_ids for h in reference_beam_search(roomy.model, p, 3, 8, roomy.eos_token_ids)]
                  for p in prompts]
    llm = paged(num_blocks=14, prefix_caching=prefix_caching, max_num_batched_tokens=32)
    for _ in range(2):  # the second round starts on cached prefixes
        assert completions(llm.generate(prompts, sp)) == want
        assert [[c.token_ids for c in o.outputs] for o in llm.beam_search(prompts, 3, 8)] == want_beams
    assert llm.stats()["num_preemptions"] > 0


# ---- the exercise checker (minikv/checks/cow.py) ------------------------------------------------------

def _cow_never_copies(table, refs, start, end, bs, allocate):
    return []


def _cow_copies_every_shared_block(table, refs, start, end, bs, allocate):
    copies = []
    for i, src in enumerate(table):
        if refs[src] > 1:
            dst = allocate()
            refs[dst], refs[src], table[i] = 1, refs[src] - 1, dst
            copies.append((src, dst))
    return copies


def _cow_forgets_the_source_refcount(table, refs, start, end, bs, allocate):
    copies = []
    for i in range(start // bs, (end - 1) // bs + 1):
        if refs[table[i]] > 1:
            dst = allocate()
            refs[dst] = 1
            copies.append((table[i], dst))
            table[i] = dst
    return copies


def test_cow_checker_passes_the_engine_rule_and_runs_it_in_the_engine():
    from minikv.checks.cow import check_copy_on_write, check_copy_on_write_in_engine, reference_copy_on_write

    check_copy_on_write(reference_copy_on_write)
    check_copy_on_write_in_engine(paged(), reference_copy_on_write, PROMPT, n=3, max_tokens=6, beam_width=2)


@pytest.mark.parametrize("wrong,says", [
    (_cow_never_copies, "ref_count > 1 means another sequence reads this block"),
    (_cow_copies_every_shared_block, "only the blocks that positions [start, end) fall in are written"),
    (_cow_forgets_the_source_refcount, "decrement its ref_count"),
])
def test_cow_checker_names_the_mistake(wrong, says):
    from minikv.checks.cow import check_copy_on_write

    with pytest.raises(AssertionError, match=re.escape(says)):
        check_copy_on_write(wrong)


def test_cow_checker_in_engine_catches_shared_writes_and_leaves_a_clean_pool():
    from minikv.checks.cow import check_copy_on_write_in_engine

    llm = paged()
    with pytest.raises(AssertionError, match="tokens differ"):
        check_copy_on_write_in_engine(llm, _cow_never_copies, PROMPT, n=3, max_tokens=6, beam_width=2)
    with pytest.raises(AssertionError, match="bookkeeping broke"):
        check_copy_on_write_in_engine(llm, _cow_forgets_the_source_refcount, PROMPT, n=3, max_tokens=6, beam_width=2)
    assert llm.stats()["used_blocks"] == 0 and not llm.has_unfinished()
