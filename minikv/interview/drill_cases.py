"""Hidden cases the drills add to the course's checkers, where a drill could otherwise be gamed.

- gqa-attention, kv-decode-step: the scale varies (0.02 to 2, never only 1/sqrt(head_dim)): models pass
  other scales (Gemma 2's query_pre_attn_scalar, MLA's softmax_scale with a YaRN factor), so an
  answer that ignores its `scale` argument fails.
- radix-tree: evict_leaf on random leaves with random blocks in use (a used block stops the
  eviction: skipping it would cut the edge in the middle); the first insert into an empty tree
  leaves the root's own key empty; match_prefix and insert find a child by its first block, a dict
  lookup, never by scanning the children (counted, not timed).
- lru-block-budget: popleft is O(1): the time per popleft does not grow with the queue (a dict's
  `next(iter(d))` after many deletions from the front is the classic trap).

Each raises CheckFailed (minikv.checks.report.fail) with the case and what to change.
"""
from __future__ import annotations

import random
import time
from typing import Callable

from minikv.checks.report import fail


def _scales(rng: random.Random, head_dim: int, n: int) -> list[float]:
    default = head_dim ** -0.5
    out = []
    while len(out) < n:
        s = round(rng.uniform(0.02, 2.0), 3)
        if abs(s - default) > 0.05:
            out.append(s)
    return out


def check_scaled_attention(causal_attention: Callable, seed: int, num_cases: int = 6) -> None:
    import torch

    from minikv.checks.attention import reference_causal_attention

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for scale in _scales(rng, 16, num_cases):
        T, kv, group, d = rng.randint(2, 12), rng.choice([1, 2]), rng.choice([1, 2, 4]), 16
        q = torch.randn(T, kv * group, d, generator=gen)
        k, v = torch.randn(T, kv, d, generator=gen), torch.randn(T, kv, d, generator=gen)
        want = reference_causal_attention(q, k, v, scale)
        got = causal_attention(q.clone(), k.clone(), v.clone(), scale)
        if got is None or tuple(got.shape) != tuple(want.shape) or not torch.allclose(got.float(), want.float(),
                                                                                     atol=1e-4, rtol=1e-3):
            ignored = reference_causal_attention(q, k, v, d ** -0.5)
            hint = ("the output equals attention with 1/sqrt(head_dim): use the `scale` argument, models pass other "
                    "scales" if got is not None and got.shape == ignored.shape and torch.allclose(
                        got.float(), ignored.float(), atol=1e-4, rtol=1e-3) else None)
            fail(f"case: causal_attention with scale={scale} (not 1/sqrt(head_dim)), T={T}, {kv * group} heads "
                 f"over {kv} KV heads, head_dim {d}", "the output differs from the engine's",
                 "scores are q . k * scale with the scale passed in", hint)


def check_scaled_decode(decode_step: Callable, seed: int, num_cases: int = 6) -> None:
    import torch

    from minikv.checks.attention import reference_decode_step

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for scale in _scales(rng, 16, num_cases):
        kv, group, d = rng.choice([1, 2]), rng.choice([1, 2, 4]), 16
        pos, max_len = rng.randint(0, 20), 24
        q = torch.randn(kv * group, d, generator=gen)
        k_new, v_new = torch.randn(kv, d, generator=gen), torch.randn(kv, d, generator=gen)
        k_cache, v_cache = torch.randn(max_len, kv, d, generator=gen), torch.randn(max_len, kv, d, generator=gen)
        want = reference_decode_step(q, k_new, v_new, k_cache.clone(), v_cache.clone(), pos, scale)
        got = decode_step(q.clone(), k_new.clone(), v_new.clone(), k_cache.clone(), v_cache.clone(), pos, scale)
        if got is None or tuple(got.shape) != tuple(want.shape) or not torch.allclose(got.float(), want.float(),
                                                                                     atol=1e-4, rtol=1e-3):
            fail(f"case: decode_step with scale={scale} (not 1/sqrt(head_dim)), pos={pos}, {kv * group} heads over "
                 f"{kv} KV heads", "the output differs from the engine's",
                 "scores are q . k * scale with the scale passed in",
                 "use the `scale` argument: models pass other scales than 1/sqrt(head_dim)")


# ---- radix tree ------------------------------------------------------------------------------------

def check_radix_root(insert: Callable) -> None:
    from minikv.cache.prefix.radix import Node

    root = Node()
    insert(root, [1, 1, 2, 2], [5, 6], 2)
    if root.key or root.blocks or len(root.children) != 1:
        fail("case: insert(root, [1, 1, 2, 2], [5, 6], 2) into an empty tree",
             f"the root holds key {tuple(root.key)} and blocks {root.blocks}, with {len(root.children)} children",
             "expected an empty root with one child holding key (1, 1, 2, 2) and blocks [5, 6]",
             "the root is never extended (its key stays empty): it gets a child; only a childless leaf that is "
             "not the root is extended")
    insert(root, [1, 1, 2, 2, 3, 3], [5, 6, 7], 2)
    child = next(iter(root.children.values()))
    if root.key or len(root.children) != 1 or tuple(child.key) != (1, 1, 2, 2, 3, 3) or child.children:
        fail("case: then insert(root, [1, 1, 2, 2, 3, 3], [5, 6, 7], 2): the tokens go on past a childless leaf",
             f"the root has {len(root.children)} children; its child holds key {tuple(child.key)} with "
             f"{len(child.children)} children",
             "expected the leaf extended to key (1, 1, 2, 2, 3, 3), blocks [5, 6, 7]",
             "a childless leaf (not the root) is extended in place instead of given a child")


