"""Rung 6, prefix caching: the hashed block chain and the radix tree, each proven equal to caching off."""
import hashlib
import random
import types

import pytest

from minikv import LLM, SamplingParams
from minikv.cache.block_manager import BlockManager
from minikv.cache.prefix.hash_chain import HashChainCache, block_hashes, chain_keys, extra_keys, hash_block, id_bytes
from minikv.cache.prefix.radix import RadixCache
from minikv.cache.prefix.registry import make_prefix_cache
from minikv.engine.sequence import Sequence

from engine_checks import checked

DESIGNS = ("hash", "radix")
BS = 4


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (tests/conftest.py)


# ---- helpers ------------------------------------------------------------------------------------
class Manager(BlockManager):
    """A BlockManager that remembers its live sequences, to check its invariants after each call."""

    def __init__(self, design: str, num_blocks: int = 16, eviction: str = "lru"):
        super().__init__(num_blocks, BS)
        self.attach_prefix_cache(make_prefix_cache(design, BS, eviction))
        self.live: list[Sequence] = []

    def free(self, seq: Sequence) -> None:
        super().free(seq)
        if seq in self.live:
            self.live.remove(seq)
            self.check(self.live)


manager = Manager


class BareRequest:
    """The fields the cache reads (minikv/cache/blocks/block_table.py's CachedRequest) and nothing else. Only
    block_table, the cache's own structure, may be assigned; any other write raises."""

    def __init__(self, seq_id: int, token_ids: list[int], num_computed_tokens: int = 0, salt: str | None = None):
        object.__setattr__(self, "block_table", [])
        for name, value in dict(seq_id=seq_id, request_id=f"bare-{seq_id}", token_ids=list(token_ids),
                                num_tokens=len(token_ids), num_computed_tokens=num_computed_tokens,
                                cache_salt=salt).items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name, value):
        if name != "block_table":
            raise AttributeError(f"the cache wrote {name} = {value!r} into a request; return it to the caller instead")
        object.__setattr__(self, name, value)

    def computed(self, n: int) -> "BareRequest":
        """The caller records progress (as the scheduler does for a Sequence)."""
        object.__setattr__(self, "num_computed_tokens", n)
        return self


@pytest.mark.parametrize("design", DESIGNS)
def test_the_cache_reads_requests_and_writes_only_their_block_table(design):
    """Admit, cache, share, fork, copy on write and free a request that is not the engine's Sequence: the
    block manager and the prefix cache read its fields and edit block_table only; what the caller must
    record (the tokens a hit computed) comes back from acquire_prefix."""
    bm = manager(design)
    first = BareRequest(0, list(range(10)))
    assert bm.acquire_prefix(first, bm.match_prefix(first)) == 0  # nothing cached yet
    bm.grow(first, 10)
    bm.cache_blocks(first.computed(10))
    second = BareRequest(1, list(range(8)) + [50, 51])
    hit = bm.match_prefix(second)
    assert bm.acquire_prefix(second, hit) == 8 == hit.num_tokens and second.num_computed_tokens == 0
    assert second.block_table == first.block_table[:2]
    bm.grow(second.computed(8), 10)
    assert bm.acquire_prefix(second, hit) is None  # it holds blocks already: nothing to take
    child = BareRequest(2, second.token_ids + [60], num_computed_tokens=10)
    bm.fork(second, child)  # the child writes position 10 next, into the partial block both hold
    shared = second.block_table[2]
    [(src, dst)] = bm.copy_on_write(child, 11)
    assert src == shared and child.block_table == second.block_table[:2] + [dst]
    bm.check([first, second, child])
    for r in (first, second, child):
        bm.free(r)
    assert bm.num_used_blocks == 0


