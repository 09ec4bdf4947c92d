"""Exercise 06c's checker (radix insert, split, evict_leaf) passes the reference answers, catches the
mistakes learners make and names them, and the engine runs on the learner's tree surgery with the
RadixCache's own tokens, hits and invariants (tiny-random here; the notebook runs SmolLM2)."""
from __future__ import annotations

import pytest

from minikv.cache.prefix.radix import Node
from minikv.checks.radix import (
    check_evict_leaf,
    check_radix_insert,
    check_split,
    reference_split,
)


def split(node, k, block_size):
    return reference_split(node, k, block_size)


def insert(root, token_ids, blocks, block_size, extend=True, split_fn=split):
    node, i, n = root, 0, len(blocks)
    while i < n:
        child = node.children.get(tuple(token_ids[i * block_size:(i + 1) * block_size]))
        if child is None:
            key, rest = tuple(token_ids[i * block_size:]), list(blocks[i:])
            if extend and node is not root and not node.children:
                node.key, node.blocks = node.key + key, node.blocks + rest
            else:
                node.children[key[:block_size]] = Node(key, rest, node)
            return
        k = 0
        while k < len(child.blocks) and i + k < n and \
                child.key[k * block_size:(k + 1) * block_size] == tuple(token_ids[(i + k) * block_size:
                                                                                  (i + k + 1) * block_size]):
            k += 1
        i += k
        if k < len(child.blocks):
            if i == n:
                return
            child = split_fn(child, k, block_size)
        node = child


def evict_leaf(leaf, num_blocks, block_size, is_unused):
    out = []
    while len(out) < num_blocks and leaf.blocks and is_unused(leaf.blocks[-1]):
        out.append(leaf.blocks.pop())
        leaf.key = leaf.key[:len(leaf.key) - block_size]
    if not leaf.blocks:
        del leaf.parent.children[next(k for k, c in leaf.parent.children.items() if c is leaf)]
    return out


def split_returns_lower(node, k, block_size):
    reference_split(node, k, block_size)
    return node


def split_refiles_nothing(node, k, block_size):
    cut = k * block_size
    upper = Node(node.key[:cut], node.blocks[:k], node.parent)
    node.key, node.blocks, node.parent = node.key[cut:], node.blocks[k:], upper
    upper.children[node.key[:block_size]] = node
    return upper  # the parent still points at the old node


def split_upper_reuses_node(node, k, block_size):
    cut = k * block_size
    lower = Node(node.key[cut:], node.blocks[k:], node)
    lower.children, node.children = node.children, {lower.key[:block_size]: lower}
    node.key, node.blocks = node.key[:cut], node.blocks[:k]
    return node


def evict_head_first(leaf, num_blocks, block_size, is_unused):
    out = []
    while len(out) < num_blocks and leaf.blocks and is_unused(leaf.blocks[0]):
        out.append(leaf.blocks.pop(0))
        leaf.key = leaf.key[block_size:]
    if not leaf.blocks:
        del leaf.parent.children[next(k for k, c in leaf.parent.children.items() if c is leaf)]
    return out


def evict_keeps_key(leaf, num_blocks, block_size, is_unused):
    out = []
    while len(out) < num_blocks and leaf.blocks and is_unused(leaf.blocks[-1]):
        out.append(leaf.blocks.pop())
    if not leaf.blocks:
        del leaf.parent.children[next(k for k, c in leaf.parent.children.items() if c is leaf)]
    return out


def evict_never_unlinks(leaf, num_blocks, block_size, is_unused):
    out = []
    while len(out) < num_blocks and leaf.blocks and is_unused(leaf.blocks[-1]):
        out.append(leaf.blocks.pop())
        leaf.key = leaf.key[:len(leaf.key) - block_size]
    return out


def test_task_06c_reference_answers_pass(capsys):
    check_split(split)
    check_evict_leaf(evict_leaf)
    check_radix_insert(insert, split, num_random=100)
    out = capsys.readouterr().out
    assert out.count("cases passed") == 3


