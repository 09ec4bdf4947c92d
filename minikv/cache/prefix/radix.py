"""The radix tree (SGLang's RadixAttention), one page = one KV block.

Edges hold runs of tokens; the path from the root spells a cached prefix, and each node owns the
blocks of its own run. Runs are whole blocks (the pool is paged), so nodes split at block edges:

    after "S q1 a1" and "S q2":                 after "S q1 a1 q3" (the chat's next turn):
    root                                        root
     └─ [S S S]            blocks 3 8 1          └─ [S S S]
         ├─ [q1 a1 a1]     blocks 4 6 2              ├─ [q1 a1 a1 q3]    a childless leaf grows
         └─ [q2]           block  5                  └─ [q2]

    match   walk from the root, comparing a block of tokens at a time; stop at the first mismatch
    insert  walk the same way; on a partial match SPLIT the node, then hang the rest as a new leaf
    lock    a node is in use while a request holds its blocks (the BlockManager's ref counts); a
            request holds its whole path, so in-use nodes form a subtree around the root
    evict   only leaves whose blocks are all unused: the least recently used leaf first, its tail
            blocks first; a parent whose last child is gone becomes a leaf in turn

Generated tokens are inserted too, so the next turn of a chat hits on the previous answer. Each
`cache_salt` gets its own root, so tenants never share a node.
"""
from __future__ import annotations

from typing import Callable

from minikv.cache.blocks.block_table import CachedRequest, TokenIds
from minikv.cache.prefix.base import EvictionQueue, PrefixCache, PrefixMatch


class Node:
    """One edge of the tree and the node below it. The root has an empty key."""

    def __init__(self, key: tuple = (), blocks: list[int] | None = None, parent: Node | None = None,
                 salt: str | None = None, now: int = 0):
        self.key = key  # token ids on the edge into this node; len(key) == len(blocks) * block_size
        self.blocks = blocks if blocks is not None else []
        self.children: dict[tuple, Node] = {}  # first block of tokens of a child's key -> child
        self.parent = parent
        self.salt = salt
        self.born = now  # FIFO
        self.last_used = now  # LRU

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        return f"Node({len(self.key)} tokens, blocks={self.blocks}, {len(self.children)} children)"


def match_prefix(root: Node, token_ids: TokenIds, block_size: int) -> tuple[list[int], int]:
    """Longest prefix of `token_ids` spelled by a path from `root`, in whole blocks.
    Returns (blocks holding it, number of tokens)."""
    node, blocks, pos = root, [], 0
    while len(token_ids) - pos >= block_size:
        child = node.children.get(tuple(token_ids[pos:pos + block_size]))
        if child is None:
            break
        k = shared_blocks(child.key, token_ids, pos, block_size)
        blocks += child.blocks[:k]
        pos += k * block_size
        if k < len(child.blocks):  # the tokens leave this edge part-way
            break
        node = child
    return blocks, pos


def shared_blocks(key: tuple, token_ids: TokenIds, start: int, block_size: int) -> int:
    """How many whole blocks of `key` equal token_ids[start:], block by block."""
    whole = max(0, min(len(key), len(token_ids) - start)) // block_size * block_size
    if whole and key[:whole] == tuple(token_ids[start:start + whole]):  # the whole edge at once: a hit's usual case
        return whole // block_size
    n = 0
    while (n + 1) * block_size <= len(key) and start + (n + 1) * block_size <= len(token_ids):
        lo = n * block_size
        if key[lo:lo + block_size] != tuple(token_ids[start + lo:start + lo + block_size]):
            break
        n += 1
    return n