def run(bm: Manager, tokens: list[int], salt: str | None = None) -> Sequence:
    """Admit a sequence the way the scheduler does and compute all its tokens (no model)."""
    seq = Sequence(tokens, SamplingParams(), cache_salt=salt)
    hit = bm.match_prefix(seq)
    seq.num_computed_tokens = seq.num_cached_tokens = bm.acquire_prefix(seq, hit)  # the scheduler records it
    bm.grow(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_blocks(seq)
    bm.live.append(seq)
    bm.check(bm.live)
    return seq


def paged(prefix_caching=None, **kw) -> LLM:
    return checked(LLM("tiny-random", kv_backend="paged", prefix_caching=prefix_caching,
                       **{"block_size": BS, "num_blocks": 128, **kw}))


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


# ---- the hash chain -----------------------------------------------------------------------------
def test_block_key_is_a_stable_sha256_not_pythons_salted_hash():
    key = hash_block(None, (1, 2, 3, 4))
    assert key == hash_block(None, [1, 2, 3, 4]) and isinstance(key, bytes) and len(key) == 32
    # pinned: the same digest in every process and on every machine (PYTHONHASHSEED plays no part)
    assert key.hex()[:16] == "5a325ff5a219758e"


def test_block_key_frames_its_parts_so_no_two_inputs_hash_the_same_bytes():
    parent = hash_block(None, (1, 2))
    # a parent's bytes could pass for tokens, and the extra keys for more tokens, without the header
    assert hash_block(parent, (3,)) != hash_block(None, tuple(int.from_bytes(parent[i:i + 8], "little", signed=True)
                                                              for i in range(0, 32, 8)) + (3,))
    assert hash_block(None, (1, 2), (("cache_salt", "a"),)) != hash_block(None, (1, 2))
    with pytest.raises(TypeError):
        hash_block(None, (1.5, 2))  # a token id is an integer; a float is refused, never truncated


def test_block_key_chains_its_parent_so_one_early_token_changes_every_later_key():
    a = block_hashes(list(range(12)), BS)
    b = block_hashes([99] + list(range(1, 12)), BS)
    assert len(a) == 3 and all(x != y for x, y in zip(a, b))
    assert a[1] == hash_block(a[0], (4, 5, 6, 7))


def test_only_full_blocks_get_a_key():
    assert len(block_hashes(list(range(11)), BS)) == 2
    assert block_hashes(list(range(3)), BS) == []


def test_salt_enters_the_first_block_and_flows_down_the_chain():
    toks = list(range(12))
    plain, red, blue = (block_hashes(toks, BS, s) for s in (None, "red", "blue"))
    assert extra_keys(0, "red") == (("cache_salt", "red"),) and extra_keys(1, "red") == ()
    assert all(len({p, r, b}) == 3 for p, r, b in zip(plain, red, blue))  # every block differs
    assert red == block_hashes(toks, BS, "red")


def test_hash_collision_is_caught_by_comparing_tokens():
    cache = HashChainCache(BS, hash_fn=lambda parent, toks, extra: b"same key for everything")
    bm = Manager("hash")
    bm.prefix_cache = None
    bm.allocator = bm.allocator.inner
    bm.attach_prefix_cache(cache)
    bm.free(run(bm, [1, 2, 3, 4, 5]))
    assert cache.match([9, 9, 9, 9, 9]).num_tokens == 0 and cache.num_collisions > 0
    assert cache.match([1, 2, 3, 4, 5]).num_tokens == BS


def test_chain_keys_from_one_buffer_equal_hash_block_one_block_at_a_time():
    toks = [3, 151935, 0, 2**40, 7, 7, 7, 7, 1, 2, 3, 4, 5]
    for salt in (None, "red"):
        each, parent = [], None
        for i in range(len(toks) // BS):
            parent = hash_block(parent, tuple(toks[i * BS:(i + 1) * BS]), extra_keys(i, salt))
            each.append(parent)
        assert list(chain_keys(toks, BS, 3, salt)) == each == block_hashes(toks, BS, salt)
        assert list(chain_keys(toks[BS:], BS, 2, None, parent=each[0])) == each[1:]  # resumed from a parent
    with pytest.raises(TypeError):
        list(chain_keys([1.5, 2, 3, 4], BS, 1))
    with pytest.raises(ValueError, match="need 8 token ids"):
        list(chain_keys([1, 2, 3], BS, 2))


@pytest.mark.parametrize("tamper", ["token_ids", "parent", "extra"])
def test_a_hit_whose_entry_hashed_other_content_stops_there(tamper):
    """The bulk comparison of a hit (every entry's tokens, parent and extra keys at once) catches an entry
    stored under the right key with other content, and the hit stops at that block."""
    bm = manager("hash")
    toks = list(range(4 * BS + 1))
    bm.free(run(bm, toks))
    cache = bm.prefix_cache
    assert cache.match(toks).num_tokens == 4 * BS
    entry = cache.table[block_hashes(toks, BS)[2]]
    setattr(entry, tamper, {"token_ids": (0,) * BS, "parent": b"x" * 32, "extra": (("cache_salt", "x"),)}[tamper])
    entry.token_bytes = id_bytes(entry.token_ids)  # the two forms of its tokens agree, as insert makes them
    hit = cache.match(toks)
    assert hit.num_tokens == 2 * BS and len(hit.blocks) == 2 and cache.num_collisions == 1


def counted_sha256(monkeypatch) -> list[bytes]:
    """Every sha256 the hash cache makes from now on, counted (the module's hashlib swapped)."""
    from minikv.cache.prefix import hash_chain
    calls = []

    def sha256(data=b""):
        calls.append(data)
        return hashlib.sha256(data)
    monkeypatch.setattr(hash_chain, "hashlib", types.SimpleNamespace(sha256=sha256))
    return calls


def test_a_repeated_hit_walks_the_local_index_and_hashes_only_the_block_past_it(monkeypatch):
    """The first lookup finds the chain by sha256 and the local index learns it; the next ones walk that
    index, and the sha256 walk goes on only from where it stopped: one call for the first new block."""
    bm = manager("hash", num_blocks=32)
    shared = list(range(8 * BS))
    bm.free(run(bm, shared + [1, 2, 3]))
    cache = bm.prefix_cache
    calls = counted_sha256(monkeypatch)
    assert cache.match(shared + [7]).num_tokens == 8 * BS and len(calls) == 8  # by sha256, learned now
    calls.clear()
    assert cache.match(shared + [7]).blocks == cache.match(shared).blocks and calls == []
    hit = cache.match(shared + [5] * BS + [7])  # one block past the cached chain: its sha256, a miss
    assert hit.num_tokens == 8 * BS and len(calls) == 1
    bm.check([])


def test_a_local_key_that_collides_never_serves_another_prefixs_blocks():
    """A local key is Python's 64-bit hash: if two chains' keys collide, the walk finds the other
    chain's entry, the bulk comparison refuses it, and the sha256 walk serves the request's own blocks."""
    bm = manager("hash", num_blocks=32)
    a, b = list(range(4 * BS)), list(range(100, 100 + 4 * BS))
    blocks_a, blocks_b = run(bm, a + [1]).block_table[:4], run(bm, b + [1]).block_table[:4]
    cache = bm.prefix_cache
    assert cache.match(a).blocks == blocks_a and cache.match(b).blocks == blocks_b  # both chains learned
    first_a, first_b = (cache.by_block[blocks[0]] for blocks in (blocks_a, blocks_b))
    cache.local[first_a.local_key] = first_b  # a's first local key now leads to b's chain
    assert cache.match(a).blocks == blocks_a and cache.match(b).blocks == blocks_b
    assert cache.num_collisions == 0  # sha256 keys never collided


def test_an_evicted_block_leaves_the_local_index():
    bm = manager("hash", num_blocks=8)
    first = list(range(4 * BS))
    bm.free(run(bm, first + [1]))
    cache = bm.prefix_cache
    assert len(cache.match(first).blocks) == 4 and len(cache.local) == 4
    bm.free(run(bm, list(range(200, 200 + 6 * BS))))  # 6 of 8 blocks: 4 empty ones, then the chain's tail
    assert len(cache.local) == 2 and all(cache.by_block.get(e.block) is e for e in cache.local.values())
    assert len(cache.match(first).blocks) == 2
    bm.check([])


def long_chain_manager(num_blocks: int = 32) -> Manager:
    bm = manager("hash", num_blocks=num_blocks)
    bm.prefix_cache.span = 2  # spans of two blocks: a chain of 8 blocks is 4 spans
    return bm


def test_a_long_hit_is_walked_a_span_at_a_time_and_matches_the_sha256_walk(monkeypatch):
    """A verified chain becomes spans; the next lookups walk them (no sha256 before the first new block)
    and find exactly the blocks the one-block-at-a-time sha256 walk finds, where the chains part too."""
    bm = long_chain_manager()
    cache = bm.prefix_cache
    shared = list(range(8 * BS))
    bm.free(run(bm, shared + [1, 2, 3]))
    assert cache.match(shared).num_tokens == 8 * BS and len(cache.spans) == 4
    calls, made = counted_sha256(monkeypatch), []
    for probe in (shared + [7], shared[:5 * BS] + [9] * 3 * BS, shared[:5 * BS + 1] + [9] * 3 * BS, shared[:3]):
        calls.clear()
        hit = cache.match(probe)
        made.append(len(calls))
        assert hit.blocks == cache._match_each(probe, None, len(probe) // BS)[0].blocks, probe
    assert made == [0, 1, 1, 0]  # two spans and a block of the third walked, then one sha256: the first new block
    bm.check([])


def test_a_span_whose_block_left_the_cache_is_never_walked():
    bm = long_chain_manager(num_blocks=10)
    cache = bm.prefix_cache
    shared = list(range(8 * BS))
    bm.free(run(bm, shared + [1]))
    assert cache.match(shared).num_tokens == 8 * BS and len(cache.spans) == 4
    bm.free(run(bm, list(range(200, 200 + 5 * BS))))  # 5 of 10 blocks: 2 empty ones, then the chain's last 3
    assert cache.match(shared).num_tokens == 5 * BS  # the third span lost its second block: the walk stops there
    bm.check([])  # a stale span is allowed (skipped), a wrong one is not
    span = next(iter(cache.spans.values()))
    span.data = bytes(len(span.data))
    with pytest.raises(AssertionError, match="does not hold its entries' chain"):
        bm.check([])


def test_spans_whose_blocks_left_the_cache_are_dropped():
    """Spans are made on every long hit and go stale as their blocks are evicted: the index keeps about as
    many as are live, not one per chain ever seen."""
    bm = long_chain_manager(num_blocks=10)
    cache = bm.prefix_cache
    for i in range(120):  # 120 chains of 4 blocks through a pool of 10: each made 2 spans on its second run
        chain = list(range(1000 * i, 1000 * i + 4 * BS))
        bm.free(run(bm, chain + [1]))
        bm.free(run(bm, chain + [2]))
    live = sum(all(cache.by_block.get(e.block) is e for e in sp.entries) for sp in cache.spans.values())
    assert live >= 2 and len(cache.spans) <= 2 * live + 64 + 2
    bm.check([])


def test_a_span_under_another_chains_key_is_refused_by_its_parent():
    """Two chains with the same bytes in their second span: one's span put under the other's key (what a
    64-bit collision would do) holds the right bytes but hangs from another parent, so the walk refuses it."""
    bm = long_chain_manager()
    cache = bm.prefix_cache
    tail = list(range(500, 500 + 2 * BS))
    a, b = list(range(2 * BS)) + tail, list(range(100, 100 + 2 * BS)) + tail
    blocks_a, blocks_b = run(bm, a + [1]).block_table[:4], run(bm, b + [1]).block_table[:4]
    assert cache.match(a).blocks == blocks_a and cache.match(b).blocks == blocks_b
    (key_a,) = [k for k, sp in cache.spans.items() if sp.blocks == blocks_a[2:]]
    (span_b,) = [sp for sp in cache.spans.values() if sp.blocks == blocks_b[2:]]
    cache.spans[key_a] = span_b
    assert cache.match(a).blocks == blocks_a and cache.match(b).blocks == blocks_b


def test_the_engine_hands_the_prefix_cache_the_prompts_bytes_from_its_range_check(monkeypatch):
    """new_sequence keeps the ids' bytes its range check made; the hash chain hashes those instead of
    converting the ids again, and a sequence without them (or with bytes of another length) converts."""
    from minikv.cache.prefix import hash_chain
    from minikv.engine.prompts import check_token_range

    ids = list(range(3 * BS + 1))
    assert check_token_range(ids, 1000) == id_bytes(ids)
    assert check_token_range([1.0, 2.0], 1000) is None  # not what the C pass takes: nothing kept
    llm = paged("hash")
    seq = llm.core.new_sequence(llm.request(ids, GREEDY))
    assert seq.prompt_bytes == id_bytes(ids)
    converted = []
    monkeypatch.setattr(hash_chain, "id_bytes", lambda t: converted.append(len(t)) or id_bytes(t))
    first, second = (llm.generate(ids, GREEDY)[0] for _ in range(2))
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 3 * BS)
    assert converted and set(converted) == {BS}  # insert hashed its new blocks; no lookup converted the prompt
    bm = manager("hash")
    bm.free(run(bm, ids))
    converted.clear()
    seq = Sequence(ids + [5], SamplingParams())
    seq.prompt_bytes = id_bytes(ids)  # bytes of another prompt length: not used
    assert bm.match_prefix(seq).num_tokens == 3 * BS and converted == [3 * BS]


def test_engine_with_a_colliding_hash_still_gives_the_uncached_tokens():
    prompts = [tokens(9, s) for s in range(4)]
    ref = [o.token_ids for o in paged().generate(prompts, GREEDY)]
    always = HashChainCache(BS, hash_fn=lambda parent, toks, extra: b"collide")
    assert [o.token_ids for o in paged(always).generate(prompts, GREEDY)] == ref


def test_freed_blocks_keep_their_key_and_wait_in_an_lru_queue_tail_first():
    bm = manager("hash")
    seq = run(bm, list(range(12)))
    a, b, c = seq.block_table
    bm.free(seq)
    cache = bm.prefix_cache
    assert cache.free_queue.ordered() == [c, b, a]  # the tail goes first, the prefix stays longest
    assert bm.num_free_blocks == 16 and cache.num_evictable == 3


def test_a_hit_takes_the_block_out_of_the_free_queue_and_raises_its_refcount():
    bm = manager("hash")
    first = run(bm, list(range(9)))
    a, b = first.block_table[:2]
    second = run(bm, list(range(8)) + [50, 51])  # shares blocks a and b while `first` still runs
    assert second.block_table[:2] == [a, b] and bm.ref_count[a] == 2
    assert second.num_cached_tokens == 8
    bm.free(first)
    bm.free(second)
    assert bm.ref_count[a] == 0 and a in bm.prefix_cache.free_queue
    third = run(bm, list(range(8)) + [60])
    assert third.block_table[:2] == [a, b] and bm.ref_count[a] == 1 and a not in bm.prefix_cache.free_queue
    bm.check([third])


@pytest.mark.parametrize("design", DESIGNS)
def test_empty_blocks_are_used_before_any_cached_block_is_evicted(design):
    bm = manager(design, num_blocks=8)
    bm.free(run(bm, list(range(12))))  # 3 cached blocks, 5 empty
    bm.free(run(bm, list(range(100, 120))))  # 5 blocks: exactly the empty ones
    assert bm.prefix_cache.num_evicted == 0 and len(bm.prefix_cache.cached_blocks()) == 8
    bm.free(run(bm, list(range(200, 204))))  # one more: now something must go
    assert bm.prefix_cache.num_evicted == 1


@pytest.mark.parametrize("design", DESIGNS)
def test_lru_evicts_the_least_recently_used_prefix_and_fifo_the_oldest(design):
    for eviction, survivor in (("lru", "old"), ("fifo", "new")):
        bm = manager(design, num_blocks=6, eviction=eviction)
        old, new = list(range(8)), list(range(100, 108))
        bm.free(run(bm, old + [1]))
        bm.free(run(bm, new + [1]))
        bm.free(run(bm, old + [2]))  # `old` is used again: the most recent under LRU, still the oldest for FIFO
        bm.free(run(bm, list(range(200, 208)) + [3]))  # needs 3 blocks: 2 empty + 1 evicted
        cache = bm.prefix_cache
        kept = "old" if cache.match(old).num_tokens == 8 else "new" if cache.match(new).num_tokens == 8 else None
        assert kept == survivor, f"{design}/{eviction} kept {kept}"


def test_radix_splits_a_node_where_two_prompts_diverge_and_grows_a_leaf_for_the_next_turn():
    bm = manager("radix", num_blocks=32)
    cache = bm.prefix_cache
    sys_prompt = list(range(8))
    a = run(bm, sys_prompt + [50, 51, 52, 53])
    assert [len(n.blocks) for n, _ in cache.nodes()] == [0, 3]  # root, one leaf of 3 blocks
    b = run(bm, sys_prompt + [60, 61, 62, 63])
    assert [(len(n.blocks), d) for n, d in cache.nodes()] == [(0, 0), (2, 1), (1, 2), (1, 2)]
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached_tokens == 8
    a.output_token_ids = [70, 71, 72, 73]  # the answer; the next turn extends the same leaf
    bm.grow(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    bm.cache_blocks(a)
    assert [len(n.blocks) for n, _ in cache.nodes()] == [0, 2, 2, 1]
    bm.check([a, b])


def evict(bm: Manager, n: int) -> list[int]:
    """Evict up to n unused cached blocks the way the allocator does, handing them back empty."""
    out = bm.prefix_cache.evict(n)
    for b in out:
        bm.allocator.inner.free(b)
    bm.check(bm.live)
    return out


def test_radix_evicts_unused_leaves_tail_first_and_a_bare_parent_becomes_a_leaf():
    bm = manager("radix", num_blocks=8)
    cache = bm.prefix_cache
    sys_prompt = list(range(8))
    a = run(bm, sys_prompt + [50, 51, 52, 53, 54, 55, 56, 57, 1])
    b = run(bm, sys_prompt + [60, 61, 62, 63, 1])
    a_tail = a.block_table[2:4]
    bm.free(a)
    assert evict(bm, 1) == [a_tail[1]]  # the last block of a's leaf goes first
    assert evict(bm, 5) == [a_tail[0]]  # then its first; the rest is in use by b
    assert [len(n.blocks) for n, _ in cache.nodes()] == [0, 2, 1]
    bm.free(b)
    assert len(evict(bm, 5)) == 3 and cache.roots == {}  # b's leaf, then the bare parent


@pytest.mark.parametrize("design", DESIGNS)
def test_a_pinned_prefix_survives_eviction(design):
    bm = manager(design, num_blocks=6)
    sys_prompt = list(range(8))
    bm.free(run(bm, sys_prompt + [1]))
    assert bm.prefix_cache.pin(sys_prompt) == 8
    for s in range(4):  # churn through the rest of the pool
        bm.free(run(bm, tokens(12, s)))
    assert bm.prefix_cache.match(sys_prompt).num_tokens == 8
    bm.check([])
    bm.prefix_cache.unpin(sys_prompt)
    bm.free(run(bm, tokens(20, 9)))
    assert bm.prefix_cache.match(sys_prompt).num_tokens < 8


# ---- the engine: caching on == caching off -------------------------------------------------------
def shared_system_prompt_workload(n=8, seed=0):
    rng = random.Random(seed)
    system = tokens(23, seed)  # 5 full blocks + 3 tokens: the shared prefix ends inside a block
    prompts = [system + tokens(rng.randint(1, 9), seed + 1 + i) for i in range(n)]
    return prompts


@pytest.fixture(scope="module")
def system_prompt_reference():
    prompts = shared_system_prompt_workload()
    return prompts, [o.token_ids for o in paged().generate(prompts, GREEDY)]


@pytest.mark.parametrize("design", DESIGNS)
def test_shared_system_prompt_outputs_equal_caching_off(design, system_prompt_reference):
    prompts, ref = system_prompt_reference
    llm = paged(design)
    first = llm.generate(prompts[:1], GREEDY)
    rest = llm.generate(prompts[1:], GREEDY)
    assert [o.token_ids for o in first + rest] == ref
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens == 20 for o in rest)  # 5 full blocks; the partial 6th is recomputed
    s = llm.stats()["prefix_cache"]
    assert s["hits"] == 20 * 7 and s["queries"] == sum(len(p) for p in prompts)
    assert s["hit_rate"] == pytest.approx(s["hits"] / s["queries"])
    assert llm.stats()["used_blocks"] == 0


@pytest.mark.parametrize("design", DESIGNS)
def test_a_chat_hits_on_its_previous_turns_answer_and_stays_exact(design):
    cached, plain = paged(design), paged()
    history = tokens(10, 1)
    for turn in range(3):
        a = cached.generate(history, GREEDY)[0]
        b = plain.generate(history, GREEDY)[0]
        assert a.token_ids == b.token_ids
        if turn:  # everything before this turn's new message was cached, the answer included
            assert a.num_cached_tokens == (len(history) - 4 - 1) // BS * BS
        history = history + a.token_ids + tokens(4, 10 + turn)


@pytest.mark.parametrize("design", DESIGNS)
def test_a_prompt_that_is_all_cached_still_computes_its_last_token(design):
    llm = paged(design)
    prompt = tokens(12, 3)  # exactly 3 blocks
    first = llm.generate(prompt, GREEDY)[0]
    again = llm.generate(prompt, GREEDY)[0]
    assert again.num_cached_tokens == 8 and again.token_ids == first.token_ids


@pytest.mark.parametrize("design", DESIGNS)
def test_cache_salt_isolates_tenants(design):
    llm = paged(design)
    prompt = tokens(17, 4)
    llm.generate({"prompt_token_ids": prompt, "cache_salt": "alice"}, GREEDY)
    bob = llm.generate({"prompt_token_ids": prompt, "cache_salt": "bob"}, GREEDY)[0]
    anon = llm.generate(prompt, GREEDY)[0]
    alice = llm.generate({"prompt_token_ids": prompt, "cache_salt": "alice"}, GREEDY)[0]
    assert (bob.num_cached_tokens, anon.num_cached_tokens, alice.num_cached_tokens) == (0, 0, 16)
    assert bob.token_ids == anon.token_ids == alice.token_ids


PRESSURE = {
    "recompute": dict(num_blocks=24, max_model_len=64),
    "swap": dict(num_blocks=24, max_model_len=64, preemption="swap"),
    "chunked": dict(num_blocks=40, max_num_batched_tokens=7),
}


@pytest.mark.parametrize("variant", list(PRESSURE))
@pytest.mark.parametrize("design", DESIGNS)
def test_outputs_equal_caching_off_under_eviction_and_preemption(design, variant):
    rng = random.Random(7)
    families = [tokens(rng.randint(5, 14), 100 + f) for f in range(3)]
    prompts = [rng.choice(families) + tokens(rng.randint(1, 12), 200 + i) for i in range(12)]
    params = [SamplingParams(max_tokens=rng.randint(4, 20), ignore_eos=True) for _ in prompts]
    ref = [o.token_ids for o in paged(**PRESSURE[variant]).generate(prompts, params)]
    llm = paged(design, **PRESSURE[variant])
    outs = llm.generate(prompts[:6], params[:6]) + llm.generate(prompts[6:], params[6:])
    assert [o.token_ids for o in outs] == ref
    s = llm.stats()
    assert s["prefix_cache"]["hits"] > 0 and s["used_blocks"] == 0
    if variant != "chunked":
        assert s["num_preemptions"] > 0 and s["prefix_cache"]["evicted_blocks"] > 0


@pytest.mark.parametrize("design", DESIGNS)
def test_abort_mid_prefill_and_mid_decode_leaves_nothing_held(design):
    llm = paged(design, max_num_batched_tokens=6)
    prompt = tokens(30, 5)
    seqs = [llm.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True)) for _ in range(3)]
    for _ in range(3):
        llm.step()
    llm.abort(seqs[0])
    while llm.has_unfinished():
        llm.step()
        llm.abort(seqs[1])
    assert llm.stats()["used_blocks"] == 0
    again = llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert again.token_ids == seqs[2].output_token_ids and again.num_cached_tokens == 28