@pytest.mark.parametrize("bug, words", [
    (split_returns_lower, "returned the node it was given"),
    (split_refiles_nothing, "tree after the split differs|link is wrong"),
    (split_upper_reuses_node, "not the lower part|returned the node it was given"),
    (lambda node, k, bs: None, "return"),
])
def test_task_06c_split_bugs_are_caught(bug, words):
    with pytest.raises(AssertionError, match=words):
        check_split(bug)


@pytest.mark.parametrize("bug, words", [
    (lambda root, t, b, bs: insert(root, t, b, bs, extend=False), "childless leaf .* is EXTENDED"),
    (lambda root, t, b, bs: insert(root, t, b, bs, split_fn=split_refiles_nothing), "tree differs|link"),
    (lambda root, t, b, bs: None, "tree differs"),
])
def test_task_06c_insert_bugs_are_caught(bug, words):
    with pytest.raises(AssertionError, match=words):
        check_radix_insert(bug, split, num_random=50)


@pytest.mark.parametrize("bug, words", [
    (evict_head_first, "from the tail"),
    (evict_keeps_key, "tree after the eviction differs|a key of"),
    (evict_never_unlinks, "tree after the eviction differs|no blocks"),
    (lambda leaf, n, bs, unused: [b for b in reversed(leaf.blocks)][:n], "tree after the eviction differs"),
])
def test_task_06c_evict_leaf_bugs_are_caught(bug, words):
    with pytest.raises(AssertionError, match=words):
        check_evict_leaf(bug)


def _run_tiny(insert_fn, evict_fn):
    """A tiny-random engine on a 10-block pool, with the learner's radix functions: three prompts that
    share a prefix (an extension, a split), then one that needs evictions."""
    from minikv import LLM, SamplingParams

    prompts = [list(range(3, 19)), list(range(3, 19)) + [40, 41, 42, 43, 44], list(range(3, 11)) + [50] * 9,
               list(range(100, 130))]
    llms = [LLM("tiny-random", kv_backend="paged", block_size=4, num_blocks=12, max_model_len=48,
                prefix_caching="radix", **seams)
            for seams in ({"radix_insert": insert_fn, "radix_evict_leaf": evict_fn}, {})]
    results = []
    for llm in llms:
        outs = []
        for p in prompts:
            o = llm.generate(p, SamplingParams(max_tokens=6, ignore_eos=True))[0]
            llm.block_manager.check(llm.scheduler.all_sequences())
            outs.append((o.token_ids, o.num_cached_tokens))
        results.append((outs, llm.prefix_cache.stats()))
    return results


def test_task_06c_engine_on_the_learners_tree_equals_the_radix_cache():
    (mine, stats), (ref, ref_stats) = _run_tiny(insert, evict_leaf)
    assert mine == ref
    assert stats["evicted_blocks"] == ref_stats["evicted_blocks"] > 0
    assert sum(hit for _, hit in mine) > 0


def test_task_06c_engine_stops_on_a_broken_eviction_with_the_reason():
    with pytest.raises(Exception, match="evict_leaf"):
        _run_tiny(insert, evict_keeps_key)


def test_task_06c_after_a_fault_the_rebuilt_cache_still_runs_the_learners_functions():
    from minikv import LLM, SamplingParams

    calls = []

    def stopped_once(root, token_ids, blocks, block_size):  # the learner presses stop mid-step, once
        calls.append(len(token_ids))
        if len(calls) == 1:
            raise KeyboardInterrupt
        insert(root, token_ids, blocks, block_size)

    llm = LLM("tiny-random", kv_backend="paged", block_size=4, num_blocks=12, max_model_len=48,
              prefix_caching="radix", radix_insert=stopped_once, radix_evict_leaf=evict_leaf)
    params, first = SamplingParams(max_tokens=4, ignore_eos=True), llm.prefix_cache
    with pytest.raises(KeyboardInterrupt):
        llm.generate(list(range(3, 19)), params)
    again = llm.generate(list(range(3, 19)), params)[0]
    assert llm.prefix_cache is not first and llm.prefix_cache.insert_fn is stopped_once
    assert len(calls) > 1 and again.num_cached_tokens == 0
    assert llm.generate(list(range(3, 19)), params)[0].num_cached_tokens == 12  # the learner's tree hits
