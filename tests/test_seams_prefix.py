"""The seams of the prefix caches and the static batcher: a learner's radix tree surgery (exercise 06c,
`radix_insert`, `radix_evict_leaf`), free block queue (06d, `free_block_queue`) and left-padding mask
(03a, `StaticBatcher(padded_mask=...)`).

For each: the function really runs inside the engine, a wrong one is stopped with the reason, and the
seam is refused where nothing would call it."""
import pytest
import torch

from minikv import LLM, SamplingParams
from minikv.cache.prefix.radix import Node, shared_blocks
from minikv.cache.prefix.registry import make_prefix_cache
from minikv.checks.lru import ReferenceQueue as FreeBlockQueue
from minikv.checks.padding import reference_mask as mask
from minikv.checks.radix import reference_evict_leaf as evict_leaf
from minikv.checks.radix import reference_split as split
from minikv.engine.static_batching import StaticBatcher

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (tests/conftest.py)

PAGED = dict(kv_backend="paged", block_size=4, num_blocks=12, max_model_len=48)
PROMPTS = [list(range(3, 9)), list(range(20, 37)), [5, 6]]  # 6, 17 and 2 tokens: two rows are padded


def insert(root, token_ids, blocks, block_size):
    """Exercise 06c's insert, as a learner writes it."""
    bs, node, i = block_size, root, 0
    while i < len(blocks):
        child = node.children.get(tuple(token_ids[i * bs:(i + 1) * bs]))
        if child is None:
            key, rest = tuple(token_ids[i * bs:]), list(blocks[i:])
            if node is not root and not node.children:
                node.key, node.blocks = node.key + key, node.blocks + rest
            else:
                node.children[key[:bs]] = Node(key, rest, node)
            return
        k = min(shared_blocks(child.key, token_ids, i * bs, bs), len(blocks) - i)
        i += k
        if k < len(child.blocks):
            if i == len(blocks):
                return
            child = split(child, k, bs)
        node = child
SHARED = [list(range(3, 19)), list(range(3, 11)) + [50] * 9, list(range(100, 130)), list(range(3, 19))]


def _run(llm) -> list[tuple[list[int], int]]:
    out = []
    for p in SHARED:
        o = llm.generate(p, SamplingParams(max_tokens=5, ignore_eos=True))[0]
        llm.block_manager.check(llm.scheduler.all_sequences())
        out.append((o.token_ids, o.num_cached_tokens))
    return out


def test_the_radix_seams_are_called_and_give_the_radix_caches_tokens_hits_and_evictions():
    calls = {"insert": 0, "evict_leaf": 0}

    def counted_insert(*args):
        calls["insert"] += 1
        return insert(*args)

    def counted_evict_leaf(*args):
        calls["evict_leaf"] += 1
        return evict_leaf(*args)

    mine = LLM("tiny-random", prefix_caching="radix", radix_insert=counted_insert,
               radix_evict_leaf=counted_evict_leaf, **PAGED)
    ref = mine.derive(radix_insert=None, radix_evict_leaf=None)
    assert _run(mine) == _run(ref)
    assert calls["insert"] > 0 and calls["evict_leaf"] > 0
    assert mine.prefix_cache.stats()["evicted_blocks"] == ref.prefix_cache.stats()["evicted_blocks"] > 0
    assert sorted(mine.prefix_cache.cached_blocks()) == sorted(ref.prefix_cache.cached_blocks())


def test_one_radix_seam_alone_works_beside_the_caches_own_other_half():
    ref = _run(LLM("tiny-random", prefix_caching="radix", **PAGED))
    assert _run(LLM("tiny-random", prefix_caching="radix", radix_insert=insert, **PAGED)) == ref
    assert _run(LLM("tiny-random", prefix_caching="radix", radix_evict_leaf=evict_leaf, **PAGED)) == ref


def _insert_no_extend(root, token_ids, blocks, block_size):
    """Forgets the new tokens after a childless leaf: the tree spells only part of the request."""
    if root.children:
        return None
    return insert(root, token_ids, blocks, block_size)


def _evict_keeps_key(leaf, num_blocks, block_size, is_unused):
    out = []
    while len(out) < num_blocks and leaf.blocks and is_unused(leaf.blocks[-1]):
        out.append(leaf.blocks.pop())
    if not leaf.blocks:
        del leaf.parent.children[next(k for k, c in leaf.parent.children.items() if c is leaf)]
    return out


@pytest.mark.parametrize("seam, fn, message", [
    ("radix_insert", _insert_no_extend, "after your insert .* the tree spells only"),
    ("radix_evict_leaf", _evict_keeps_key, "after evict_leaf the leaf holds .* tokens"),
    ("radix_evict_leaf", lambda leaf, n, bs, unused: [], "evict_leaf.* returned \\[\\]; the unused tail"),
])
def test_a_broken_radix_function_stops_the_engine_with_the_reason(seam, fn, message):
    llm = LLM("tiny-random", prefix_caching="radix", **{seam: fn}, **PAGED)
    with pytest.raises(ValueError, match=message):
        _run(llm)


