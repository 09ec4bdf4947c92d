"""Checker for exercise 06c: the radix tree's insert, split and eviction of a leaf.

    split(node, k, block_size) -> upper           cut node's edge after its first k blocks
    insert(root, token_ids, blocks, block_size)   make the path from root spell token_ids (whole blocks)
    evict_leaf(leaf, num_blocks, block_size, is_unused)   trim unused blocks off a leaf's tail -> [blocks]

    before split(node, 1):                after:
    parent ── node [A B C] {children}      parent ── upper [A]  ── node [B C] {children}

Three stages, each stopping at the first problem with a message that says where:
  1. split and evict_leaf on hand-picked nodes: keys, blocks, parent links and children filing
  2. insert: hand-picked sequences of requests (each teaches one rule), then random ones, each tree
     compared with the one the engine's own RadixCache builds from the same requests
  3. (check_radix_insert_in_engine) SmolLM2 with your functions in the engine's seams,
     `LLM(..., prefix_caching="radix", radix_insert=insert, radix_evict_leaf=evict_leaf)` (they do every
     change of the tree), against the engine's RadixCache: same tokens, same cache hits, a small pool
     so that leaves are evicted, and the cache's invariants after every request. The check builds that
     engine itself each time it runs, so it always runs the functions defined last
"""
from __future__ import annotations

import random
from typing import Callable

from minikv.cache.prefix.radix import Node, RadixCache, match_prefix, tree_fault
from minikv.checks.prefix import _Seq
from minikv.checks.report import fail, passed

# ---- reading trees ---------------------------------------------------------------------------------

def shape(node: Node) -> tuple:
    """A tree as nested tuples: (key, blocks, children sorted by their filing key)."""
    return (tuple(node.key), tuple(node.blocks),
            tuple(shape(c) for _, c in sorted(node.children.items(), key=lambda kv: kv[0])))


def tree_lines(root: Node) -> list[str]:
    lines: list[str] = []

    def walk(node: Node, depth: int) -> None:
        for _, c in sorted(node.children.items(), key=lambda kv: kv[0]):
            lines.append("    " + "  " * depth + f"[{' '.join(map(str, c.key))}] blocks {list(c.blocks)}")
            walk(c, depth + 1)

    walk(root, 0)
    return lines or ["    (empty)"]


# ---- references (the tree surgery of minikv/cache/prefix/radix.py, on bare nodes) -------------------------

def reference_split(node: Node, k: int, block_size: int) -> Node:
    cut = k * block_size
    upper = Node(tuple(node.key[:cut]), list(node.blocks[:k]), node.parent)
    node.parent.children[tuple(node.key[:block_size])] = upper
    node.key, node.blocks, node.parent = tuple(node.key[cut:]), list(node.blocks[k:]), upper
    upper.children[tuple(node.key[:block_size])] = node
    return upper


def reference_evict_leaf(leaf: Node, num_blocks: int, block_size: int, is_unused: Callable[[int], bool]) -> list[int]:
    out = []
    while len(out) < num_blocks and leaf.blocks and is_unused(leaf.blocks[-1]):
        out.append(leaf.blocks.pop())
        leaf.key = tuple(leaf.key[:len(leaf.blocks) * block_size])
    if not leaf.blocks:
        del leaf.parent.children[next(k for k, c in leaf.parent.children.items() if c is leaf)]
    return out


def _chain(block_size: int, *runs: tuple[list[int], list[int]]) -> tuple[Node, list[Node]]:
    """root -> n1 -> n2 ..., run i = (tokens, blocks)."""
    root, nodes, parent = Node(), [], None
    parent = root
    for toks, blocks in runs:
        n = Node(tuple(toks), list(blocks), parent)
        parent.children[tuple(toks[:block_size])] = n
        nodes.append(n)
        parent = n
    return root, nodes


# ---- stage 1: split and evict_leaf -----------------------------------------------------------------