@pytest.mark.parametrize("design", DESIGNS)
def test_parallel_samples_share_the_cached_prompt(design):
    prompt = tokens(14, 6)
    sp = SamplingParams(max_tokens=8, temperature=0.9, n=3, seed=3)
    ref = [[c.token_ids for c in o.outputs] for o in paged().generate([prompt, prompt], sp)]
    llm = paged(design)
    outs = llm.generate([prompt], sp) + llm.generate([prompt], sp)
    assert [[c.token_ids for c in o.outputs] for o in outs] == ref
    assert outs[1].num_cached_tokens == 12


# ---- control: reset, pin, policies ---------------------------------------------------------------
@pytest.mark.parametrize("design", DESIGNS)
def test_reset_is_refused_while_cached_blocks_are_in_use_and_deferred_on_request(design):
    llm = paged(design)
    prompt = tokens(13, 8)
    llm.generate(prompt, GREEDY)
    seq = llm.add_request(prompt, GREEDY)
    llm.step()
    with pytest.raises(RuntimeError, match="in use by running requests"):
        llm.reset_prefix_cache()
    assert llm.reset_prefix_cache(defer=True) is False
    late = llm.add_request(prompt, GREEDY)  # arrives while the reset waits: no hit on stale blocks
    while llm.has_unfinished():
        llm.step()
    assert late.num_cached_tokens == 0 and seq.num_cached_tokens == 12
    assert llm.prefix_cache.cached_blocks() == [] and llm.prefix_cache.enabled
    assert llm.generate(prompt, GREEDY)[0].num_cached_tokens == 0
    assert llm.reset_prefix_cache() is True and llm.stats()["prefix_cache"]["resets"] == 2