def tree_fault(root: Node, block_size: int) -> str | None:
    """The first broken link of a tree: a child filed under the wrong key, a wrong parent, a key that
    does not match its blocks, an empty node; None when the tree is well formed."""
    stack = [root]
    while stack:
        node = stack.pop()
        for first, child in node.children.items():
            where = f"the node [{' '.join(map(str, child.key))}] (blocks {list(child.blocks)})"
            if tuple(first) != tuple(child.key[:block_size]):
                return (f"{where} is filed under {first} in its parent's children; a child is filed under the "
                        f"first block of its key, {tuple(child.key[:block_size])}")
            if child.parent is not node:
                return f"{where}: its .parent is not the node whose children hold it"
            if not child.blocks:
                return f"{where} has no blocks: a node with nothing left is removed from its parent's children"
            if len(child.key) != len(child.blocks) * block_size:
                return (f"{where}: a key of {len(child.key)} tokens for {len(child.blocks)} blocks; "
                        f"len(key) must be len(blocks) * block_size = {len(child.blocks) * block_size}")
            stack.append(child)
    return None


MatchFn = Callable[[Node, TokenIds, int], tuple[list[int], int]]
# insert(root, token_ids, blocks, block_size) -> None: make the path from root spell token_ids (whole blocks)
InsertFn = Callable[[Node, list[int], list[int], int], None]
# evict_leaf(leaf, num_blocks, block_size, is_unused) -> [blocks]: trim unused blocks off a leaf's tail
EvictLeafFn = Callable[[Node, int, int, Callable[[int], bool]], list[int]]