def check_split(split) -> None:
    cases = [
        ("split after 1 of 3 blocks", 1), ("split after 2 of 3 blocks", 2),
    ]
    for lesson, k in cases:
        for with_children in (False, True):
            bs = 2
            root, (top, node) = _chain(bs, ([9, 9], [5]), ([1, 1, 2, 2, 3, 3], [7, 8, 4]))
            kids = {}
            if with_children:
                for first in ((4, 4), (6, 6)):
                    kids[first] = Node(first, [10 + first[0]], node)
                node.children.update(kids)
            case = (f"split(node, k={k}, block_size={bs}) on node [1 1 2 2 3 3] blocks [7, 8, 4] under [9 9]"
                    + (", node has two children" if with_children else "") + f" ({lesson})")
            try:
                upper = split(node, k, bs)
            except NotImplementedError:
                raise
            except Exception as e:  # noqa: BLE001  shown to the learner
                fail(case, "split raised", f"{type(e).__name__}: {e}")
            ref_root, (_, ref_node) = _chain(bs, ([9, 9], [5]), ([1, 1, 2, 2, 3, 3], [7, 8, 4]))
            if with_children:
                ref_node.children.update({f: Node(f, [10 + f[0]], ref_node) for f in kids})
            ref_upper = reference_split(ref_node, k, bs)
            if upper is None or not isinstance(upper, Node):
                fail(case, f"split returned {upper!r}", "expected the new upper Node", "did it forget to `return`?")
            if upper is node:
                fail(case, "split returned the node it was given", "expected the NEW upper node",
                     "the node you were given stays the lower part: the engine holds references to it (its blocks, "
                     "the eviction queue), and its children stay with it")
            if shape(root) != shape(ref_root):
                fail(case, "the tree after the split differs", "expected:\n" + "\n".join(tree_lines(ref_root))
                     + "\ngot:\n" + "\n".join(tree_lines(root)),
                     "upper takes the first k blocks and the first k * block_size tokens; node keeps the rest and "
                     "its children")
            broken = tree_fault(root, bs)
            if broken:
                fail(case, "a link is wrong after the split", broken,
                     "parent.children[first block] -> upper, upper.parent = parent, upper.children[node's new first "
                     "block] -> node, node.parent = upper")
            if node.parent is not upper or shape(upper) != shape(ref_upper):
                fail(case, "the node you were given is not the lower part under the upper node you returned",
                     f"upper: {upper}, node: {node}")
    passed(2 * len(cases), "split cuts an edge at a block boundary, keeps the node below and its children, and "
                           "files both parts by their first block")