def test_reset_after_changing_the_weights_serves_no_stale_blocks():
    import torch

    llm = paged("radix")
    prompt = tokens(21, 9)
    llm.generate(prompt, GREEDY)
    with torch.no_grad():
        llm.model.model.layers[0].mlp.down_proj.weight.mul_(-1.0)
    llm.reset_prefix_cache()
    fresh = LLM("tiny-random", kv_backend="paged", block_size=BS, num_blocks=128)
    with torch.no_grad():
        fresh.model.model.layers[0].mlp.down_proj.weight.mul_(-1.0)
    out = llm.generate(prompt, GREEDY)[0]
    assert out.num_cached_tokens == 0 and out.token_ids == fresh.generate(prompt, GREEDY)[0].token_ids


@pytest.mark.parametrize("design", DESIGNS)
def test_pin_prefix_computes_then_pins_a_system_prompt(design):
    llm = paged(design, num_blocks=20, max_model_len=64)  # 4 pinned blocks leave 16: one request of 64 tokens fits
    system = tokens(16, 11)
    assert llm.pin_prefix(system) == 16
    for i in range(6):
        llm.generate(tokens(30, 20 + i), GREEDY)  # fills the pool over and over
    assert llm.generate(system + [5], GREEDY)[0].num_cached_tokens == 16
    assert llm.unpin_prefix(system) == 16
    with pytest.raises(ValueError, match="prefix_caching"):
        paged().pin_prefix(system)


