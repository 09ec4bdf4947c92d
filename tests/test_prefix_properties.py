"""Property tests of the prefix caches: random traces of admissions, steps, forks, preemptions,
evictions, pins and resets, checked against a model-free oracle of what every block holds.

The oracle: `content[block] = (cache_salt, tokens whose K/V the block's slots hold)`. Writing a
token into a block updates it; a prefix hit must hand out blocks whose content is exactly the
admitted request's own salt and tokens. That is "never serve wrong K/V" and "never serve another
tenant's block", stated without a model. Then a second test runs the real engine on random
workloads and compares its tokens with caching off.
"""
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minikv import LLM, SamplingParams
from minikv.cache.block_manager import BlockManager, blocks_needed
from minikv.cache.prefix.hash_chain import block_hashes
from minikv.cache.prefix.registry import make_prefix_cache
from minikv.engine.sequence import Sequence

from engine_checks import checked

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (tests/conftest.py)

BS = 4
NUM_BLOCKS = 10
SALTS = (None, "alice", "bob")
FAMILIES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 50, 51, 52, 53], [90, 91, 92, 93, 94, 95]]


class PrefixCacheMachine(RuleBasedStateMachine):
    @initialize(design=st.sampled_from(["hash", "radix"]), eviction=st.sampled_from(["lru", "fifo"]),
                span=st.sampled_from([1, 2, 32]))
    def setup(self, design, eviction, span):
        self.bm = BlockManager(NUM_BLOCKS, BS)
        self.bm.attach_prefix_cache(make_prefix_cache(design, BS, eviction))
        self.cache = self.bm.prefix_cache
        if design == "hash":  # short spans: the hash chain's lookups walk spans of one or two blocks too
            self.cache.span = span
        self.running: list[Sequence] = []
        self.waiting: list[Sequence] = []  # preempted (recompute): no blocks, will be admitted again
        self.content: dict[int, tuple] = {}
        self.rng = random.Random(0)

    # ---- the oracle -----------------------------------------------------------------------------
    def write(self, seq: Sequence, start: int, end: int) -> None:
        """The model computed tokens [start, end) of seq: their K/V land in its blocks."""
        for i in range(start // BS, blocks_needed(end, BS)):
            b = seq.block_table[i]
            assert self.bm.ref_count[b] == 1, f"block {b} is written while shared (ref {self.bm.ref_count[b]})"
            assert not self.cache.holds(b), f"block {b} is written while cached"
            self.content[b] = (seq.cache_salt, tuple(seq.token_ids[:min(end, (i + 1) * BS)]))

    def expect(self, seq: Sequence, upto: int) -> None:
        """Every block of seq covering [0, upto) holds exactly seq's own salt and tokens."""
        for i in range(blocks_needed(upto, BS)):
            want = (seq.cache_salt, tuple(seq.token_ids[:min(upto, (i + 1) * BS)]))
            got = self.content.get(seq.block_table[i])
            assert got == want, f"block {seq.block_table[i]} (index {i}) holds {got}, request needs {want}"

    def compute(self, seq: Sequence, n: int) -> bool:
        """One step of seq over n more tokens, the way the scheduler and the runner do it."""
        start = seq.num_computed_tokens
        end = min(seq.num_tokens, start + n)
        if not self.bm.can_grow(seq, end):
            return False
        self.bm.grow(seq, end)
        for src, dst in self.bm.copy_on_write(seq, end):
            self.content[dst] = self.content[src]
        self.write(seq, start, end)
        seq.num_computed_tokens = end
        self.bm.cache_blocks(seq)
        self.expect(seq, end)
        return True

    def admit(self, seq: Sequence, n: int) -> bool:
        hit = self.bm.match_prefix(seq)
        assert hit.num_tokens < seq.num_tokens, "a hit must leave a token to compute"
        if not self.bm.can_admit(seq, hit, min(seq.num_tokens, hit.num_tokens + n)):
            return False
        seq.num_computed_tokens = self.bm.acquire_prefix(seq, hit)  # the caller records what the hit computed
        self.expect(seq, hit.num_tokens)  # the hit serves this request's own tokens and salt
        self.running.append(seq)
        self.compute(seq, n)
        return True

    # ---- rules ----------------------------------------------------------------------------------
    @rule(family=st.integers(0, len(FAMILIES) - 1), keep=st.integers(1, 10),
          suffix=st.lists(st.integers(3, 40), max_size=10), salt=st.sampled_from(SALTS), n=st.integers(1, 12))
    def arrive(self, family, keep, suffix, salt, n):
        tokens = FAMILIES[family][:keep] + suffix
        self.admit(Sequence(tokens, SamplingParams(), cache_salt=salt), n)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 99), n=st.integers(1, 6), token=st.integers(3, 40))
    def step(self, pick, n, token):
        seq = self.running[pick % len(self.running)]
        if seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids.append(token)  # decode: the sampled token is the next to compute
            n = 1
        self.compute(seq, n)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 99))
    def finish(self, pick):
        seq = self.running.pop(pick % len(self.running))
        self.bm.free(seq)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 99))
    def preempt(self, pick):
        seq = self.running.pop(pick % len(self.running))
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.waiting.append(seq)

    @precondition(lambda self: self.waiting)
    @rule(n=st.integers(1, 12))
    def readmit(self, n):
        if self.admit(self.waiting[0], n):
            self.waiting.pop(0)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 99))
    def fork(self, pick):
        parent = self.running[pick % len(self.running)]
        child = Sequence(parent.prompt_token_ids, SamplingParams(), cache_salt=parent.cache_salt)
        child.output_token_ids = list(parent.output_token_ids)
        self.bm.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        self.running.append(child)

    @rule(family=st.integers(0, len(FAMILIES) - 1), salt=st.sampled_from(SALTS), on=st.booleans())
    def pin(self, family, salt, on):
        (self.cache.pin if on else self.cache.unpin)(FAMILIES[family], salt)

    @precondition(lambda self: not self.running)
    @rule()
    def reset(self):
        self.bm.reset_prefix_cache()
        assert self.cache.cached_blocks() == [] and self.bm.allocator.inner.num_free_blocks == NUM_BLOCKS

    # ---- invariants -----------------------------------------------------------------------------
    @invariant()
    def consistent(self):
        self.bm.check(self.running)  # refcounts, free + used, and the cache's own invariants
        for b in self.cache.cached_blocks():  # a cached block is full and filed under what it holds
            salt, toks = self.content[b]
            assert toks and len(toks) % BS == 0 and salt == self.cache.salt_of(b)
            if self.cache.design == "hash":
                assert block_hashes(toks, BS, salt)[-1] == self.cache.by_block[b].key
            else:
                hit = self.cache.match(toks, salt)
                assert hit.num_tokens == len(toks) and hit.blocks[-1] == b

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq in self.running:
            self.bm.free(seq)
        self.running.clear()
        self.bm.check([])
        pinned_idle = len(self.cache.pinned)
        assert self.bm.num_free_blocks + pinned_idle == NUM_BLOCKS, "something is still held after the drain"
        self.bm.reset_prefix_cache()
        assert self.bm.allocator.inner.num_free_blocks == NUM_BLOCKS


PrefixCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                                suppress_health_check=[HealthCheck.too_slow])
test_prefix_cache_state_machine = PrefixCacheMachine.TestCase


# ---- the real engine on random workloads ---------------------------------------------------------


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), design=st.sampled_from(["hash", "radix"]),
       eviction=st.sampled_from(["lru", "fifo"]), preemption=st.sampled_from(["recompute", "swap"]),
       num_blocks=st.sampled_from([20, 28, 64]), policy=st.sampled_from(["fcfs", "lpm"]),
       window=st.sampled_from([None, None, (8, 2)]))
def test_random_workloads_give_the_tokens_of_caching_off(seed, design, eviction, preemption, num_blocks, policy,
                                                         window):
    """Caching on gives the tokens of caching off, also under a sliding window that gives back blocks
    the hash chain still holds (the radix tree is refused with a window)."""
    rng = random.Random(seed)
    families = [[rng.randrange(3, 512) for _ in range(rng.randint(3, 14))] for _ in range(3)]
    prompts, params = [], []
    for i in range(10):
        p = rng.choice(families)[: rng.randint(1, 14)] + [rng.randrange(3, 512) for _ in range(rng.randint(0, 8))]
        salt = rng.choice(SALTS)
        prompts.append({"prompt_token_ids": p or [5], "cache_salt": salt})
        params.append(SamplingParams(max_tokens=rng.randint(1, 14), ignore_eos=True,
                                     n=rng.choice([1, 1, 1, 2]), seed=i, temperature=rng.choice([0.0, 0.8])))
    kw = dict(kv_backend="paged", block_size=BS, num_blocks=num_blocks, max_model_len=64, preemption=preemption,
              max_num_batched_tokens=rng.choice([7, 64]))
    if window is not None:
        kw.update(sliding_window=window[0], sink_tokens=window[1])
        design = "hash"
    ref = LLM("tiny-random", **kw).generate(prompts, params)
    llm = checked(LLM("tiny-random", prefix_caching=design, eviction=eviction, schedule_policy=policy, **kw))
    half = rng.randint(1, 9)
    outs = llm.generate(prompts[:half], params[:half]) + llm.generate(prompts[half:], params[half:])
    for i, (a, b) in enumerate(zip(outs, ref)):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs], f"request {i}"
    assert llm.stats()["used_blocks"] == 0
