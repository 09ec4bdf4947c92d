"""Drill: a radix tree for prefix caching: match, split, insert, evict (45 minutes).

Nodes are minikv.cache.prefix.radix.Node: node.key (a tuple of token ids on the edge into it), node.blocks
(one KV block id per block_size tokens of the key: len(key) == len(blocks) * block_size),
node.children (a dict: the first block_size tokens of a child's key, as a tuple -> the child) and
node.parent. The root has an empty key. Everything works in whole blocks.

1. match_prefix(root, token_ids, block_size) -> (blocks, num_tokens)
       the longest prefix of token_ids spelled by a path from root, whole blocks only; an edge may
       match part-way (block by block)
2. split(node, k, block_size) -> upper
       cut node's edge after its first k blocks: a new node `upper` takes them and sits between
       node's parent and node; each is filed in its parent's children under its own first block
3. insert(root, token_ids, blocks, block_size)
       make the path from root spell token_ids (len(token_ids) == len(blocks) * block_size), reusing
       what is there, splitting an edge where the tokens leave it, extending a childless leaf
       (not the root) instead of giving it a child
4. evict_leaf(leaf, num_blocks, block_size, is_unused) -> [blocks]
       take up to num_blocks blocks off the tail of a leaf while is_unused(block); trim its key; a
       leaf left without blocks leaves its parent's children. Return them, tail first.

Write the code here: importing minikv's own radix functions fails the check (Node is allowed).
Check it with: minikv drill check radix-tree
"""
from minikv.cache.prefix.radix import Node  # noqa: F401


def match_prefix(root, token_ids: list[int], block_size: int) -> tuple[list[int], int]:
    raise NotImplementedError("write match_prefix")


def split(node, k: int, block_size: int):
    raise NotImplementedError("write split")


def insert(root, token_ids: list[int], blocks: list[int], block_size: int) -> None:
    raise NotImplementedError("write insert")


def evict_leaf(leaf, num_blocks: int, block_size: int, is_unused) -> list[int]:
    raise NotImplementedError("write evict_leaf")