def test_longest_prefix_first_serves_more_hits_but_can_starve_a_loner():
    system = tokens(16, 12)
    loner = tokens(20, 13)

    def admission_order(policy):
        llm = paged("radix", max_num_seqs=1, schedule_policy=policy)
        llm.generate(system + [1], SamplingParams(max_tokens=1))
        admitted = []

        class Admissions:
            def on_event(self, engine, step, request_id, event):
                if event == "admit":
                    admitted.append(request_id)

        llm.add_observer(Admissions())
        llm.add_request(loner, SamplingParams(max_tokens=2), request_id="loner")
        for i in range(4):
            llm.add_request(system + tokens(3, 30 + i), SamplingParams(max_tokens=2), request_id=f"shared{i}")
        while llm.has_unfinished():
            llm.step()
        return admitted

    assert admission_order("fcfs")[0] == "loner"
    assert admission_order("lpm")[-1] == "loner"  # the shared ones jump ahead of it, every time


def test_bad_prefix_cache_options_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="kv_backend='paged'"):
        LLM("tiny-random", prefix_caching="hash")
    with pytest.raises(ValueError, match="prefix_caching must be"):
        LLM("tiny-random", kv_backend="paged", prefix_caching="trie")
    with pytest.raises(ValueError, match="eviction must be"):
        LLM("tiny-random", kv_backend="paged", prefix_caching="hash", eviction="random")
    with pytest.raises(ValueError, match="turn prefix_caching on"):
        LLM("tiny-random", kv_backend="paged", schedule_policy="lpm")
    with pytest.raises(ValueError, match="block_size"):
        LLM("tiny-random", kv_backend="paged", block_size=8, prefix_caching=RadixCache(4))