def check_radix_evict_random(evict_leaf: Callable, seed: int, num_cases: int = 150) -> None:
    from minikv.cache.prefix.radix import Node
    from minikv.checks.radix import reference_evict_leaf, shape, tree_lines

    rng = random.Random(seed)
    for _ in range(num_cases):
        bs = rng.choice([1, 2, 4])
        n = rng.randint(1, 8)
        blocks = rng.sample(range(10, 99), n)
        key = tuple(rng.randrange(3) for _ in range(n * bs))
        used = {b for b in blocks if rng.random() < 0.3}
        ask = rng.randint(1, n + 2)

        def tree():
            root = Node()
            top = Node((7,) * bs, [1], root)
            root.children[top.key[:bs]] = top
            leaf = Node(key, list(blocks), top)
            top.children[key[:bs]] = leaf
            return root, leaf

        root, leaf = tree()
        ref_root, ref_leaf = tree()
        is_unused = lambda b: b not in used  # noqa: E731
        want = reference_evict_leaf(ref_leaf, ask, bs, is_unused)
        case = (f"case: evict_leaf(leaf with blocks {blocks}, num_blocks={ask}, block_size={bs}, is_unused) with "
                f"blocks {sorted(used) or 'none'} in use")
        got = evict_leaf(leaf, ask, bs, is_unused)
        if got is None or list(got) != want:
            skipped = got is not None and len(list(got)) > len(want) and not any(b in used for b in got)
            fail(case, f"it returned {None if got is None else list(got)}", f"expected {want}",
                 "a used block stops the eviction: blocks go from the tail only, so skipping a used block and "
                 "taking the ones in front of it would cut the edge in the middle (what stays must still be "
                 "spelled from the root)" if skipped else "only unused blocks, from the tail, at most num_blocks")
        if shape(root) != shape(ref_root):
            fail(case, "the tree after the eviction differs", "expected:\n" + "\n".join(tree_lines(ref_root))
                 + "\ngot:\n" + "\n".join(tree_lines(root)))


class _CountingChildren(dict):
    """A node's children that count every scan (iteration) of them; lookups by key are free."""

    scans = 0

    def __iter__(self):
        _CountingChildren.scans += 1
        return super().__iter__()

    def items(self):
        _CountingChildren.scans += 1
        return super().items()

    def values(self):
        _CountingChildren.scans += 1
        return super().values()

    def keys(self):
        _CountingChildren.scans += 1
        return super().keys()


def check_radix_lookup(match_prefix: Callable, insert: Callable, fan_out: int = 300) -> None:
    """A root with `fan_out` children: a match or an insert must look the child up by its first block."""
    from minikv.cache.prefix.radix import Node

    bs = 2
    root = Node()
    root.children = _CountingChildren()
    for i in range(fan_out):
        child = Node((i, i), [1000 + i], root)
        child.children = _CountingChildren()
        root.children[(i, i)] = child
    _CountingChildren.scans = 0
    match_prefix(root, [fan_out - 1, fan_out - 1, 5, 5], bs)
    if _CountingChildren.scans:
        fail(f"case: match_prefix on a root with {fan_out} children",
             "it scanned a node's children one by one (iterated node.children)",
             "with thousands of cached conversations every lookup would pay for all of them",
             "look the child up by its first block: node.children.get(tuple(token_ids[pos:pos + block_size]))")
    _CountingChildren.scans = 0
    insert(root, [fan_out - 2, fan_out - 2, 9, 9], [1000 + fan_out - 2, 77], bs)
    if _CountingChildren.scans:
        fail(f"case: insert on a root with {fan_out} children",
             "it scanned a node's children one by one (iterated node.children)",
             "every insert would pay for all the cached conversations under that node",
             "find the child by its first block (a dict lookup), as match_prefix does")


# ---- LRU queue -------------------------------------------------------------------------------------

def _per_popleft(queue_cls, n: int) -> float:
    best = float("inf")
    for _ in range(3):
        q = queue_cls()
        for b in range(n):
            q.append(b)
        t0 = time.perf_counter()
        for _ in range(n):
            q.popleft()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def check_popleft_timing(queue_cls, small: int = 2_000, large: int = 32_000) -> None:
    """O(1) popleft: emptying a queue 16 times longer costs about 16 times more, not 256."""
    few, many = _per_popleft(queue_cls, small), _per_popleft(queue_cls, large)
    if many > 6 * few + 2e-6:
        fail(f"{large:,} blocks appended, then popped from the front until empty (against {small:,})",
             f"a popleft took {many * 1e6:.2f} us with {large:,} queued, {few * 1e6:.2f} us with {small:,}",
             "popleft slows down as the queue grows: each eviction would pay for the whole pool",
             "keep the front at hand (a head sentinel of a linked list); a dict's next(iter(d)) walks over every "
             "slot deleted before it, and list.pop(0) moves the whole list")