def check_evict_leaf(evict_leaf) -> None:
    bs = 2
    cases = [  # (lesson, used blocks, num_blocks, expected blocks)
        ("every block unused, ask for 1: only the tail block goes", set(), 1, [4]),
        ("every block unused, ask for more than the leaf holds: the whole leaf goes, and leaves the tree",
         set(), 5, [4, 8, 7]),
        ("the leaf's first block is in use: the tail goes, the used block stays", {7}, 5, [4, 8]),
        ("ask for exactly 2: the last two, tail first", set(), 2, [4, 8]),
    ]
    for lesson, used, n, want in cases:
        root, (top, leaf) = _chain(bs, ([9, 9], [5]), ([1, 1, 2, 2, 3, 3], [7, 8, 4]))
        ref_root, (_, ref_leaf) = _chain(bs, ([9, 9], [5]), ([1, 1, 2, 2, 3, 3], [7, 8, 4]))
        is_unused = lambda b, used=used: b not in used  # noqa: E731
        case = (f"case: {lesson}\n  evict_leaf(leaf [1 1 2 2 3 3] blocks [7, 8, 4], num_blocks={n}, block_size={bs}, "
                f"is_unused) with blocks {sorted(used) or 'none'} in use")
        try:
            got = evict_leaf(leaf, n, bs, is_unused)
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001  shown to the learner
            fail(case, "evict_leaf raised", f"{type(e).__name__}: {e}")
        reference_evict_leaf(ref_leaf, n, bs, is_unused)
        if got is None:
            fail(case, "it returned None", f"expected the evicted blocks {want}", "did it forget to `return`?")
        if list(got) != want:
            got = list(got)
            hint = ("tail first: the last block of the leaf goes first" if sorted(got) == sorted(want) else
                    "blocks go from the tail (leaf.blocks[-1] first), never from the head: what stays must still be "
                    "spelled from the root, so only the end of a leaf can go" if len(got) == len(want) else
                    "only an unused block may go, from the tail, and no more than num_blocks"
                    if len(got) > len(want) else
                    "keep going while fewer than num_blocks went and the last block is unused")
            fail(case, f"it returned {list(got)}", f"expected {want}", hint)
        if shape(root) != shape(ref_root):
            fail(case, "the tree after the eviction differs", "expected:\n" + "\n".join(tree_lines(ref_root))
                 + "\ngot:\n" + "\n".join(tree_lines(root)),
                 "drop block_size tokens of the key with each block; a leaf left without blocks is deleted from "
                 "its parent's children")
        broken = tree_fault(root, bs)
        if broken:
            fail(case, "a link is wrong after the eviction", broken)
    passed(len(cases), "evict_leaf trims unused blocks from the tail, shrinks the key with them, and removes an "
                       "emptied leaf")


# ---- stage 2: insert --------------------------------------------------------------------------------