@pytest.fixture(scope="module")
def smollm2():
    return LLM("smollm2-135m", kv_backend="paged", num_blocks=64)


def with_prefix_cache(llm: LLM, design) -> LLM:
    """The same loaded model on a fresh block pool with `design` (loading SmolLM2 twice is slow)."""
    return llm.derive(prefix_caching=design)


@pytest.mark.slow
def test_smollm2_shared_system_prompt_with_caching_equals_caching_off(smollm2):
    system = "You are a concise assistant for a course on the KV cache. Answer in one short sentence."
    prompts = [smollm2.chat_prompt(q, system=system) for q in ("What is a KV cache?", "Why share a prefix?")]
    sp = SamplingParams(max_tokens=8)
    ref = [o.text for o in with_prefix_cache(smollm2, None).generate(prompts, sp)]
    for design in DESIGNS:
        llm = with_prefix_cache(smollm2, design)
        outs = llm.generate(prompts[:1], sp) + llm.generate(prompts[1:], sp)
        assert [o.text for o in outs] == ref, design
        assert outs[1].num_cached_tokens >= 16, design


# ---- the course's tools: pictures and checkers ---------------------------------------------------
@pytest.mark.parametrize("design", DESIGNS)
def test_snapshot_shows_every_cached_block_once_with_its_state_and_eviction_order(design):
    from minikv.viz.prefix import hit_lines, run_and_snap, tree_lines

    llm = paged(design, num_blocks=32)
    system = tokens(12, 14)
    run_and_snap(llm, "a", system + [5, 6, 7, 8, 9], GREEDY)
    out, snaps = run_and_snap(llm, "b", system + [9, 9, 9, 9, 9], GREEDY)
    during, after = snaps
    assert sorted(b for box in after.boxes for b in box.blocks) == sorted(llm.prefix_cache.cached_blocks())
    assert {box.state for box in during.boxes} == {"in use", "unused"}
    assert {box.state for box in after.boxes} == {"unused"}
    ranks = sorted(box.evict_rank for box in after.boxes if box.evict_rank)
    assert ranks == list(range(1, len(ranks) + 1)) and ranks
    assert after.pool.count("empty") == llm.block_manager.allocator.inner.num_free_blocks
    assert len(tree_lines(after)) == len(after.boxes) + 1
    assert hit_lines(llm, {"b": system + [9, 9, 9, 9, 9], "other": [1] + system}) == [
        "b      ■■■■  4/4 blocks hit", "other  □□□  0/3 blocks hit"]