def test_the_free_block_queue_seam_is_called_and_gives_the_hash_chains_tokens_hits_and_evictions():
    made = []

    class Counted(FreeBlockQueue):
        def __init__(self):
            super().__init__()
            made.append(self)

    mine = LLM("tiny-random", prefix_caching="hash", free_block_queue=Counted, **PAGED)
    ref = mine.derive(free_block_queue=None)
    assert _run(mine) == _run(ref)
    assert len(made) == 1 and mine.prefix_cache.stats()["evicted_blocks"] == ref.prefix_cache.stats()[
        "evicted_blocks"] > 0
    assert mine.prefix_cache.free_queue.queue is made[0]  # the engine keeps its blocks in the learner's queue


def test_a_queue_whose_popleft_returns_a_block_it_never_held_is_stopped_with_the_reason():
    class Wrong(FreeBlockQueue):
        def popleft(self):
            super().popleft()
            return -1

    llm = LLM("tiny-random", prefix_caching="hash", free_block_queue=Wrong, **PAGED)
    with pytest.raises(ValueError, match="popleft\\(\\) returned -1, which is not a queued block"):
        _run(llm)


@pytest.mark.parametrize("options, message", [
    (dict(prefix_caching="hash", radix_insert=insert), "radix_insert plugs into rung 6; .* prefix_caching='radix'"),
    (dict(prefix_caching=None, radix_evict_leaf=evict_leaf), "radix_evict_leaf plugs into rung 6"),
    (dict(prefix_caching="radix", free_block_queue=FreeBlockQueue),
     "free_block_queue plugs into rung 6; .* prefix_caching='hash', eviction='lru'"),
    (dict(prefix_caching="hash", eviction="fifo", free_block_queue=FreeBlockQueue), "eviction='lru'"),
    (dict(prefix_caching="hash", free_block_queue="FreeBlockQueue"), "free_block_queue must be a class"),
])
def test_a_prefix_cache_seam_is_refused_where_nothing_would_call_it(options, message):
    with pytest.raises(ValueError, match=message):
        LLM("tiny-random", **PAGED, **options)


def test_make_prefix_cache_refuses_a_seam_its_design_does_not_take():
    with pytest.raises(ValueError, match="radix_insert plugs into the 'radix' prefix cache"):
        make_prefix_cache("hash", 4, radix_insert=insert)
    assert make_prefix_cache("radix", 4, radix_insert=insert).insert_fn is insert
    assert make_prefix_cache("hash", 4, free_block_queue=None).free_queue_cls is None  # None: the cache's own


# ---- the static batcher's padded_mask -----------------------------------------------------------
def test_the_padded_mask_seam_changes_what_the_batcher_attends_to():
    llm = LLM("tiny-random", kv_backend="contiguous", max_num_seqs=1, max_model_len=64)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    own = [o.token_ids for o in StaticBatcher(llm, 3).generate(PROMPTS, params)]
    assert [o.token_ids for o in StaticBatcher(llm, 3, padded_mask=mask).generate(PROMPTS, params)] == own

    def pads_visible(pad_lens, q_cols, L):
        return torch.arange(L)[None, None, :] <= q_cols[:, :, None]

    leaky = [o.token_ids for o in StaticBatcher(llm, 3, padded_mask=pads_visible).generate(PROMPTS, params)]
    assert leaky[1] == own[1] and leaky != own  # the longest prompt has no pads; the padded ones change


@pytest.mark.parametrize("fn, message", [
    (lambda p, q, L: mask(p, q, L).int(), "padded_mask returned torch.int32 .* expected a bool tensor"),
    (lambda p, q, L: mask(p, q, L)[:, 0], "expected a bool tensor of shape"),
    (lambda p, q, L: None, "padded_mask returned NoneType"),
])
def test_a_wrong_padded_mask_stops_the_batcher_with_the_reason(fn, message):
    llm = LLM("tiny-random", kv_backend="contiguous", max_num_seqs=1, max_model_len=64)
    with pytest.raises(ValueError, match=message):
        StaticBatcher(llm, 3, padded_mask=fn).generate(PROMPTS, SamplingParams(max_tokens=2))


def test_the_padded_mask_seam_must_be_a_function_and_belongs_to_the_batcher_not_the_llm():
    llm = LLM("tiny-random", kv_backend="contiguous", max_num_seqs=1, max_model_len=64)
    with pytest.raises(ValueError, match="padded_mask must be a function \\(the rung 3 seam\\)"):
        StaticBatcher(llm, 3, padded_mask="mask")
    with pytest.raises(ValueError, match="unknown option 'padded_mask'"):
        LLM("tiny-random", kv_backend="contiguous", padded_mask=mask)