def _reference_tree(requests: list[list[int]], block_size: int) -> tuple[RadixCache, list[list[int]]]:
    """The engine's RadixCache after each request, and the blocks each request was inserted with."""
    cache = RadixCache(block_size)
    cache.bind([1] * 100_000)
    next_block, used = 0, []
    for toks in requests:
        have = match_prefix(cache.roots[None], toks, block_size)[0] if None in cache.roots else []
        blocks = have + list(range(next_block, next_block + len(toks) // block_size - len(have)))
        next_block += len(blocks) - len(have)
        cache.insert(_Seq(toks, blocks))
        used.append(blocks)
    return cache, used


S = [7, 7, 7, 7, 7, 7]
INSERT_CASES = [  # (lesson, requests, block_size)
    ("one request into an empty tree: one child of the root", [S + [1, 1]], 2),
    ("the same request twice: nothing changes", [S + [1, 1], S + [1, 1]], 2),
    ("a chat's next turn: the childless leaf is extended, not given a child", [S + [1, 1], S + [1, 1, 2, 2, 3, 3]], 2),
    ("diverges inside an edge: split the edge there, hang the rest as a sibling",
     [S + [1, 1], S[:2] + [5, 5, 6, 6]], 2),
    ("diverges at the end of an edge that has children: a new child, no split",
     [S + [1, 1], S + [2, 2], S + [3, 3]], 2),
    ("ends inside an edge: nothing to add, so no split", [S + [1, 1], S[:4]], 2),
    ("a second branch under the root", [S + [1, 1], [5, 5, 5, 5]], 2),
    ("a split, then a request that extends the lower part's leaf",
     [S + [1, 1], S[:2] + [5, 5], S + [1, 1, 4, 4]], 2),
    ("block_size 1: every token is a block", [[1, 2, 3], [1, 2, 4], [1, 5]], 1),
    ("block_size 4: the split falls on a block boundary", [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9]], 4),
]


def _random_requests(rng: random.Random) -> tuple[list[list[int]], int]:
    bs = rng.choice([1, 2, 4])
    stems = [[rng.randrange(3) for _ in range(rng.randint(0, 4) * bs)] for _ in range(3)]
    reqs = []
    for _ in range(rng.randint(1, 6)):
        base = rng.choice(stems + [r for r in reqs])
        keep = rng.randint(0, len(base) // bs) * bs
        reqs.append(base[:keep] + [rng.randrange(3) for _ in range(rng.randint(0, 4) * bs)])
    return [r for r in reqs if r] or [[0] * bs], bs


def _insert_hint(mine: Node, ref: Node, bs: int) -> str | None:
    broken = tree_fault(mine, bs)
    if broken:
        return broken
    nodes_mine, nodes_ref = _count(mine), _count(ref)
    if nodes_mine > nodes_ref:
        return ("your tree has more nodes than the engine's: a childless leaf (not the root) is EXTENDED when the "
                "tokens go on past it, and an edge is split only where a new branch leaves it")
    if nodes_mine < nodes_ref:
        return ("your tree has fewer nodes than the engine's: where the tokens leave an edge part-way, split it "
                "(the old rest and the new tokens become two children of the upper part)")
    return None


def _count(node: Node) -> int:
    return len(node.children) + sum(_count(c) for c in node.children.values())


def check_radix_insert(insert, split, num_random: int = 300, seed: int = 0) -> None:
    """insert against the engine's RadixCache.insert on taught and random request sequences.
    `split` is the learner's (insert may call it); it is checked first."""
    rng = random.Random(seed)
    cases = list(INSERT_CASES) + [("random", *_random_requests(rng)) for _ in range(num_random)]
    for n, (lesson, requests, bs) in enumerate(cases):
        ref, blocks_of = _reference_tree(requests, bs)
        root = Node()
        for j, (toks, blocks) in enumerate(zip(requests, blocks_of)):
            toks = toks[:len(toks) // bs * bs]
            done = "\n".join(f"    insert(root, {r[:len(r) // bs * bs]}, {b}, {bs})"
                             for r, b in zip(requests[:j], blocks_of[:j])) or "    (nothing)"
            case = (f"case {n}: {lesson}\n  after\n{done}\n  the call insert(root, {toks}, {blocks}, "
                    f"block_size={bs})")
            try:
                insert(root, list(toks), list(blocks), bs)
            except NotImplementedError:
                raise
            except Exception as e:  # noqa: BLE001  shown to the learner
                fail(case, "insert raised", f"{type(e).__name__}: {e}")
            want = _reference_tree(requests[:j + 1], bs)[0].roots.get(None) or Node()
            if shape(root) != shape(want):
                fail(case, "the tree differs from the engine's", "expected:\n" + "\n".join(tree_lines(want))
                     + "\ngot:\n" + "\n".join(tree_lines(root)), _insert_hint(root, want, bs))
            broken = tree_fault(root, bs)
            if broken:
                fail(case, "a link of the tree is wrong", broken)
            if match_prefix(root, toks, bs) != (list(blocks), len(toks)):
                fail(case, "the tree does not spell the request", f"match_prefix finds {match_prefix(root, toks, bs)}")
    passed(len(cases), "insert builds the engine's tree: walks, splits inside an edge, extends a childless leaf, "
                       "hangs a new child otherwise")


# ---- stage 3: the engine, your functions doing every change of the tree ---------------------------

def chat_then_evict(engine, system: str, questions: list[str], long_prompt: str, max_tokens: int,
                    learner: bool) -> list[tuple[str, list[int], int]]:
    """The requests of the in-engine prefix checks, one after another: a chat of len(questions) turns
    after `system` (each turn's prompt is the whole conversation so far), the later questions asked
    fresh (they leave the chat's path after the system prompt), then `long_prompt`, which needs more
    blocks than are empty, and the first question once more (it hits what eviction kept). Returns
    (what, tokens, num_cached_tokens) per request; on the learner's
    engine an error or a broken invariant fails with the request's name."""
    from minikv import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens)
    encode = lambda text: engine.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    results: list[tuple[str, list[int], int]] = []

    def run(what: str, ids: list[int]):
        try:
            out = engine.generate(ids, sp)[0]
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001  shown to the learner
            if not learner:
                raise
            fail(what, f"the engine on your functions raised {type(e).__name__}", str(e))
        if learner:
            try:
                engine.view.check()
            except AssertionError as e:
                fail(what, "the cache's invariants broke after this request", str(e))
        results.append((what, out.token_ids, out.num_cached_tokens))
        return out

    history: list[int] = []
    for n, q in enumerate(questions):
        ids = encode(engine.chat_prompt(q, system=system)) if not history else history + encode(
            ("" if history[-1] in engine.eos_token_ids else "<|im_end|>")
            + f"\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n")
        history = ids + run(f"chat turn {n + 1}: {q!r}", ids).token_ids
    for q in questions[1:]:
        run(f"a fresh request: {q!r}", encode(engine.chat_prompt(q, system=system)))
    run("a long request (more blocks than are empty: cached blocks are evicted)",
        encode(engine.chat_prompt(long_prompt, system=system)))
    run(f"after the evictions, the first question again, fresh: {questions[0]!r}",
        encode(engine.chat_prompt(questions[0], system=system)))
    return results


def check_radix_insert_in_engine(llm, insert, evict_leaf, system: str, questions: list[str],
                                 long_prompt: str, max_tokens: int = 6) -> dict:
    """Your functions change the tree: `llm.derive(prefix_caching="radix", radix_insert=insert,
    radix_evict_leaf=evict_leaf)`, built here from `llm`'s weights and small pool each time the check
    runs (so a fixed function is checked without rebuilding anything; insert calls the split defined
    last). A chat of len(questions) turns after `system`, the same questions asked fresh (the tree
    splits where they leave the chat), then `long_prompt`, which needs more blocks than are empty
    (leaves are evicted). Each answer and each request's cache hit must equal those of the engine's
    RadixCache (`llm.derive(prefix_caching="radix")`, the same weights), and the cache's invariants
    must hold after every request."""
    if llm.block_size is None:
        raise ValueError("build the LLM with kv_backend='paged': the radix tree keeps whole blocks")
    base = llm
    llm = base.derive(prefix_caching="radix", radix_insert=insert, radix_evict_leaf=evict_leaf)
    mine = chat_then_evict(llm, system, questions, long_prompt, max_tokens, learner=True)
    stats, kept = llm.prefix_cache.stats(), sorted(llm.prefix_cache.cached_blocks())
    ref_engine = base.derive(prefix_caching="radix", radix_insert=None, radix_evict_leaf=None)
    ref = chat_then_evict(ref_engine, system, questions, long_prompt, max_tokens, learner=False)
    for (what, toks, hit), (_, want_toks, want_hit) in zip(mine, ref):
        if toks != want_toks:
            fail(what, "its tokens differ from the engine's RadixCache", f"expected {want_toks}\ngot      {toks}",
                 "a lookup found blocks that hold another prefix: check split's keys and blocks")
        if hit != want_hit:
            fail(what, f"{hit} tokens came from the cache; with the engine's RadixCache {want_hit}",
                 "the same requests on the same pool must hit the same blocks",
                 "a missing extension or split loses the tokens after it; a leaf trimmed too far loses more")
    if stats["evicted_blocks"] == 0:
        fail("the whole run", "no block was evicted", "the long request should have evicted cached leaves",
             "build the LLM with a smaller num_blocks")
    if kept != sorted(ref_engine.prefix_cache.cached_blocks()):
        fail("the whole run", f"the cache ends holding blocks {kept}",
             f"the engine's RadixCache ends holding {sorted(ref_engine.prefix_cache.cached_blocks())}",
             "evict_leaf must give back exactly the unused tail it is asked for")
    passed(len(mine), f"with your insert, split and evict_leaf the engine gives the RadixCache's tokens and hits "
                      f"({sum(h for _, _, h in mine)} cached tokens, {stats['evicted_blocks']} blocks evicted)")
    return stats