def test_checkers_pass_the_engines_own_functions_and_explain_a_missing_parent():
    from minikv.cache.prefix.radix import match_prefix
    from minikv.checks.prefix import check_block_hashes, check_hash_block, check_radix_match

    check_hash_block(hash_block)
    check_block_hashes(block_hashes, hash_block, num_random=20)
    check_radix_match(match_prefix, num_random=20)

    def no_parent(token_ids, block_size, cache_salt=None):
        return [hash_block(None, tuple(token_ids[i * block_size:(i + 1) * block_size]), extra_keys(i, cache_salt))
                for i in range(len(token_ids) // block_size)]

    with pytest.raises(AssertionError, match="the parent key is missing"):
        check_block_hashes(no_parent, hash_block, num_random=0)


def test_a_long_hit_hashes_its_prefix_once_and_caches_the_same_blocks():
    """lookup keeps the hit's chain keys for the sequence's insert: a 10-block hit is hashed at lookup and
    only the blocks the request computes itself are hashed at insert."""
    calls = []

    def counting(parent, toks, extra):
        calls.append(toks)
        return hash_block(parent, toks, extra)

    llm = LLM("tiny-random", kv_backend="paged", block_size=4, num_blocks=64,
              prefix_caching=HashChainCache(4, hash_fn=counting))
    plain = LLM("tiny-random", kv_backend="paged", block_size=4, num_blocks=64, prefix_caching="hash")
    shared = list(range(30, 70))  # 10 blocks of 4
    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    for engine in (llm, plain):
        engine.generate(shared + [1, 2, 3, 4, 5], sp)
    calls.clear()
    second = shared + [9, 8, 7, 6, 5]
    got = llm.generate(second, sp)[0]
    assert got.num_cached_tokens == 40 and got.token_ids == plain.generate(second, sp)[0].token_ids
    # lookup: the 10 hit blocks and the 11th, where the chain stops; insert: only the 11th again (computed
    # here), never the hit (22 hashes before lookup kept its keys)
    assert len(calls) == 11 + 1, len(calls)
    assert llm.view.prefix_stats()["cached_blocks"] == plain.view.prefix_stats()["cached_blocks"]


@pytest.mark.parametrize("design", ["hash", "radix"])
def test_the_scheduler_hands_a_sequence_to_the_cache_only_in_a_step_that_filled_one_of_its_blocks(design):
    """A decode fills a block every block_size steps: the steps between ask the cache nothing, and every
    full block is cached all the same, the same blocks as a cache asked every step would hold."""
    llm = LLM("tiny-random", kv_backend="paged", block_size=4, num_blocks=64, prefix_caching=design,
              async_scheduling=False)
    bm, calls, steps = llm.block_manager, [], []
    cache_blocks = bm.cache_blocks
    bm.cache_blocks = lambda seq: calls.append(seq.num_computed_tokens) or cache_blocks(seq)
    llm.add_observer(types.SimpleNamespace(on_step=lambda llm, batch, events: steps.append(1)))
    prompt = list(range(10, 30))  # 20 tokens: the prefill fills blocks 0-4
    out = llm.generate(prompt, SamplingParams(max_tokens=11, ignore_eos=True))[0]
    assert len(steps) == 11  # the prefill, then 10 decodes (computed 21 .. 30)
    assert calls == [20, 24, 28], calls  # the steps that filled a block: 20 (blocks 0-4), 24, 28
    assert len(bm.prefix_cache.cached_blocks()) == 7  # blocks 0-6 of the 30 computed tokens
    again = llm.generate(prompt + out.token_ids[:9], SamplingParams(max_tokens=1))[0]
    assert again.num_cached_tokens == 28  # the decoded blocks were cached: a later request finds them


class _BlockByBlock(HashChainCache):
    """The same cache, made to take insert's block-by-block loop: a `_key` of its own (as a lab's)."""

    def _key(self, parent, token_ids, i, salt):
        return super()._key(parent, token_ids, i, salt)


def _entries(cache: HashChainCache) -> dict:
    return {k: (e.block, e.parent, e.token_ids, e.extra, e.salt, e.token_bytes) for k, e in cache.table.items()}


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_insert_from_the_blocks_own_ids_equals_the_block_by_block_loop(salt):
    """insert hashes only the blocks it adds, from their own ids (prompt, output, or across the two) and the
    prompt's kept bytes: the same keys and entries as the loop that reads the whole token list, for an
    engine's Sequence and for a request that has only token_ids."""
    rng, compared = random.Random(7), 0
    for trial in range(20):
        prompt = [rng.randrange(3, 60) for _ in range(rng.randint(1, 30))]
        output = [rng.randrange(3, 60) for _ in range(rng.randint(0, 20))]
        caches, adopted = [HashChainCache(BS), _BlockByBlock(BS)], []
        for cache in caches:
            cache.bind([1] * 64)
            seq = Sequence(prompt, SamplingParams(max_tokens=64), cache_salt=salt)
            seq.prompt_bytes = id_bytes(prompt)
            seq.block_table = list(range(20))
            seq.num_computed_tokens = len(prompt)  # the prefill
            assert cache.insert(seq) == {}
            for token in output:  # then one token a step
                seq.output_token_ids.append(token)
                seq.num_computed_tokens += 1
                assert cache.insert(seq) == {}
            bare = BareRequest(1000 + trial, prompt + output, salt=salt).computed(len(prompt) + len(output))
            bare.block_table = list(range(20, 40))
            adopted.append(cache.insert(bare))  # the same tokens in other blocks: adopted, none cached twice
        assert _entries(caches[0]) == _entries(caches[1]), trial
        assert adopted[0] == adopted[1] == {i: i for i in range((len(prompt) + len(output)) // BS)}
        assert all(e.token_bytes == id_bytes(e.token_ids) for e in caches[0].table.values())
        compared += len(caches[0].table)
    assert compared > 100  # (the trials cached blocks: the comparisons compared entries)


def test_insert_reuses_a_lookups_keys_the_same_way_when_the_request_holds_other_blocks():
    """A request whose lookup hashed its prefix, but which holds other blocks than the hit's (it did not
    take them): insert reuses the lookup's keys for those blocks and chains on from the last of them, and
    both insert paths adopt the cached copies alike."""
    rng = random.Random(3)
    prompt = [rng.randrange(3, 60) for _ in range(6 * BS + 2)]
    results = []
    for cache in (HashChainCache(BS), _BlockByBlock(BS)):
        cache.bind([1] * 64)
        first = BareRequest(1, prompt[:4 * BS]).computed(4 * BS)
        first.block_table = list(range(4))
        cache.insert(first)  # 4 blocks cached
        seq = Sequence(prompt, SamplingParams(max_tokens=8))
        seq.prompt_bytes = id_bytes(prompt)
        assert cache.lookup(seq).blocks == [0, 1, 2, 3]  # its keys kept for insert
        seq.block_table = list(range(10, 17))  # but it runs in blocks of its own
        seq.num_computed_tokens = len(prompt)
        results.append((cache.insert(seq), _entries(cache)))
    assert results[0] == results[1]
    assert results[0][0] == {0: 0, 1: 1, 2: 2, 3: 3} and len(results[0][1]) == 6  # 4 adopted, 2 new blocks


def test_freeing_a_request_with_a_prefix_cache_loses_no_block_even_on_a_double_free():
    """BlockManager.free through the caching allocator: the cached blocks wait in the free queue tail
    first, the partial one goes back empty; a block freed twice raises, and the blocks let go before it
    still reach the free pool (none leaks)."""
    bm = manager("hash")
    seq = run(bm, list(range(14)))  # 3 full blocks cached + 1 partial (not cached)
    a, b, c, d = seq.block_table
    bm.free(seq)
    assert bm.prefix_cache.free_queue.ordered() == [c, b, a] and d in bm.allocator.inner._free
    assert bm.num_free_blocks == 16 and sum(bm.ref_count) == bm.num_refs == 0
    other = run(bm, list(range(100, 106)))
    e, f = other.block_table
    bm.ref_count[e] = 0  # (corrupted: block e was given back behind the manager's back)
    bm.num_refs -= 1
    with pytest.raises(RuntimeError, match=f"block {e} freed twice"):
        bm.free(other)
    assert bm.ref_count[f] == 0 and f in bm.allocator.inner._free  # released before e: back in the pool
