"""Reference for the radix-tree drill."""
from minikv.cache.prefix.radix import Node


def _same_blocks(key, tokens, start, block_size, limit):
    """How many whole blocks of `key` equal tokens[start:], at most `limit`."""
    k = 0
    while k < limit and start + (k + 1) * block_size <= len(tokens) and \
            tuple(key[k * block_size:(k + 1) * block_size]) == tuple(tokens[start + k * block_size:
                                                                             start + (k + 1) * block_size]):
        k += 1
    return k


def match_prefix(root, token_ids, block_size):
    node, blocks, pos = root, [], 0
    while True:
        child = node.children.get(tuple(token_ids[pos:pos + block_size]))
        if child is None or len(token_ids) - pos < block_size:
            return blocks, pos
        k = _same_blocks(child.key, token_ids, pos, block_size, len(child.blocks))
        blocks, pos = blocks + list(child.blocks[:k]), pos + k * block_size
        if k < len(child.blocks):
            return blocks, pos
        node = child


def split(node, k, block_size):
    cut = k * block_size
    parent = node.parent
    upper = Node(tuple(node.key[:cut]), list(node.blocks[:k]), parent)
    parent.children[tuple(node.key[:block_size])] = upper
    node.key, node.blocks, node.parent = tuple(node.key[cut:]), list(node.blocks[k:]), upper
    upper.children[tuple(node.key[:block_size])] = node
    return upper


def insert(root, token_ids, blocks, block_size):
    node, i, n = root, 0, len(blocks)
    while i < n:
        first = tuple(token_ids[i * block_size:(i + 1) * block_size])
        child = node.children.get(first)
        if child is None:
            rest_key, rest_blocks = tuple(token_ids[i * block_size:n * block_size]), list(blocks[i:])
            if node is not root and not node.children:
                node.key, node.blocks = tuple(node.key) + rest_key, list(node.blocks) + rest_blocks
            else:
                node.children[first] = Node(rest_key, rest_blocks, node)
            return
        k = _same_blocks(child.key, token_ids[:n * block_size], i * block_size, block_size,
                         min(len(child.blocks), n - i))
        i += k
        if k < len(child.blocks):
            if i == n:
                return
            child = split(child, k, block_size)
        node = child


def evict_leaf(leaf, num_blocks, block_size, is_unused):
    taken = []
    while leaf.blocks and len(taken) < num_blocks and is_unused(leaf.blocks[-1]):
        taken.append(leaf.blocks.pop())
        leaf.key = tuple(leaf.key[:-block_size])
    if not leaf.blocks:
        parent = leaf.parent
        for first, c in list(parent.children.items()):
            if c is leaf:
                del parent.children[first]
    return taken