class RadixCache(PrefixCache):
    """match_fn, insert_fn, evict_leaf_fn: a learner's walk (exercise 06b) and tree surgery (exercise
    06c, `LLM(..., radix_insert=fn, radix_evict_leaf=fn)`) in place of the cache's own. The cache keeps
    its books around them (which node owns which block, LRU times, the queue of evictable leaves) and
    checks every tree they leave: a broken one stops the engine with the reason (a ValueError)."""

    design = "radix"

    def __init__(self, block_size: int, eviction: str = "lru", match_fn: MatchFn = match_prefix,
                 insert_fn: InsertFn | None = None, evict_leaf_fn: EvictLeafFn | None = None):
        super().__init__(block_size, eviction)
        self.match_fn = match_fn  # a learner's longest-prefix match plugs in here
        self.insert_fn, self.evict_leaf_fn = insert_fn, evict_leaf_fn  # and a learner's tree surgery here
        self.roots: dict[str | None, Node] = {}  # one tree per cache_salt
        self.node_of: dict[int, Node] = {}  # physical block -> the node that owns it
        self.leaves = EvictionQueue()  # leaves whose tail block is unused, next to evict first
        self._progress: dict[int, int] = {}  # seq_id -> how many of its blocks are in the tree
        self._unused = 0  # unused, unpinned blocks in the tree

    # ---- lookup ---------------------------------------------------------------------------------
    def match(self, token_ids: TokenIds, salt: str | None = None, max_tokens: int | None = None) -> PrefixMatch:
        root = self.roots.get(salt)
        if root is None:
            return PrefixMatch()
        limit = len(token_ids) if max_tokens is None else min(max_tokens, len(token_ids))
        blocks, n = self.match_fn(root, list(token_ids[:limit]), self.block_size)
        return PrefixMatch(list(blocks), n)

    def touch(self, blocks: list[int]) -> None:
        now = self.tick()
        for node in {self.node_of[b] for b in blocks}:
            self._touch(node, now)

    def _touch(self, node: Node, now: int) -> None:
        node.last_used = now
        if node in self.leaves:  # a queued leaf moves back in the LRU order
            self.leaves.push(node, self._priority(node))

    # ---- filling --------------------------------------------------------------------------------
    def insert(self, seq: CachedRequest) -> dict[int, int]:
        if not self.enabled:
            return {}
        bs, n_full = self.block_size, seq.num_computed_tokens // self.block_size
        if n_full <= self._progress.get(seq.seq_id, 0):
            return {}
        if self.insert_fn is not None:
            return self._insert_by_seam(seq, n_full)
        tokens, table, now = seq.token_ids, seq.block_table, self.tick()
        root = self.roots.get(seq.cache_salt)
        if root is None:
            root = self.roots[seq.cache_salt] = Node(salt=seq.cache_salt, now=now)
        node, i, adopt = root, 0, {}
        # [0, i) blocks already on the path; [i, n_full) still to place
        while i < n_full:
            child = node.children.get(tuple(tokens[i * bs:(i + 1) * bs]))
            if child is None:
                self._grow(node, root, tuple(tokens[i * bs:n_full * bs]), table[i:n_full], seq.cache_salt, now)
                break
            k = min(shared_blocks(child.key, tokens, i * bs, bs), n_full - i)
            if child.blocks[:k] != table[i:i + k]:  # (one list comparison: most often the same blocks)
                for j in range(k):
                    if child.blocks[j] != table[i + j]:
                        adopt[i + j] = child.blocks[j]  # computed twice (two requests in flight): keep one copy
            self._touch(child, now)
            i += k
            if k < len(child.blocks) and i < n_full:
                child = self._split(child, k)  # diverges inside this edge: cut it where it does
            node = child
        self._progress[seq.seq_id] = n_full
        return adopt

    def _grow(self, node: Node, root: Node, key: tuple, blocks: list[int], salt, now: int) -> None:
        """Hang new blocks under `node`: extend it when it is a childless leaf, else add a child."""
        if node is not root and node.is_leaf:
            node.key += key
            node.blocks = node.blocks + list(blocks)
            self._touch(node, now)
        else:
            node = Node(key, list(blocks), node, salt, now)
            node.parent.children[key[:self.block_size]] = node
        for b in blocks:
            self.node_of[b] = node
            if self.is_unused(b):  # only happens for a block nobody holds any more
                self._unused += 1
        self._maybe_evictable(node)

    def _split(self, child: Node, k: int) -> Node:
        """Cut `child` after its first k blocks; return the new upper part."""
        cut = k * self.block_size
        upper = Node(child.key[:cut], child.blocks[:k], child.parent, child.salt, child.born)
        upper.last_used = child.last_used
        child.parent.children[child.key[:self.block_size]] = upper
        child.key, child.blocks, child.parent = child.key[cut:], child.blocks[k:], upper
        upper.children[child.key[:self.block_size]] = child
        for b in upper.blocks:
            self.node_of[b] = upper
        return upper

    def _insert_by_seam(self, seq: CachedRequest, n_full: int) -> dict[int, int]:
        """insert_fn changes the tree; the cache touches the nodes the request walks (as its own insert
        does), checks the tree, then files the new blocks and nodes in its books."""
        bs = self.block_size
        tokens, table, now = list(seq.token_ids[:n_full * bs]), seq.block_table, self.tick()
        root = self.roots.get(seq.cache_salt)
        if root is None:
            root = self.roots[seq.cache_salt] = Node(salt=seq.cache_salt, now=now)
        have = match_prefix(root, tokens, bs)[0]
        adopt = {i: b for i, b in enumerate(have) if b != table[i]}  # computed twice: keep the tree's copy
        blocks = have + list(table[len(have):n_full])
        for node in self._walk(root, tokens):
            self._touch(node, now)
        before = set(self.node_of)
        self.insert_fn(root, list(tokens), list(blocks), bs)
        broken = tree_fault(root, bs)
        got = match_prefix(root, tokens, bs)
        if broken or got != (blocks, len(tokens)):
            raise ValueError(f"after your insert of {len(tokens)} tokens in blocks {blocks}: "
                             + (broken or f"the tree spells only {got[1]} of them ({got[0]})"))
        stack = [root]
        while stack:  # file every node under the root: new ones get the salt and the clock
            node = stack.pop()
            stack += node.children.values()
            if node is root:
                continue
            node.salt = root.salt
            if node.born == 0:  # a node the learner made: the cache's clock starts at 1
                node.born = node.last_used = now
            for b in node.blocks:
                self.node_of[b] = node
        for node in self._walk(root, tokens):
            self._touch(node, now)
            self._maybe_evictable(node)
        for b in set(blocks) - before:
            if self.is_unused(b):
                self._unused += 1
        self._progress[seq.seq_id] = n_full
        return adopt

    def _walk(self, root: Node, tokens: list[int]) -> list[Node]:
        """The nodes a walk from root along tokens passes through (the last one may match part-way)."""
        node, pos, out, bs = root, 0, [], self.block_size
        while len(tokens) - pos >= bs:
            child = node.children.get(tuple(tokens[pos:pos + bs]))
            if child is None:
                break
            out.append(child)
            k = shared_blocks(child.key, tokens, pos, bs)
            pos += k * bs
            if k < len(child.blocks):
                break
            node = child
        return out

    def forget(self, seq: CachedRequest) -> None:
        self._progress.pop(seq.seq_id, None)

    # ---- unused blocks --------------------------------------------------------------------------
    def holds(self, block: int) -> bool:
        return block in self.node_of

    def _priority(self, node: Node) -> int:
        return node.last_used if self.eviction == "lru" else node.born

    def _maybe_evictable(self, node: Node) -> None:
        """Queue a leaf whose tail block nobody uses (evict() trims it from the tail)."""
        if node.blocks and node.is_leaf and self.is_unused(node.blocks[-1]):
            self.leaves.push(node, self._priority(node))

    def keep(self, block: int) -> bool:
        node = self.node_of.get(block)
        if node is None:
            return False
        self._touch(node, self.tick())
        if block not in self.pinned:
            self._unused += 1
            self._maybe_evictable(node)
        return True

    def take(self, block: int) -> None:
        if block not in self.pinned:
            self._unused -= 1  # its leaf, if queued, is checked again when popped

    @property
    def num_evictable(self) -> int:
        return self._unused

    def evict(self, num_blocks: int) -> list[int]:
        out: list[int] = []
        while len(out) < num_blocks and len(self.leaves):
            leaf = self.leaves.pop()
            if not leaf.is_leaf or not leaf.blocks or self.node_of.get(leaf.blocks[-1]) is not leaf:
                continue  # queued earlier, since grown children or gone
            if self.evict_leaf_fn is not None:
                out += self._evict_leaf_by_seam(leaf, num_blocks - len(out))
                continue
            while len(out) < num_blocks and leaf.blocks and self.is_unused(leaf.blocks[-1]):
                b = leaf.blocks.pop()
                leaf.key = leaf.key[:-self.block_size]
                del self.node_of[b]
                self._unused -= 1
                out.append(b)
            if not leaf.blocks:
                self._remove(leaf)
            else:
                self._maybe_evictable(leaf)
        self.num_evicted += len(out)
        return out

    def _evict_leaf_by_seam(self, leaf: Node, want: int) -> list[int]:
        """evict_leaf_fn trims the leaf (and unlinks it once empty); the cache checks what it gave back
        against the unused tail, then drops the blocks from its books."""
        parent, before = leaf.parent, list(leaf.blocks)
        expect = []
        for b in reversed(before):
            if len(expect) == want or not self.is_unused(b):
                break
            expect.append(b)
        got = list(self.evict_leaf_fn(leaf, want, self.block_size, self.is_unused) or [])
        if got != expect:
            raise ValueError(f"evict_leaf(leaf with blocks {before}, num_blocks={want}) returned {got}; the "
                             f"unused tail, at most num_blocks, tail first, is {expect}")
        keep = before[:len(before) - len(got)]
        if list(leaf.blocks) != keep or len(leaf.key) != len(leaf.blocks) * self.block_size:
            raise ValueError(f"after evict_leaf the leaf holds blocks {leaf.blocks} and {len(leaf.key)} tokens; "
                             f"expected blocks {keep} and {len(keep) * self.block_size} tokens (each block that "
                             "goes takes block_size tokens off the key)")
        linked = any(c is leaf for c in parent.children.values())
        if linked == (not leaf.blocks):
            raise ValueError("evict_leaf " + ("left an empty leaf in its parent's children" if linked else
                                              "unlinked a leaf that still holds blocks"))
        for b in got:
            del self.node_of[b]
            self._unused -= 1
        if leaf.blocks:
            self._maybe_evictable(leaf)
        elif parent.parent is None:  # a root
            if not parent.children:
                del self.roots[parent.salt]
        else:
            self._maybe_evictable(parent)
        return got

    def _remove(self, leaf: Node) -> None:
        parent = leaf.parent
        del parent.children[next(k for k, c in parent.children.items() if c is leaf)]
        if parent.parent is None:  # a root
            if not parent.children:
                del self.roots[parent.salt]
        else:
            self._maybe_evictable(parent)

    def cached_blocks(self) -> list[int]:
        return list(self.node_of)

    def _on_pin(self, block: int) -> None:
        if self.ref_count[block] == 0:
            self._unused -= 1

    def _on_unpin(self, block: int) -> None:
        if self.ref_count[block] == 0:
            self._unused += 1
            self._maybe_evictable(self.node_of[block])

    def _clear(self) -> None:
        self.roots.clear()
        self.node_of.clear()
        self.leaves = EvictionQueue()
        self._progress.clear()
        self._unused = 0

    def salt_of(self, block: int) -> str | None:
        return self.node_of[block].salt

    # ---- walking --------------------------------------------------------------------------------
    def nodes(self) -> list[tuple[Node, int]]:
        """Every node with its depth, depth first (roots at depth 0)."""
        out, stack = [], [(r, 0) for r in reversed(list(self.roots.values()))]
        while stack:
            node, d = stack.pop()
            out.append((node, d))
            stack += [(c, d + 1) for c in reversed(list(node.children.values()))]
        return out

    def path_blocks(self, token_ids: TokenIds, salt: str | None, num_blocks: int) -> list[int]:
        return self.match(token_ids[:num_blocks * self.block_size], salt).blocks

    # ---- invariants -----------------------------------------------------------------------------
    def check(self, seqs=()) -> None:
        """Tree shape (keys, children, parents, block ownership); in-use and pinned blocks form a
        prefix-closed set; a queued-or-not leaf is evictable exactly when its tail is unused;
        every sequence's first blocks are its own tokens' path."""
        seqs = list(seqs)
        super().check(seqs)
        bs, seen = self.block_size, {}
        for salt, root in self.roots.items():
            if root.key or root.blocks or root.parent is not None or root.salt != salt:
                raise AssertionError(f"root of cache_salt {salt!r} is malformed")
        for node, _ in self.nodes():
            for first, child in node.children.items():
                if child.parent is not node or child.key[:bs] != first or child.salt != node.salt:
                    raise AssertionError(f"{child} is filed wrongly under {node}")
            if node.parent is None:
                continue
            if not node.blocks or len(node.key) != len(node.blocks) * bs:
                raise AssertionError(f"{node}: key of {len(node.key)} tokens for {len(node.blocks)} blocks")
            held = [not self.is_unused(b) for b in node.blocks]
            if any(held[j + 1] and not held[j] for j in range(len(held) - 1)):
                raise AssertionError(f"{node}: a block in use follows an unused one")
            if held[0] and node.parent.parent is not None and self.is_unused(node.parent.blocks[-1]):
                raise AssertionError(f"{node} is in use but its parent {node.parent} is not")
            for b in node.blocks:
                if b in seen or self.node_of.get(b) is not node:
                    raise AssertionError(f"block {b} is owned by more than one node, or misfiled")
                seen[b] = node
            if node in self.leaves and self.leaves.priority(node) != self._priority(node):
                raise AssertionError(f"{node} sits in the eviction queue with a stale time")
            if node.is_leaf and self.is_unused(node.blocks[-1]) and node not in self.leaves:
                raise AssertionError(f"{node} is an evictable leaf but not in the eviction queue: its blocks leak")
        if set(seen) != set(self.node_of):
            raise AssertionError(f"blocks {sorted(set(self.node_of) - set(seen))} are indexed but not in the tree")
        for s in seqs:
            n = self._progress.get(s.seq_id, 0)
            if n and s.block_table[:n] != self.path_blocks(s.token_ids, s.cache_salt, n):
                raise AssertionError(f"request {s.request_id}: its first {n} blocks are not its tokens' path")
